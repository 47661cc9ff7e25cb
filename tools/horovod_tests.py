"""Run Horovod 0.28.1's own TensorFlow test files against horolite, under real mpirun.

    git clone --depth 1 --branch v0.28.1 https://github.com/horovod/horovod /tmp/horovod
    pip install parameterized mock cloudpickle          # what those test files import
    python tools/horovod_tests.py --horovod /tmp/horovod [--np 2] [--per-test] [FILE...]

The checkout is read, never copied into this repository. The test files import
`horovod.*`: a shim package made in a temporary folder maps `horovod.tensorflow`,
`horovod.tensorflow.keras` and `horovod.keras` (and their submodules) to horolite's
modules, and supplies the few helpers of Horovod's own that the files import besides
(`horovod.common.util.is_version_greater_equal_than`,
`horovod.runner.common.util.env.get_env_rank_and_size`,
`horovod.runner.util.threads.in_thread`). Nothing else is changed.

With --per-test every test runs as its own mpirun job (slow: a job starts TensorFlow);
without, each file is one job. A test passes when it passes on every rank. The table
(Markdown) and a JSON of every test's outcome and message are printed / written.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

FILES = ["test_tensorflow.py", "test_xla.py", "test_tensorflow_process_sets.py",
         "test_adasum_tensorflow.py", "test_tensorflow_process_sets_dynamic.py",
         "test_tensorflow2_keras.py", "test_tensorflow_keras.py"]

_SHIM_INIT = '''"""A shim: horovod.tensorflow, .keras -> horolite's modules (tools/horovod_tests.py)."""
import importlib
import importlib.abc
import importlib.util
import sys

_MAP = {"horovod.tensorflow": "horolite.tensorflow", "horovod.keras": "horolite.keras"}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        for prefix, real in _MAP.items():
            if name == prefix or name.startswith(prefix + "."):
                return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        for prefix, real in _MAP.items():
            if spec.name == prefix or spec.name.startswith(prefix + "."):
                return importlib.import_module(real + spec.name[len(prefix):])

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Alias())
'''

_COMMON_UTIL = '''from packaging import version


def is_version_greater_equal_than(ver, target):
    if not (isinstance(ver, str) and isinstance(target, str)):
        raise ValueError(f"This function only accepts string arguments, got {ver!r}, {target!r}")
    return version.parse(ver) >= version.parse(target)
'''

_RUNNER_ENV = '''import os


