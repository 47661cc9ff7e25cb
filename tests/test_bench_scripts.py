"""Each benchmark script runs on a tiny size under mpirun -np 2 and writes valid JSON.

Benchmarks are scripts, not timed tests: nothing here checks a speed, only
that the script runs end to end and its JSON has the keys docs/benchmarks.md
and the plots are built from.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from mpirun import ROOT, mpirun_command

COMMON_KEYS = {"benchmark", "command", "ranks", "date", "versions", "targets",
               "other_processes_busy_fraction"}
TARGET_KEYS = {"name", "value", "bound", "unit", "comparison", "met", "limited_by"}


def run_bench(script: str, tmp_path, *extra, timeout=240) -> dict:
    out = tmp_path / f"{script}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cmd = mpirun_command(2) + [sys.executable, os.path.join(ROOT, "bench", f"{script}.py"),
                               "--tiny", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    doc = json.loads(out.read_text())
    assert COMMON_KEYS <= doc.keys(), COMMON_KEYS - doc.keys()
    assert doc["benchmark"] == script and doc["ranks"] == 2
    for target in doc["targets"]:
        assert TARGET_KEYS <= target.keys()
        assert target["met"] in (True, False, None)
    assert (tmp_path / f"{script}.md").exists()
    return doc


def test_allreduce_bandwidth(tmp_path):
    doc = run_bench("allreduce_bandwidth", tmp_path)
    assert [r["bytes"] for r in doc["rows"]] == doc["sizes"]
    for row in doc["rows"]:
        for key in ("horolite_s", "mpi_s", "bound_s", "horolite_busbw", "mpi_busbw",
                    "busbw_ratio_vs_mpi", "time_ratio_vs_bound"):
            assert row[key] > 0, key
        if "gloo" in doc["peers"]:
            assert row["gloo_s"] > 0


def test_small_tensors(tmp_path):
    doc = run_bench("small_tensors", tmp_path)
    for key in ("grouped_step_s", "async_step_s", "mpi_step_s", "horolite_4KiB_s",
                "horolite_1MiB_s", "mpi_4KiB_s", "mpi_1MiB_s"):
        assert doc["results"][key] > 0, key
    assert any("4 KiB" in t["name"] for t in doc["targets"])


def test_heartbeat_cost(tmp_path):
    doc = run_bench("heartbeat_cost", tmp_path, "--no-plot")
    for key in ("4KiB_on_s", "4KiB_off_s", "async_on_s", "async_off_s", "tick_idle_s",
                "tick_look_s"):
        assert doc["results"][key] > 0, key


def test_tf_wait_op(tmp_path):
    pytest.importorskip("tensorflow")
    doc = run_bench("tf_wait_op", tmp_path, "--no-plot")
    timed = [v for v in doc.values() if isinstance(v, dict) and "ratio" in v]
    assert len(timed) == 3 and all(v["native_s"] > 0 and v["python_s"] > 0 for v in timed)


def test_tf_ops(tmp_path):
    pytest.importorskip("tensorflow")
    doc = run_bench("tf_ops", tmp_path)
    if shutil.which("g++"):  # (tests/test_tf_native_op.py: they build wherever g++ is)
        assert doc["native_ops"] is True
    for key in ("numpy_grouped", "tf_per_tensor", "tf_grouped", "tf_identity", "tf_eager_loop",
                "tape_plain", "tape_distributed"):
        assert doc["seconds"][key] > 0, key
    assert len(doc["targets"]) == 6


def test_steady_state_memory(tmp_path):
    doc = run_bench("steady_state_memory", tmp_path)
    assert len(doc["per_rank"]) == 2
    assert doc["calls"] >= 200
    assert all(len(r["samples"]) >= 2 for r in doc["per_rank"])


def test_training_throughput(tmp_path):
    pytest.importorskip("tensorflow")
    doc = run_bench("training_throughput", tmp_path, "--no-plot", timeout=420)
    for system in ("single", "horolite", "mwms"):
        assert doc[system]["images_per_sec"] > 0, system
    # the machine's part of the efficiency: every rank's plain process, timed together
    (round_,) = doc["rounds"]
    assert round_["no_exchange"]["images_per_sec"] > 0
    assert len(doc["no_exchange_vs_single_by_round"]) == len(doc["horolite_vs_no_exchange_by_round"]) == 1
    # both targets' reading: interleaved blocks of the five, in the same processes
    # (one_rank: the horolite step as a job of rank 0 alone; mwms: its kept workers)
    assert set(doc["blocks"]) == {"single", "one_rank", "no_exchange", "horolite", "mwms"}
    assert all(len(v) == 2 for v in doc["blocks"].values())
    assert min(min(v) for v in doc["blocks"].values()) > 0
    assert doc["ratios_vs_mwms_by_block"] == [h / m for h, m in zip(doc["blocks"]["horolite"],
                                                                      doc["blocks"]["mwms"])]
    assert doc["ratio_vs_mwms"] == sorted(doc["ratios_vs_mwms_by_block"])[1]
    assert doc["efficiencies_by_block"] == [h / (2 * o) for h, o in zip(doc["blocks"]["horolite"],
                                                                         doc["blocks"]["one_rank"])]
    assert doc["scaling_efficiency"] == sorted(doc["efficiencies_by_block"])[1]
    assert doc["scaling_efficiency_vs_plain"] == sorted(doc["efficiencies_vs_plain_by_block"])[1]
    assert doc["scaling_efficiency"] > 0 and doc["ratio_vs_mwms"] > 0
    assert doc["plot"] is None
    assert {t["name"].split(",")[0] for t in doc["targets"]} >= {
        "images/sec", "scaling efficiency (2 ranks vs 2 x 1 rank of the same horolite step",
        "stricter"}


def test_autotune_recovery(tmp_path):
    doc = run_bench("autotune_recovery", tmp_path)
    assert set(doc["hand_set_bytes_per_s"]) == {"1", "5", "50"}
    assert doc["autotune_settled_bytes_per_s"] > 0 and len(doc["setting"]) == 2
    assert len(doc["rounds"]) == 1 and set(doc["rounds"][0]) == {"1", "5", "50", "tuned"}
    best = max(doc["rounds"][0][c] for c in ("1", "5", "50"))
    assert doc["tuned_vs_best"] == pytest.approx(doc["rounds"][0]["tuned"] / best)


def test_timeline_cost(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "timeline_cost.py"),
                           "--events", "300", "--repeat", "1", "--per-cycle", "1", "16",
                           "--dir", str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 1") or
            line.startswith("| 16")]
    assert len(rows) == 2 and all(line.endswith("x |") for line in rows), proc.stdout
    assert not list(tmp_path.iterdir())  # its file is removed


def test_quorum_stragglers(tmp_path):
    doc = run_bench("quorum_stragglers", tmp_path)
    assert set(doc["median_seconds_per_step"]) == {"all", "quorum", "no straggler"}
    assert min(doc["median_seconds_per_step"].values()) > 0 and doc["all_vs_quorum"] > 0


def test_gpu_allreduce(tmp_path):
    """On a GPU machine: the staged path at np 2 (or NCCL where each rank has a GPU);
    without one the script says why it skipped and writes nothing."""
    from horolite.core.device import cuda_device_count, nccl_status
    if cuda_device_count() == 0:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        out = tmp_path / "gpu_allreduce.json"
        proc = subprocess.run(mpirun_command(2) + [sys.executable,
                                                   os.path.join(ROOT, "bench", "gpu_allreduce.py"),
                                                   "--tiny", "--out", str(out)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"gpu_allreduce skipped: {nccl_status()[1]}" in proc.stdout
        assert not out.exists()
        pytest.skip(f"no GPU here: {nccl_status()[1]}")
    doc = run_bench("gpu_allreduce", tmp_path)
    assert doc["mode"] in ("nccl", "staged") and doc["gpu"]
    key = "copy_over_horolite" if doc["mode"] == "nccl" else "staged_over_host_plus_copies"
    assert all(r[key] > 0 for r in doc["rows"])


def test_step_allreduce(tmp_path):
    pytest.importorskip("tensorflow")
    doc = run_bench("step_allreduce", tmp_path, timeout=420)
    res = doc["results"]
    assert set(res["host"]) == {"resnet50", "bert_base", "dense100"}
    assert res["host"]["resnet50"]["tensors"] == 214 and res["host"]["bert_base"]["tensors"] == 199
    for r in res["host"].values():
        times = r["block_medians_s"]
        assert set(times) == {"MPI_Allreduce", "one tensor", "one tensor, holding 2", "grouped",
                              "grouped, holding 2", "async", "async, holding 2"}
        assert all(len(v) == doc["blocks"] and min(v) > 0 for v in times.values())
    # device variants run only with CuPy and a GPU; otherwise each says why not
    assert all("skipped" in r or r["block_medians_s"] for r in res["device"].values())
    tf_times = res["tf"]["block_medians_s"]
    assert len(tf_times) == 8 and all(len(v) == doc["blocks"] and min(v) > 0
                                      for v in tf_times.values())
    names = {t["name"] for t in doc["targets"]}
    assert any(n.startswith("ResNet-50 step, grouped: time / one tensor") for n in names)
    assert any(n.startswith("DistributedGradientTape (tf.function): throughput") for n in names)


def test_adasum_step(tmp_path):
    doc = run_bench("adasum_step", tmp_path)
    for key in ("step_average_s", "step_adasum_s", "large_average_s", "large_adasum_s",
                "step_adasum_over_average", "large_adasum_over_average"):
        assert doc["results"][key] > 0, key


@pytest.mark.parametrize("script, extra", [("small_tensors", ()),
                                           ("step_allreduce", ("--models", "resnet50"))])
def test_the_straggler_record_ab_prints_its_ratios(tmp_path, script, extra):
    """--stragglers-ab (bench/straggler_ab.py): each row has both states' medians, the
    on / off ratio and the A/A ratio, as numbers."""
    import re
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = mpirun_command(2) + [sys.executable, os.path.join(ROOT, "bench", f"{script}.py"),
                               "--tiny", "--stragglers-ab", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    number = r"\d+\.\d+"
    ratio = rf"{number} \({number}-{number}\)"
    rows = re.findall(rf"^(.+?)\s+({number})\s+({number})\s+({ratio})\s+({ratio})$",
                      proc.stdout, re.M)
    assert len(rows) == 3, proc.stdout
    assert all(float(on) > 0 and float(off) > 0 for _, on, off, _, _ in rows), rows
    assert re.search(r"^exchanges with rank 0 on rank 0: \d+, ", proc.stdout, re.M), proc.stdout


def test_overlap_step(tmp_path):
    # Starts its own horolite-run (np 2 on this machine here; the simulated hosts as root by
    # default): the tape, fit and the exchange alone on a tiny model, every column present;
    # on pretend hosts (buckets and the lane on) with Adam, and without the update barrier.
    pytest.importorskip("tensorflow")
    out = tmp_path / "overlap_step.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "overlap_step.py"), "--local",
                           "--models", "2x16:8", "--iters", "2", "--blocks", "1", "--warmup", "1",
                           "--optimizer", "adam", "--barrier-cost",
                           "--env", "HOROLITE_TEST_HOST_IDENTITY=1+1",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    row, = doc["rows"]
    assert doc["optimizer"] == "adam"
    for key in ("plain_s", "forward_s", "exchange_s", "tape_s", "tape_one_group_s", "fit_s",
                "fit_plain_s", "tape_over_max", "bound_over_max", "tape_inline_s",
                "tape_no_barrier_s", "fit_no_barrier_s", "barrier_tape_ratio",
                "barrier_fit_ratio", "lane_tape_ratio", "lane_fit_ratio"):
        assert key in row and row[key] > 0, key
    assert (tmp_path / "overlap_step.md").exists()


def test_bucket_trace(tmp_path):
    # 8 variables, 2 later steps: every way (buckets, one request, plain) for fit and tape.
    pytest.importorskip("tensorflow")
    doc = run_bench("bucket_trace", tmp_path)
    assert doc["variables"] == 8 and doc["requests_per_step_with_buckets"] >= 1
    for how in ("fit", "tape"):
        for way in ("buckets", "one", "plain"):
            timed = doc["results"][f"{how}_{way}"]
            assert timed["first_s"] > 0 and timed["later_s"] > 0, (how, way)
        assert set(doc["results"][f"{how}_ratios"]) == {"later_buckets_over_one"}
    assert len(doc["targets"]) == 2


def test_bucket_trace_first_runs_each_way_in_a_job_of_its_own(tmp_path):
    # Six jobs of 8 variables: each way's first step timed in a fresh process, then the
    # first-step ratios (buckets over one request, either over plain) for fit and tape.
    pytest.importorskip("tensorflow")
    out = tmp_path / "first.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bucket_trace_first.py"),
                           "--tiny", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["variables"] == 8 and doc["np"] == 2
    for how in ("fit", "tape"):
        got = doc["results"][how]
        assert all(len(got["first_s"][w]) == 1 and got["first_s"][w][0] > 0
                   for w in ("buckets", "one", "plain")), got
        b, o, p = (got["first_s"][w][0] for w in ("buckets", "one", "plain"))
        assert abs(got["buckets_over_one"] - b / o) < 1e-9
        assert abs(got["either_over_plain"] - max(b, o) / p) < 1e-9
    assert [t["name"] for t in doc["targets"]] == [
        f"{how}: first step, {what}" for how in ("fit", "tape")
        for what in ("buckets over num_groups=1", "either over plain Keras")]


def test_control_plane(tmp_path, monkeypatch):
    monkeypatch.setenv("HOROLITE_TEST_HOST_IDENTITY", "1+1")  # (every rank a host's leader)
    doc = run_bench("control_plane", tmp_path)
    for key in ("or_tree_s", "or_ring_s", "negotiate_tree_s", "negotiate_ring_s",
                "allreduce_4KiB_tree_s"):
        assert doc["results"][key] > 0, key


def test_world_compare_prints_every_ratio():
    # One short round per world: jobs under mpirun and under horolite-run --gloo, each row
    # with both worlds' numbers, a ratio and its target.
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "world_compare.py"),
                           "--tiny"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 4, proc.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[4]) > 0 and cells[5].endswith(("met", "missed")), row


def test_elastic_in_process_prints_every_figure():
    # One round at np 2: a job with --min-np whose rank 1 is killed, and one without.
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "elastic_in_process.py"),
                           "--np", "2", "--rounds", "1"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = proc.stdout.splitlines()[-1].split()
    # (re-formation: a survivor alone re-forms in well under a millisecond)
    assert row[0] == "2" and float(row[1]) > 0 and float(row[3]) >= 0, proc.stdout
    assert float(row[5]) > 0 and row[7].endswith("x") and float(row[7][:-1]) > 0, proc.stdout
