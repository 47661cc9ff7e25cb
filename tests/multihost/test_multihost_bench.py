"""bench/multihost_bandwidth.py runs end to end on a tiny size (a smoke run, no speed checked)."""
import json
import os
import subprocess
import sys

from jobs import ROOT


def test_multihost_bandwidth_smoke(bed, tmp_path):  # `bed`: skips where no bed can be built
    out = tmp_path / "mh.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "multihost_bandwidth.py"),
                           "--sizes", "262144", "--blocks", "1", "--min-iters", "2",
                           "--max-iters", "2", "--rate", "1gbit", "--layouts", "2x2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"2x2"}  # 2x1 runs the same code without the flat ring
    row = doc["results"]["2x2"]["rows"][0]
    assert row["bytes"] == 262144 and row["horolite_s"] > 0 and row["mpi_s"] > 0
    assert row["hierarchical"] and row["flat_s"] > 0
    assert (tmp_path / "mh.md").exists()
