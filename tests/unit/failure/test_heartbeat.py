"""heartbeat.processes_gone: how a rank tells that a peer on its host was killed."""
import os
import signal
import subprocess
import sys

from horolite.failure.heartbeat import processes_gone, stat_says_gone


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


def test_a_process_inside_exit_is_gone_before_it_is_a_zombie():
    # /proc/<pid>/stat of a process killed with SIGKILL while it tears down its memory:
    # still state R, with PF_EXITING (0x4) in its flags (the ninth field).
    stat = b"4242 (python (x)) R 4200 4242 4200 0 -1 4194564 300 0 0 0 5 3 0 0 20 0 2 0"
    assert stat_says_gone(stat)
    assert not stat_says_gone(stat.replace(b" 4194564 ", b" 4194560 "))  # the same, running
    assert stat_says_gone(b"4242 (python) Z 4200 4242 4200 0 -1 4194560 300")
    assert stat_says_gone(b"garbage")
    with open(f"/proc/{os.getpid()}/stat", "rb") as f:
        assert not stat_says_gone(f.read())
