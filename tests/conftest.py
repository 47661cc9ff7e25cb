"""Files under tests/parallel and tests/tensorflow run only under mpirun (see tests/mpirun.py)."""
import os

collect_ignore_glob = []
if not os.environ.get("HOROLITE_UNDER_MPIRUN"):
    collect_ignore_glob += ["parallel/*", "tensorflow/test_*", "launcher_rank/*"]

import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
