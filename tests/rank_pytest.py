"""One rank's side of a matrix run: pytest the given file, output to rank<N>.log."""
import os
import sys
import tempfile

import pytest


def main():
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    outdir = os.environ.get("HOROLITE_TEST_OUTDIR") or tempfile.gettempdir()
    log = open(os.path.join(outdir, f"rank{rank}.log"), "w", buffering=1)
    sys.stdout = sys.stderr = log
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ["HOROLITE_UNDER_MPIRUN"] = "1"
    code = pytest.main(["-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly", *sys.argv[1:]])
    if "horolite" in sys.modules:
        sys.modules["horolite"].shutdown()
    log.flush()
    sys.exit(int(code))


if __name__ == "__main__":
    main()
