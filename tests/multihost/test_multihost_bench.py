"""The benchmarks that build simulated hosts run end to end on a tiny size (smoke runs, no speed checked)."""
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


def test_thread_cpu_step_smoke(bed, tmp_path):
    """bench/thread_cpu_step.py end to end on a tiny model over horolite's TCP connections,
    in a job under mpirun and in one started without MPI (--gloo)."""
    out = tmp_path / "tc.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "thread_cpu_step.py"),
                           "--transports", "tcp,gloo", "--model", "2x16:8", "--steps", "2",
                           "--warmup", "1", "--rate", "", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [run["asked"] for run in doc["runs"]] == ["tcp", "gloo"]
    for run in doc["runs"]:
        assert [r["transport"] for r in run["ranks"]] == ["tcp", "tcp"]
        for rank in run["ranks"]:
            assert set(rank["rows"]) == {"plain", "exchange", "tape"}
            cpu, _, user = rank["rows"]["exchange"]["threads"]["tcp link"]  # I/O threads seen
            assert cpu >= 0 and user >= 0  # (user space: in clock ticks, not below cpu's)
    assert (tmp_path / "tc.md").exists()


def test_world_compare_across_hosts_smoke(bed):
    """bench/world_compare.py --hosts: a job in each world (mpirun and --gloo) across two
    simulated hosts of its own, every row with both worlds' numbers and a verdict."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "world_compare.py"),
                           "--tiny", "--hosts", "2x1"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 4, proc.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[2].split()[0]) > 0 and float(cells[3].split()[0]) > 0, row
        assert cells[5].endswith(("met", "missed")), row
