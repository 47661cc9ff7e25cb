"""The failure channel's confirmation round (failure/channel.py, announce): a rank that
tells the others why the job cannot go on waits until each confirmed, at most ACK_SECONDS.
When several ranks find the same failure at once (two survivors of a host cut off, both
stalled on the same collective), each announces and none confirms; each must take the
others' notices for confirmations instead of waiting the whole ACK_SECONDS (an elastic
job's recovery waited 3 s more for it). Checked in both worlds: under mpirun at np 2-4,
and under horolite-run --gloo at np 3."""
import subprocess
import sys

import pytest

from mpirun import ROOT, gloo_command, mpirun_command

SCRIPT = """
import sys, time
import numpy as np
import horolite as hvd
from horolite.core.mpi_library import MPI
from horolite.failure.channel import FailureChannel
hvd.init()
r, n = hvd.rank(), hvd.size()
channel = FailureChannel(MPI.COMM_WORLD, ["h"] * n)
hvd.allreduce(np.ones(1), name="ready")
if sys.argv[1] == "all" or r == 0:
    assert channel.announce("rank %d found a stall" % r)
    print("RANK %d UNCONFIRMED %s" % (r, channel.unconfirmed), flush=True)
else:
    while channel.check() is None:
        time.sleep(0.001)
    channel.acknowledge()
    channel.await_release()
    print("RANK %d HEARD %d" % (r, channel.heard.rank), flush=True)
hvd.allreduce(np.ones(1), name="done")
"""


def run(command, case):
    proc = subprocess.run(command + [sys.executable, "-c", SCRIPT, case], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.parametrize("world,np_", [("mpi", 2), ("mpi", 3), ("mpi", 4), ("gloo", 3)])
def test_ranks_that_announce_at_once_take_each_others_notice_for_confirmation(world, np_):
    out = run((mpirun_command if world == "mpi" else gloo_command)(np_), "all")
    for r in range(np_):
        assert f"RANK {r} UNCONFIRMED []" in out, out[-3000:]


@pytest.mark.parametrize("world,np_", [("mpi", 3), ("gloo", 2)])
def test_one_rank_announces_and_every_other_confirms(world, np_):
    out = run((mpirun_command if world == "mpi" else gloo_command)(np_), "one")
    assert "RANK 0 UNCONFIRMED []" in out, out[-3000:]
    for r in range(1, np_):
        assert f"RANK {r} HEARD 0" in out, out[-3000:]
