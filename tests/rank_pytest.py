"""One rank's side of a matrix run: pytest the given file, output to rank<N>.log, and
the counts of what passed, failed and skipped (with each skip's reason) to rank<N>.json
for the driver's summary (tests/mpirun.py)."""
import json
import os
import sys
import tempfile

import pytest


class Outcomes:
    """Counts this rank's results; a skip keeps its test id and reason."""

    def __init__(self):
        self.counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
        self.skips = []
        self.passed = []  # test ids (a skip on one rank may need another rank to have run it)

    def pytest_runtest_logreport(self, report):
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.counts["skipped"] += 1
            self.skips.append([report.nodeid, reason.replace("Skipped: ", "", 1)])
        elif report.failed:
            self.counts["failed" if report.when == "call" else "errors"] += 1
        elif report.when == "call":
            self.counts["passed"] += 1
            self.passed.append(report.nodeid)


def main():
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK",
                                                      os.environ.get("HOROLITE_RANK", "0"))))
    outdir = os.environ.get("HOROLITE_TEST_OUTDIR") or tempfile.gettempdir()
    log = open(os.path.join(outdir, f"rank{rank}.log"), "w", buffering=1)
    sys.stdout = sys.stderr = log
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ["HOROLITE_UNDER_MPIRUN"] = "1"
    outcomes = Outcomes()
    code = pytest.main(["-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly", *sys.argv[1:]],
                       plugins=[outcomes])
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump({"exit": int(code), **outcomes.counts, "skips": outcomes.skips,
                   "passed_ids": outcomes.passed}, f)
    if "horolite" in sys.modules:
        sys.modules["horolite"].shutdown()
    log.flush()
    sys.exit(int(code))


if __name__ == "__main__":
    main()
