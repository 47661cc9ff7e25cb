"""heartbeat.processes_gone: how a rank tells that a peer on its host was killed."""
import os
import signal
import subprocess
import sys

from horolite.failure.heartbeat import processes_gone


def test_a_killed_process_is_gone_and_a_running_one_is_not():
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()  # reaped: no longer in the process table
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
        assert processes_gone([os.getpid(), running.pid, killed.pid, zombie.pid]) == \
            [killed.pid, zombie.pid]
    finally:
        running.kill()
        running.wait()
        zombie.wait()
