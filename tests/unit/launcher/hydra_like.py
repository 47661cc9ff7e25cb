"""A stand-in for MPICH's mpiexec on one host: ``hydra_like.py N -- COMMAND...`` starts N
copies of COMMAND (rank i with PMI_RANK=i), and once one of them ends with an error, kills
the others with SIGKILL at once and exits 1, as hydra's clean-up does. SIGTERM is passed on
to every copy. Output goes straight to this process's own."""
import os
import signal
import subprocess
import sys


def main() -> int:
    n, command = int(sys.argv[1]), sys.argv[3:]
    procs = {}
    for rank in range(n):
        env = dict(os.environ, PMI_RANK=str(rank), PMI_SIZE=str(n))
        proc = subprocess.Popen(command, env=env)
        procs[proc.pid] = proc

    def forward(signum, frame):
        for proc in procs.values():
            proc.send_signal(signum)
    signal.signal(signal.SIGTERM, forward)
    code = 0
    while procs:
        pid, status = os.wait()
        procs.pop(pid, None)
        if os.waitstatus_to_exitcode(status) != 0 and code == 0:
            code = 1
            for proc in procs.values():
                proc.kill()
    return code


if __name__ == "__main__":
    sys.exit(main())
