"""horovodrun's flags and settings on a real job: a YAML --config-file, flags horolite does not
act on, hidden log timestamps, timestamped output, MPI's thread level; every rank checks what
it got, and rank 0 alone names each variable it will not honour, once."""
import os
import re
import shutil
import sys

import pytest

pytestmark = pytest.mark.skipif(
    shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    is None, reason="no mpirun installed")

RANK_SCRIPT = """
import os, numpy as np, horolite as hvd
hvd.init()
from horolite.core import config
c = config.from_environ()
assert (c.cycle_time_ms, c.cache_capacity, c.log_hide_time, c.mpi_threads_disable) == (4.0, 7, True, True), c
assert c.stall_check_disable and not hvd.mpi_threads_supported()
assert hvd.allreduce(np.ones(3), op=hvd.Sum, name="x").tolist() == [hvd.size()] * 3
print("rank", hvd.rank(), "ok")
"""


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_config_file_flags_and_unhonoured_warnings(run, tmp_path, np_):
    cfg = tmp_path / "horovod.yaml"
    cfg.write_text("params: {cycle_time_ms: 4, cache_capacity: 9}\n"
                   "stall_check: {enabled: false}\nlogging: {with_timestamp: false}\n"
                   "library_options: {mpi_threads_disable: true}\n")
    r = run("-np", np_, "--config-file", cfg, "--cache-capacity", "7", "--torus-allreduce",
            "--mpi", "--disable-cache", "-prefix-timestamp", sys.executable, "-c", RANK_SCRIPT,
            env={"HOROLITE_CYCLETIME": "3", "HOROVOD_ELASTIC": "1"})
    assert r.returncode == 0, r.stderr
    for rank in range(np_):
        assert re.search(rf"^\w{{3}} \w{{3}} \d\d [\d:]+ \d{{4}}\[{rank}\]<stdout>:rank {rank} ok$",
                         r.stdout, re.M), r.stdout
    warnings = [line for line in r.stderr.splitlines() if " WARNING " in line]
    named = sorted(re.search(r"WARNING horolite.api.basics: (\w+) is set but", w).group(1)
                   for w in warnings)
    assert named == ["HOROLITE_CYCLETIME", "HOROVOD_ELASTIC", "HOROVOD_TORUS_ALLREDUCE"], warnings
    assert all("]<stderr>:[horolite rank 0/" in w for w in warnings)  # rank 0, no timestamp
    assert "HOROLITE_HIERARCHICAL_ALLREDUCE=1 is the nearest" in r.stderr


def test_refused_flag_starts_nothing(run, tmp_path):
    r = run("-np", "2", "--jsrun", sys.executable, "-c", "open(%r, 'w')" % str(tmp_path / "ran"))
    assert r.returncode == 2
    assert "--jsrun is not supported: horolite launches through mpirun or by itself" in r.stderr
    assert not (tmp_path / "ran").exists()
