"""horolite on Ray against the same job under horolite-run, in one run.

    python bench/ray_step.py [--np 2 4] [--steps 300] [--rounds 3]

Joins the Ray cluster RAY_ADDRESS names, or starts a local one with --np CPUs.

- **Step**: each rank multiplies two 256 x 256 matrices (the compute) and allreduces a
  model's gradients (20 tensors, 4 MiB in all) per step. The same steps run on
  RayExecutor's workers and on `horolite-run --gloo` ranks (both: horolite's own world,
  no MPI), rounds alternating; the ratio is Ray's median seconds per step over
  horolite-run's. Target (issue 61): <= 1.05.
- **Start**: from RayExecutor.start() to the first completed allreduce, less Ray's own
  start of as many bare actors in a placement group (measured just before it). Target:
  <= 5 s beyond Ray's actor start-up.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

SIZES = [1 << 17] * 4 + [1 << 15] * 16  # float32: 2 MiB + 2 MiB, 20 tensors


def steps(count: int) -> float:
    """Run `count` steps after 10 warm ones; seconds per step (the slowest rank's)."""
    import horolite as hvd
    hvd.init()
    rng = np.random.default_rng(hvd.rank())
    grads = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
    a = rng.standard_normal((256, 256)).astype(np.float32)

    def one():
        b = a
        for _ in range(4):
            b = np.tanh(b @ a)
        hvd.grouped_allreduce(grads, name="grads")
    for _ in range(10):
        one()
    hvd.allreduce(np.zeros(1), name="start")
    t0 = time.perf_counter()
    for _ in range(count):
        one()
    took = (time.perf_counter() - t0) / count
    return float(hvd.allreduce(np.array([took]), op=hvd.Max, name="took")[0])


def first_allreduce() -> float:
    import horolite as hvd
    hvd.init()
    return float(hvd.allreduce(np.ones(1), op=hvd.Sum, name="first")[0])


def horolite_run(np_: int, count: int) -> float:
    cmd = ["horolite-run", "--gloo", "-np", str(np_), sys.executable, os.path.abspath(__file__),
           "--rank-side", str(count)]
    # Ray gives each actor OMP_NUM_THREADS=1 (its CPU); the same for these ranks.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return float([line for line in proc.stdout.splitlines() if "step " in line][0].split()[-1])


class _Bare:
    def ping(self):
        return os.getpid()


def ray_actor_start(ray, np_: int) -> float:
    """Ray's own start of np_ bare actors in a packed placement group, pinged once."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    t0 = time.perf_counter()
    group = placement_group([{"CPU": 1}] * np_, strategy="PACK")
    ray.get(group.ready())
    actor = ray.remote(_Bare)
    actors = [actor.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=i)).remote() for i in range(np_)]
    ray.get([a.ping.remote() for a in actors])
    took = time.perf_counter() - t0
    for a in actors:
        ray.kill(a)
    remove_placement_group(group)
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--np", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rank-side", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_side is not None:
        took = steps(args.rank_side)
        import horolite as hvd
        if hvd.rank() == 0:
            print(f"step {took:.6f}", flush=True)
        return
    import ray
    from horolite.ray import RayExecutor
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    else:
        ray.init(num_cpus=max(args.np), log_to_driver=False, include_dashboard=False)
    print("np  ray_step_ms  run_step_ms  ratio  target  ray_actors_s  start_to_allreduce_s"
          "  beyond_ray_s  target")
    for np_ in args.np:
        on_ray, on_run, starts = [], [], []
        for _ in range(args.rounds):
            bare = ray_actor_start(ray, np_)
            t0 = time.perf_counter()
            executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=np_)
            executor.start()
            executor.run(first_allreduce)
            starts.append((bare, time.perf_counter() - t0))
            try:
                on_ray.append(executor.run(steps, args=[args.steps])[0])
            finally:
                executor.shutdown()
            on_run.append(horolite_run(np_, args.steps))
        ray_s, run_s = statistics.median(on_ray), statistics.median(on_run)
        bare, total = (statistics.median(x) for x in zip(*starts))
        ratio = ray_s / run_s
        print(f"{np_:<3d} {ray_s * 1e3:11.3f} {run_s * 1e3:12.3f} {ratio:6.3f}  "
              f"{'met' if ratio <= 1.05 else 'missed':6s}  {bare:12.2f}  {total:20.2f}  "
              f"{total - bare:12.2f}  {'met' if total - bare <= 5 else 'missed'}", flush=True)


if __name__ == "__main__":
    main()
