"""A job without mpirun under a real torchrun (torch.distributed.run): its agent serves
its own store on MASTER_PORT for the whole job, and horolite's rank 0 serves the
rendezvous beside it (docs/clusters.md). Skips where torch is not installed."""
import os
import shutil
import subprocess
import sys

import pytest

from mpirun import ROOT
from test_world_setup import clean_env, finish, free_port, marks

pytest.importorskip("torch", reason="torch is not installed (.ci/run installs torch==2.13.0)")


def test_torchrun_nproc_per_node_2(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    script = os.path.join(ROOT, "tests", "world_rank", "reduce_and_mark.py")
    proc = subprocess.Popen([torchrun, "--nproc-per-node=2", f"--master-port={free_port()}",
                             script, str(tmp_path)], env=clean_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (out,) = finish([proc], timeout=120)
    assert proc.returncode == 0, out[-4000:]
    assert marks(tmp_path, 2) == [f"{r} 2 {r} 2 ok" for r in range(2)]
    assert "identity from torchrun" in out, out[-3000:]