def get_env_rank_and_size():
    for rank_var, size_var in (("HOROVOD_RANK", "HOROVOD_SIZE"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE")):
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(f"only one of {rank_var} and {size_var} is set")
    return 0, 1
'''

_RUNNER_THREADS = '''import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
'''

_PLUGIN = '''"""pytest plugin for the Horovod test runs: each rank writes its own JUnit file."""
import os


def _rank():
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def pytest_configure(config):
    out = os.environ.get("HOROLITE_HVD_JUNIT_DIR")
    if out:
        config.option.xmlpath = os.path.join(out, f"rank{_rank()}.xml")
'''


def make_shim(folder: str) -> None:
    files = {"horovod/__init__.py": _SHIM_INIT, "horovod/common/__init__.py": "",
             "horovod/common/util.py": _COMMON_UTIL, "horovod/runner/__init__.py": "",
             "horovod/runner/common/__init__.py": "", "horovod/runner/common/util/__init__.py": "",
             "horovod/runner/common/util/env.py": _RUNNER_ENV,
             "horovod/runner/util/__init__.py": "", "horovod/runner/util/threads.py": _RUNNER_THREADS,
             "horolite_hvd_plugin.py": _PLUGIN}
    for rel, text in files.items():
        path = os.path.join(folder, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def collect(test_dir: str, name: str, env: dict) -> List[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "horolite_hvd_plugin", name], cwd=test_dir, env=env,
                          capture_output=True, text=True, timeout=600)
    return [line.strip() for line in proc.stdout.splitlines() if "::" in line]


def run_job(test_dir: str, target: str, np_: int, env: dict, timeout: float) -> Dict[str, dict]:
    """{test id: {"outcome", "message"}} over every rank of one mpirun job."""
    from mpirun import mpirun_command
    junit = tempfile.mkdtemp(prefix="horolite-hvd-junit-")
    job_env = dict(env, HOROLITE_HVD_JUNIT_DIR=junit)
    cmd = mpirun_command(np_) + [sys.executable, "-m", "pytest", "-q", "-p", "horolite_hvd_plugin",
                                 "-p", "no:cacheprovider", target]
    try:
        proc = subprocess.run(cmd, cwd=test_dir, env=job_env, capture_output=True, text=True,
                              timeout=timeout)
        tail = (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        tail = f"the job ran past {timeout:g} s and was stopped"
    results: Dict[str, dict] = {}
    for r in range(np_):
        path = os.path.join(junit, f"rank{r}.xml")
        if not os.path.exists(path):
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            tid = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = "skipped" if tag == "skipped" else "failed"
                    message = (node.get("message") or node.text or "")[:500]
                    break
            prev = results.get(tid)
            rank_note = f"rank {r}: {message}" if message else ""
            if prev is None:
                results[tid] = {"outcome": outcome, "message": rank_note}
            elif outcome == "failed" or (outcome == "skipped" and prev["outcome"] == "passed"):
                results[tid] = {"outcome": outcome, "message": rank_note or prev["message"]}
    if not results:
        results[target] = {"outcome": "failed", "message": f"no rank reported results: {tail}"}
    return results


def markdown(everything: Dict[str, Dict[str, dict]]) -> str:
    """One table per file: every test, its outcome, and the first line of why not passed."""
    out = []
    for name, results in everything.items():
        out += [f"#### {name}", "", "| test | result | message |", "|---|---|---|"]
        for tid, r in sorted(results.items()):
            why = r["message"].splitlines()[0].replace("|", "\\|")[:160] if r["message"] else ""
            out.append(f"| `{tid}` | {r['outcome']} | {why} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--horovod", required=True, help="a checkout of Horovod's repository (v0.28.1)")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--per-test", action="store_true", help="one mpirun job per test")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    p.add_argument("--out", default=None, help="JSON of every test's outcome")
    p.add_argument("--markdown", default=None,
                   help="also write every test's outcome as Markdown tables, one per file")
    p.add_argument("files", nargs="*", default=FILES)
    args = p.parse_args(argv)
    test_dir = os.path.join(args.horovod, "test", "parallel")
    if not os.path.isdir(test_dir):
        p.error(f"{test_dir} does not exist: give the root of a Horovod checkout")
    shim = tempfile.mkdtemp(prefix="horolite-hvd-shim-")
    make_shim(shim)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([shim, test_dir, os.path.join(args.horovod, "test", "utils"),
                                           ROOT, os.environ.get("PYTHONPATH", "")]))
    everything = {}
    print("| file | passed | failed | skipped |\n|---|---|---|---|", flush=True)
    for name in args.files:
        results: Dict[str, dict] = {}
        targets = collect(test_dir, name, env) if args.per_test else [name]
        for target in targets:
            results.update(run_job(test_dir, target, args.np, env, args.timeout))
        everything[name] = results
        counts = {k: sum(1 for r in results.values() if r["outcome"] == k)
                  for k in ("passed", "failed", "skipped")}
        print(f"| {name} | {counts['passed']} | {counts['failed']} | {counts['skipped']} |", flush=True)
    for name, results in everything.items():
        for tid, r in sorted(results.items()):
            if r["outcome"] != "passed":
                print(f"{name} {tid}: {r['outcome']}: {r['message'][:300]}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(everything))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"np": args.np, "per_test": args.per_test, "results": everything}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
