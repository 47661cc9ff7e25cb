"""Mutation testing for the guarantees only the rank-side tests under mpirun can check.

Each mutant breaks one guarantee with a small edit of the source. The script copies the
repository (without .git and .venv) to a temporary directory, applies one mutant there
at a time, runs the rank-side test that claims the guarantee under a real mpirun (the
drivers' tests/mpirun.py), and reports KILLED (the test failed) or SURVIVED. The
working tree is never edited. It first runs each test on the unmutated copy: a test
that fails there proves nothing about its mutant.

    python tools/mutants_multirank.py            # every mutant
    python tools/mutants_multirank.py board      # the mutants whose name contains "board"
    python tools/mutants_multirank.py --list

The native TensorFlow ops are rebuilt for the mutated enqueue_op.cc (their cache is
keyed by the sources), which takes up to a few minutes on a loaded machine.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NATIVE = "tests/tensorflow/test_tf_native_enqueue.py"
BUCKETS = "tests/tensorflow/test_tf_buckets.py"
BUCKETS_ON = {"HOROLITE_GRADIENT_BUCKET_MB": "0.3", "HOROLITE_TEST_EXPECT_BUCKETS": "1"}
# A test left waiting for a tensor that never comes fails in seconds instead of at the timeout.
STALL_ENDS_JOB = {"HOROLITE_STALL_CHECK_TIME_SECONDS": "5", "HOROLITE_STALL_SHUTDOWN_TIME_SECONDS": "10"}
# name, file, text, its replacement, the tests that must fail: (rank-side file, np, -k, env)
MUTANTS = [
    ("enqueue op keeps no input Tensor", "horolite/tensorflow/enqueue_op.cc",
     "      in->tensors.push_back(t);\n", "      (void)t;\n",
     [(NATIVE, 2, "freed", {})]),
    ("no control board", "horolite/transport/control_board.py",
     "    return ControlBoard(comm, words, polite) if local and comm.Get_size() > 1 else None\n",
     "    return None\n",
     [("tests/parallel/test_small_collectives.py", 2, "board", {"HOROLITE_TEST_EXPECT_BOARD": "1"})]),
    ("fused batches split 39 + 1", "horolite/execution/fusion.py",
     "            if k == key:\n", "            if k == key and i - start < 39:\n",
     [(NATIVE, 2, "one_batch and 130x130", {})]),
    ("Adasum prescale after the sum", "horolite/execution/adasum.py",
     "    kernels.pack_into(flat, inputs, first.prescale)\n",
     "    kernels.pack_into(flat, inputs, 1.0)\n",
     [("tests/parallel/test_adasum.py", 2, "prescale", {})]),
    ("traced group holds nothing", "horolite/tensorflow/traced_groups.py",
     "            self._held[index] = held\n", "            return [held], stale\n",
     [(NATIVE, 2, expr, {}) for expr in ("one_batch and float32-5x7", "wait_for_itself",
                                         "stateful", "fails_before")]),
    ("backprop does not wait for a bucket's enqueue", "horolite/tensorflow/gradients.py",
     "                order.order_after(tensors)\n", "                pass\n",
     [(BUCKETS, 2, expr, BUCKETS_ON) for expr in ("tape_in_a_function_overlaps",
                                                  "fit_applies_the_averaged")]),
    ("bucket order gives an edge to an op a collective inside backprop needs (a cycle)",
     "horolite/tensorflow/bucket_order.py",
     "            if op._is_stateful or op._get_control_flow_context() is not None or op in self.later:\n",
     "            if op._is_stateful or op._get_control_flow_context() is not None:\n",
     [(BUCKETS, 2, "sync_batch_norm_trains_in_buckets", BUCKETS_ON)]),
    ("the Keras update runs before every bucket is back", "horolite/tensorflow/keras/__init__.py",
     "            if tf.executing_eagerly():\n                return super().apply(reduced, trainable_variables)\n",
     "            if True:\n                return super().apply(reduced, trainable_variables)\n",
     [(BUCKETS, 2, "fit_failing_after", dict(BUCKETS_ON, **STALL_ENDS_JOB))]),
    ("a failed step's missing buckets are never abandoned", "horolite/api/buckets.py",
     "                handles.append(self._send(name, abandon_async, name, why, self.process_set))\n",
     "                pass\n",
     [("tests/parallel/test_buckets.py", 2, "discarded", STALL_ENDS_JOB),
      (BUCKETS, 2, "failing_after", dict(BUCKETS_ON, **STALL_ENDS_JOB))]),
    ("an abandon notice covers only its own name, not a group's separate members",
     "horolite/coordination/abandon.py",
     "        members = _members(table, base)\n", "        members = []\n",
     [("tests/parallel/test_buckets.py", 2, "discarded_with_a_bucket_of_mixed_dtypes",
       STALL_ENDS_JOB)]),
    ("a request sent again goes while its last run's is in flight", "horolite/api/buckets.py",
     "        if pending is None or pending.done():\n", "        if True:\n",
     [("tests/parallel/test_buckets.py", 2, "sent_again", {})]),
    ("a wait on the TCP link polls with sleeps instead of sleeping on its condition",
     "horolite/transport/tcp_link.py",
     "                changed.wait(next_watch - now)\n",
     "                changed.release()\n                time.sleep(1e-4)\n"
     "                changed.acquire()\n",
     [("tests/parallel/test_tcp_link.py", 2, "sleeps_in_the_kernel",
       {"HOROLITE_TEST_HOST_IDENTITY": "1+1"})]),
]
# The second half of the Adasum mutant: the prescale, moved after the sum.
EXTRA = {
    "Adasum prescale after the sum": (
        "    adasum_allreduce(executor.transport.link, flat, counts)\n",
        "    adasum_allreduce(executor.transport.link, flat, counts)\n"
        "    kernels.scale_into(flat, flat, first.prescale)\n"),
}


def copy_repo() -> str:
    dest = tempfile.mkdtemp(prefix="horolite-mutants-")
    shutil.copytree(ROOT, os.path.join(dest, "repo"), symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache"))
    return os.path.join(dest, "repo")


def replace_once(text: str, old: str, new: str, where: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(f"{where}: the mutated text is there {text.count(old)} times, not once: "
                         "the mutant needs updating")
    return text.replace(old, new)


def run_test(repo: str, path: str, np_: int, expr: str, env: dict, timeout: float):
    """(passed, the FAILED lines or the error's tail)."""
    code = ("import sys; sys.path.insert(0, 'tests'); from mpirun import run_pytest_file; "
            f"run_pytest_file({path!r}, {np_}, {env!r}, timeout={timeout}, "
            f"pytest_args=['-k', {expr!r}])")
    child = dict(os.environ, PYTHONPATH=repo, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, env=child,
                          capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    failed = sorted(set(re.findall(r"FAILED (\S+)", out)))
    return proc.returncode == 0, failed or [out.strip().splitlines()[-1] if out.strip() else "?"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="?", default="", help="run the mutants whose name has this")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--timeout", type=float, default=400, help="seconds per mpirun job")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if args.only in m[0]]
    if args.list or not chosen:
        for name, rel, _, _, tests in MUTANTS:
            print(f"{name} ({rel}):")
            for test, np_, expr, env in tests:
                print(f"    {test} -k '{expr}' at np {np_}")
        return 0 if chosen else 1
    repo = copy_repo()
    survived = 0
    try:
        for name, rel, old, new, tests in chosen:
            path = os.path.join(repo, rel)
            with open(path) as f:
                original = f.read()
            mutated = replace_once(original, old, new, rel)
            if name in EXTRA:
                mutated = replace_once(mutated, *EXTRA[name], rel)
            for test, np_, expr, env in tests:
                ok, why = run_test(repo, test, np_, expr, env, args.timeout)
                if not ok:
                    print(f"{name}: {test} -k '{expr}' fails without the mutant, nothing to "
                          f"judge: {why}", flush=True)
                    survived += 1
                    continue
                start = time.monotonic()
                with open(path, "w") as f:
                    f.write(mutated)
                try:
                    ok, why = run_test(repo, test, np_, expr, env, args.timeout)
                finally:
                    with open(path, "w") as f:
                        f.write(original)
                survived += ok
                print(f"{name}: {'SURVIVED' if ok else 'KILLED'} by {test} -k '{expr}' at np "
                      f"{np_} ({time.monotonic() - start:.0f} s)"
                      + ("" if ok else "\n    " + "\n    ".join(why)), flush=True)
    finally:
        shutil.rmtree(os.path.dirname(repo), ignore_errors=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
