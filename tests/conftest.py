"""Files under tests/parallel and tests/tensorflow run only under mpirun (see tests/mpirun.py)."""
import os

collect_ignore_glob = []
if not os.environ.get("HOROLITE_UNDER_MPIRUN"):
    collect_ignore_glob += ["parallel/*", "tensorflow/test_*", "launcher_rank/*"]

import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# With tests/ on sys.path, `import tensorflow` where TensorFlow is not installed would
# import tests/tensorflow/ as a namespace package, and pytest.importorskip("tensorflow")
# would go on to fail ("no attribute 'config'"): make that import fail as it should.
import importlib.util  # noqa: E402
_tf_spec = importlib.util.find_spec("tensorflow")
if _tf_spec is not None and _tf_spec.origin is None:
    sys.modules["tensorflow"] = None


# The Ray test cluster's token, before any test module imports Ray (tests/on_ray/ray_cluster.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "on_ray"))
from ray_cluster import use_session_token  # noqa: E402
use_session_token()

_seconds_by_file = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _seconds_by_file[path] = _seconds_by_file.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Where the suite's time went, by file (what CI's time is made of), and what ran inside
    the mpirun jobs: the driver's count above says only how many jobs."""
    if _seconds_by_file:
        terminalreporter.write_sep("=", "seconds by file (the slowest 25)")
        for path, seconds in sorted(_seconds_by_file.items(), key=lambda kv: -kv[1])[:25]:
            terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
    mpirun = sys.modules.get("mpirun")
    if mpirun is None or not mpirun.RESULTS["jobs"]:
        return
    res = mpirun.RESULTS
    terminalreporter.write_sep("=", "rank side (every rank of every mpirun job)")
    terminalreporter.write_line(f"{res['jobs']} jobs: {res['passed']} passed, {res['skipped']} skipped "
                                "(each skip expected on this machine)")
    for reason, count in sorted(res["reasons"].items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"  {count:6d} skipped: {reason}")
