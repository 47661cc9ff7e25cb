"""Who ends first in a failed job under plain mpirun (review M5, tcp-transport.md).

A failed job's ranks end together (failure/channel.py: say_ended, await_ended), and plain
mpirun (and srun) name the first rank to end with an error as the job's failure: that must
be the rank the failure came from, not the one whose handler took longest. And an error
while the ranks say they ended must not keep a rank from ending with its code.

Each rank records the moment it ends, and from which thread, in the os._exit that
horolite's exit path calls; a rank mpirun ends first records nothing.
"""
import subprocess
import sys

from mpirun import ROOT, mpirun_command

SCRIPT = """
import os, sys, threading, time
import numpy as np
import horolite as hvd
out, case = sys.argv[1], sys.argv[2]
hvd.init()
r = hvd.rank()
real_exit = os._exit
def recorded_exit(code):
    with open(os.path.join(out, "exit.%d" % r), "w") as f:
        f.write("%r %d %s" % (time.time(), code, threading.current_thread().name))
    real_exit(code)
os._exit = recorded_exit
hvd.allreduce(np.ones(2), name="warm")
open(os.path.join(out, "ready.%d" % r), "w").close()
if r == 1:  # once every rank is past the warm-up (its failure would be outside try)
    while not all(os.path.exists(os.path.join(out, "ready.%d" % q)) for q in range(4)):
        time.sleep(0.01)
    if case == "say-ended-raises":
        from horolite.failure.channel import FailureChannel
        def say_ended(self):
            raise RuntimeError("an MPI error, say")
        FailureChannel.say_ended = say_ended
    raise RuntimeError("bad batch")
try:
    hvd.allreduce(np.ones(2), name="never")
except Exception as e:
    if r == 3:  # a handler that takes its time (a checkpoint, say)
        time.sleep(1.5)
    open(os.path.join(out, "handled.%d" % r), "w").write(type(e).__name__)
    raise
"""


def run(case, tmp_path):
    proc = subprocess.run(mpirun_command(4) + [sys.executable, "-c", SCRIPT, str(tmp_path), case],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    exits = {}
    for r in range(4):
        path = tmp_path / f"exit.{r}"
        if path.exists():
            at, code, thread = path.read_text().split(" ", 2)
            exits[r] = (float(at), int(code), thread)
    return proc, exits, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_the_rank_the_failure_came_from_ends_first(tmp_path):
    proc, exits, out = run("slow-handler", tmp_path)
    assert proc.returncode != 0, out
    assert (tmp_path / "handled.3").exists(), out  # the slow handler ran to its end
    assert 1 in exits and exits[1][1:] == (1, "MainThread"), (exits, out)
    first = min(exits, key=lambda r: exits[r][0])
    assert first == 1, (exits, out)


def test_an_error_while_saying_it_ended_still_ends_the_rank_with_its_code(tmp_path):
    proc, exits, out = run("say-ended-raises", tmp_path)
    assert proc.returncode != 0, out
    # Ended by its own exit path (not the hard exit's thread, 3 s later, nor MPI_Finalize).
    assert 1 in exits and exits[1][1:] == (1, "MainThread"), (exits, out)
