"""Training throughput: DistributedGradientTape against MultiWorkerMirroredStrategy.

Images/sec of one Keras CNN on synthetic 32x32x3 images, every process with
one TensorFlow thread (intra- and inter-op parallelism 1), measured in turn:
1. one process alone (plain TensorFlow, no distribution);
2. horolite: every rank of this job trains with hvd.DistributedGradientTape;
3. tf.distribute.MultiWorkerMirroredStrategy: one worker per rank, started by
   each rank as a child process, talking over loopback ports (TF_CONFIG);
4. one plain process per rank, all timed at once with no exchange at all: what
   the machine itself allows that many processes (shared memory bandwidth,
   caches, a VM's cores), so a missed efficiency splits into the machine's
   part and the exchange's part.
The rounds above pair numbers measured tens of seconds apart, and this VM's
speed moves within that; so both targets are read from a second measurement
in this job: short blocks in turn, in the same processes, of (1) on rank 0
while the others wait, (5) the horolite step as a job of rank 0 alone (what
`-np 1` runs: the runtime restarted on MPI.COMM_SELF), (4), (2) and (3), whose
workers are started once and run one block on request; the median of the
per-block ratios.
Scaling efficiency (the issue's: n ranks against n x one rank, each with one
thread) = (2) / (ranks x (5)). Reported beside it, stricter: (2) / (ranks x
(1)), which also charges horolite's own per-step cost at one rank.

    horolite-run -np 2 python bench/training_throughput.py
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import common
from common import Target

HERE = os.path.abspath(__file__)


def _tf(threads: int = 1):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    return tf


def build_model(tf, args):
    layers = tf.keras.layers
    return tf.keras.Sequential([
        tf.keras.Input((args.image, args.image, 3)),
        layers.Conv2D(32, 3, activation="relu"),
        layers.MaxPooling2D(),
        layers.Conv2D(64, 3, activation="relu"),
        layers.MaxPooling2D(),
        layers.Flatten(),
        layers.Dense(128, activation="relu"),
        layers.Dense(10),
    ])


def synthetic_batch(tf, args, seed: int):
    g = tf.random.Generator.from_seed(seed)
    x = g.normal((args.batch, args.image, args.image, 3))
    y = g.uniform((args.batch,), maxval=10, dtype=tf.int32)
    return x, y


def timed_loop(step, args, barrier=None) -> float:
    """Seconds for args.steps steps after args.warmup steps."""
    for _ in range(args.warmup):
        step()
    if barrier is not None:
        barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    float(loss)  # wait for the last step's result
    return time.perf_counter() - t0


# ---- the three systems ----

def training_steps(tf, args, seed: int, hvd=None):
    """(model, the plain step, the step through hvd.DistributedGradientTape or None):
    one model, optimizer and batch, as every measurement here trains them."""
    model = build_model(tf, args)
    opt = tf.keras.optimizers.SGD(0.01)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = synthetic_batch(tf, args, seed)

    def make(distributed: bool):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            if distributed:
                tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return step

    return model, make(False), make(True) if hvd is not None else None


def run_single(args) -> dict:
    tf = _tf()
    model, step, _ = training_steps(tf, args, 0)

    def wait_for_go():
        # (4): tell the parent the warm-up is done, and start timing when every rank's is
        print("READY", flush=True)
        sys.stdin.readline()

    seconds = timed_loop(step, args, barrier=wait_for_go if args.wait_for_go else None)
    return {"seconds": seconds, "images_per_sec": args.batch * args.steps / seconds,
            "parameters": int(sum(v.shape.num_elements() for v in model.trainable_variables))}


def _start_horolite(tf, args):
    """horolite up, the same initial weights on every rank; training_steps' result."""
    import horolite.tensorflow as hvd
    hvd.init()
    tf.keras.utils.set_random_seed(0)
    return hvd, training_steps(tf, args, hvd.rank(), hvd)


def run_horolite(args, comm) -> dict:
    from mpi4py import MPI
    tf = _tf()
    hvd, (_, _, step) = _start_horolite(tf, args)
    seconds = timed_loop(step, args, barrier=comm.Barrier)
    seconds = comm.allreduce(seconds, op=MPI.MAX)
    hvd.shutdown()
    n = comm.Get_size()
    return {"seconds": seconds, "images_per_sec": n * args.batch * args.steps / seconds}


class MwmsBlocks:
    """This rank's MultiWorkerMirroredStrategy worker, started once and kept for the
    interleaved blocks, so its blocks sit seconds from horolite's, as the other
    systems' do. It waits on a pipe between blocks (no CPU; TensorFlow's idle
    gRPC threads aside)."""

    def __init__(self, args, comm):
        import tempfile
        self.args, self.comm = args, comm
        n = comm.Get_size()
        ports = comm.bcast(",".join(str(common.free_port()) for _ in range(n))
                           if comm.Get_rank() == 0 else None)
        err = tempfile.TemporaryFile("w+")
        self.proc = _start_child(args, "--worker", "mwms", "--serve-blocks",
                                 "--index", str(comm.Get_rank()), "--ports", ports,
                                 stdin=subprocess.PIPE, stderr=err)
        self.proc.stderr_file = err
        self._expect("READY")  # built, compiled and warmed up

    def _expect(self, word: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(word):
                return line[len(word):].strip()
        _result(self.args, self.proc)  # it died: raises with its output
        raise RuntimeError("MultiWorkerMirroredStrategy worker stopped without a result")

    def block(self) -> float:
        """images/sec of one block, every worker at once (the slowest one's time)."""
        from mpi4py import MPI
        common.polite_barrier(self.comm)
        self.proc.stdin.write("GO\n")
        self.proc.stdin.flush()
        seconds = self.comm.allreduce(float(self._expect("BLOCK")), op=MPI.MAX)
        return self.comm.Get_size() * self.args.batch * self.args.block_steps / seconds

    def close(self) -> None:
        self.proc.stdin.write("STOP\n")
        self.proc.stdin.flush()
        _result(self.args, self.proc)
        self.proc.stderr_file.close()


def run_interleaved(args, comm) -> dict:
    """Blocks of: one process alone, one rank of horolite alone, every rank plain, every
    rank with horolite, each args.block_steps steps, in these processes, then
    MultiWorkerMirroredStrategy in its workers; images/sec of each, block by block."""
    from mpi4py import MPI
    tf = _tf()
    mwms = MwmsBlocks(args, comm)  # before horolite starts: its start-up is not timed
    common.polite_barrier(comm)
    hvd, (_, plain, horolite) = _start_horolite(tf, args)
    n, rank = comm.Get_size(), comm.Get_rank()
    block = argparse.Namespace(steps=args.block_steps, warmup=args.block_warmup)

    def together(step) -> float:
        """images/sec of every rank running `step` at once (the slowest rank's time)."""
        common.polite_barrier(comm)
        seconds = comm.allreduce(timed_loop(step, block, barrier=comm.Barrier), op=MPI.MAX)
        return n * args.batch * block.steps / seconds

    def alone(step, own_job: bool) -> float:
        """images/sec of `step` on rank 0 while the other ranks sleep; own_job: as a
        horolite job of rank 0 alone (what -np 1 runs), for the horolite step."""
        common.polite_barrier(comm)
        if own_job:
            hvd.shutdown()
        seconds = None
        if rank == 0:
            if own_job:
                hvd.init(comm=MPI.COMM_SELF)
            seconds = timed_loop(step, block)
            if own_job:
                hvd.shutdown()
        common.polite_barrier(comm)
        if own_job:
            hvd.init()
        return args.batch * block.steps / comm.bcast(seconds)

    rows = {"single": [], "one_rank": [], "no_exchange": [], "horolite": [], "mwms": []}
    try:
        for _ in range(args.blocks):
            rows["single"].append(alone(plain, False))
            rows["one_rank"].append(alone(horolite, True))
            rows["no_exchange"].append(together(plain))
            rows["horolite"].append(together(horolite))
            rows["mwms"].append(mwms.block())
    finally:
        hvd.shutdown()
    mwms.close()
    return rows


def run_mwms_worker(args) -> dict:
    ports = args.ports.split(",")
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": args.index}})
    tf = _tf()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        model = build_model(tf, args)
        opt = tf.keras.optimizers.SGD(0.01)
    loss_obj = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=tf.keras.losses.Reduction.NONE)
    x, y = synthetic_batch(tf, args, args.index)

    def replica_step():
        with tf.GradientTape() as tape:
            per_example = loss_obj(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=args.batch * n)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step():
        per_replica = strategy.run(replica_step)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    if not args.serve_blocks:
        return {"seconds": timed_loop(step, args), "replicas": n}
    # Kept running for the interleaved blocks: one block per "GO" on stdin, its seconds
    # on stdout, until "STOP".
    block = argparse.Namespace(steps=args.block_steps, warmup=args.block_warmup)
    for _ in range(args.warmup):
        step()
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "GO":
            break
        print(f"BLOCK {timed_loop(step, block)!r}", flush=True)
    return {"replicas": n}


# ---- orchestration (every rank of the horolite-run job) ----

def _start_child(args, *extra, stdin=None, stderr=subprocess.PIPE) -> subprocess.Popen:
    cmd = [sys.executable, HERE, "--batch", str(args.batch), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--image", str(args.image),
           "--block-steps", str(args.block_steps), "--block-warmup", str(args.block_warmup),
           *extra]
    return subprocess.Popen(cmd, env=common.child_env({"PYTHONUNBUFFERED": "1"}), stdin=stdin,
                            stdout=subprocess.PIPE, stderr=stderr, text=True)


def _result(args, proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=args.child_timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    if err is None and getattr(proc, "stderr_file", None) is not None:
        proc.stderr_file.seek(0)
        err = proc.stderr_file.read()
    raise RuntimeError(f"{' '.join(proc.args[2:])} worker failed (exit {proc.returncode}):\n"
                       f"{out[-2000:]}\n{(err or '')[-4000:]}")


def _child(args, *extra) -> dict:
    return _result(args, _start_child(args, *extra))


def run_no_exchange(args, comm) -> dict:
    """(4): one plain process per rank, their timed steps started together."""
    proc = _start_child(args, "--worker", "single", "--wait-for-go", stdin=subprocess.PIPE)
    if proc.stdout.readline().strip() != "READY":
        _result(args, proc)  # it died before its timed steps: raises with its output
    common.polite_barrier(comm)  # (a rank that raised above makes horolite-run stop the job)
    proc.stdin.write("GO\n")
    proc.stdin.flush()
    mine = _result(args, proc)
    workers = comm.allgather(mine)
    seconds = max(w["seconds"] for w in workers)  # like horolite's: the slowest rank's time
    n = comm.Get_size()
    return {"seconds": seconds, "images_per_sec": n * args.batch * args.steps / seconds}


def _say(comm, what: str) -> None:
    if comm.Get_rank() == 0:
        print(f"[training_throughput] {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def _round(args, comm, k: int) -> dict:
    """One process alone, one per rank without exchange, MultiWorkerMirroredStrategy, then
    horolite, back to back."""
    n, rank = comm.Get_size(), comm.Get_rank()
    # 1. One process alone: rank 0 runs it while the others sleep (they must not spin).
    # (--tiny only checks that everything runs: the baseline then overlaps step 3.)
    _say(comm, f"round {k + 1}: one process alone")
    single_proc = _start_child(args, "--worker", "single") if rank == 0 else None
    single = None
    if not args.tiny:
        single = _result(args, single_proc) if rank == 0 else None
        common.polite_barrier(comm)

    _say(comm, f"round {k + 1}: one plain process per rank, no exchange")
    alone_together = run_no_exchange(args, comm)
    common.polite_barrier(comm)

    # 3 before 2: MultiWorkerMirroredStrategy in child processes, started by every rank at once
    # (while horolite's thread is not running in this process).
    _say(comm, f"round {k + 1}: MultiWorkerMirroredStrategy")
    ports = comm.bcast(",".join(str(common.free_port()) for _ in range(n)) if rank == 0 else None)
    mine = _child(args, "--worker", "mwms", "--index", str(rank), "--ports", ports)
    if args.tiny:
        single = _result(args, single_proc) if rank == 0 else None
    single = comm.bcast(single)
    workers = comm.allgather(mine)
    mwms_seconds = max(w["seconds"] for w in workers)
    mwms = {"seconds": mwms_seconds, "images_per_sec": n * args.batch * args.steps / mwms_seconds,
            "replicas": workers[0]["replicas"]}
    common.polite_barrier(comm)

    _say(comm, f"round {k + 1}: horolite")
    # 2. horolite in this process, on every rank.
    horo = run_horolite(args, comm)
    common.polite_barrier(comm)
    return {"single": single, "no_exchange": alone_together, "mwms": mwms, "horolite": horo}


def orchestrate(args) -> None:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    common.wait_until_quiet(comm, args.quiet_below, args.quiet_timeout)

    rounds = []
    for k in range(1 if args.tiny else args.rounds):
        rounds.append(_round(args, comm, k))
    _say(comm, f"{args.blocks} interleaved blocks")
    blocks = run_interleaved(args, comm)
    # The efficiency: n ranks against n x one rank of the same horolite step.
    block_eff = [h / (n * o) for h, o in zip(blocks["horolite"], blocks["one_rank"])]
    # Stricter: against plain TensorFlow, which also charges horolite's cost at one rank.
    block_eff_plain = [h / (n * s) for h, s in zip(blocks["horolite"], blocks["single"])]
    block_own = [o / s for o, s in zip(blocks["one_rank"], blocks["single"])]
    block_machine = [p / (n * s) for p, s in zip(blocks["no_exchange"], blocks["single"])]
    block_kept = [h / p for h, p in zip(blocks["horolite"], blocks["no_exchange"])]
    # Each ratio pairs numbers measured within one round (seconds apart); the table shows
    # the median round, by horolite's ratio to MWMS.
    ratios = [r["horolite"]["images_per_sec"] / r["mwms"]["images_per_sec"] for r in rounds]
    effs = [r["horolite"]["images_per_sec"] / (n * r["single"]["images_per_sec"]) for r in rounds]
    round_ratio, round_efficiency = _median(ratios), _median(effs)
    # The ratio target reads the blocks too: horolite and MWMS seconds apart.
    block_ratios = [h / m for h, m in zip(blocks["horolite"], blocks["mwms"])]
    block_mwms = [m / s for m, s in zip(blocks["mwms"], blocks["single"])]
    ratio = _median(block_ratios)
    efficiency, efficiency_plain = _median(block_eff), _median(block_eff_plain)
    # The efficiency's two factors, round by round: what the machine allows n processes
    # that exchange nothing, and what horolite keeps of that.
    machine = [r["no_exchange"]["images_per_sec"] / (n * r["single"]["images_per_sec"])
               for r in rounds]
    kept = [r["horolite"]["images_per_sec"] / r["no_exchange"]["images_per_sec"] for r in rounds]
    middle = sorted(rounds, key=lambda r: r["horolite"]["images_per_sec"] /
                    r["mwms"]["images_per_sec"])[len(rounds) // 2]
    single, horo, mwms = middle["single"], middle["horolite"], middle["mwms"]

    columns = ["system", "ranks", "images/sec", "vs one process"]
    table = [
        ["one process, plain TensorFlow", "1", f"{single['images_per_sec']:.1f}", "1.00"],
        ["horolite DistributedGradientTape", str(n), f"{horo['images_per_sec']:.1f}",
         f"{horo['images_per_sec'] / single['images_per_sec']:.2f}"],
        ["MultiWorkerMirroredStrategy", str(n), f"{mwms['images_per_sec']:.1f}",
         f"{mwms['images_per_sec'] / single['images_per_sec']:.2f}"],
        [f"{n} plain processes at once, no exchange", str(n),
         f"{middle['no_exchange']['images_per_sec']:.1f}",
         f"{middle['no_exchange']['images_per_sec'] / single['images_per_sec']:.2f}"],
        [f"interleaved blocks ({args.blocks} x {args.block_steps} steps, medians): one process",
         "1", f"{_median(blocks['single']):.1f}", "1.00"],
        ["interleaved blocks: horolite DistributedGradientTape, a job of 1 rank", "1",
         f"{_median(blocks['one_rank']):.1f}", f"{_median(block_own):.2f}"],
        ["interleaved blocks: ranks plain at once, no exchange", str(n),
         f"{_median(blocks['no_exchange']):.1f}", f"{n * _median(block_machine):.2f}"],
        ["interleaved blocks: horolite DistributedGradientTape", str(n),
         f"{_median(blocks['horolite']):.1f}", f"{n * efficiency_plain:.2f}"],
        ["interleaved blocks: MultiWorkerMirroredStrategy", str(n),
         f"{_median(blocks['mwms']):.1f}", f"{_median(block_mwms):.2f}"],
    ]
    why = (f"by block: the machine ({n} ranks training plain at once against {n} x one "
           f"process) {_median(block_machine):.2f} (" + _list(block_machine) + "), horolite "
           f"kept {_median(block_kept):.2f} of that (" + _list(block_kept) + "): each step "
           "waits for the slower rank, then the exchange; one rank of horolite ran at "
           f"{_median(block_own):.2f} of one plain process (" + _list(block_own) + ")")
    targets = [
        Target("images/sec, horolite / MultiWorkerMirroredStrategy (median of interleaved "
               "blocks)", ratio, 1.3, "x", True,
               "MultiWorkerMirroredStrategy's own scaling: with efficiency at most 1 the ratio "
               f"is at most {n}/(its speedup over one process), so {1.3:g}x needs it at or below "
               f"{n / 1.3:.2f}x one process (it ran at " + _list(block_mwms) + " by block, "
               + ", ".join(f"{r['mwms']['images_per_sec'] / r['single']['images_per_sec']:.2f}"
                           for r in rounds)
               + " by round); then the exchange's cost below. Ratio by block: "
               + _list(block_ratios) + f"; by round (processes of their own, tens of seconds "
               f"apart): median {round_ratio:.2f}, " + _list(ratios)),
        Target(f"scaling efficiency ({n} ranks vs {n} x 1 rank of the same horolite step, "
               "1 thread each; median of interleaved blocks)", efficiency, 0.9, "", True,
               why + "; efficiency by block: " + _list(block_eff)),
        Target(f"stricter, also reported: scaling efficiency against {n} x one plain "
               "TensorFlow process (charges horolite's own cost at 1 rank too)",
               efficiency_plain, 0.9, "", True,
               why + "; efficiency by block: " + _list(block_eff_plain)
               + f". By round (processes of their own, tens of seconds apart): "
               f"median {round_efficiency:.2f}, the machine " + _list(machine) + ", horolite "
               "kept " + _list(kept) + "; one process alone ran "
               + ", ".join(f"{r['single']['images_per_sec']:.0f}" for r in rounds) +
               " images/sec by round; other processes used "
               f"{100 * common.other_busy_so_far():.0f}% of the cores during the run"),
    ]

    def plot(ax):
        names = ["1 process", f"horolite x{n}", f"MWMS x{n}", f"{n} processes,\nno exchange"]
        vals = [single["images_per_sec"], horo["images_per_sec"], mwms["images_per_sec"],
                middle["no_exchange"]["images_per_sec"]]
        ax.bar(names, vals, color=["gray", "C0", "C1", "silver"])
        ax.axhline(n * single["images_per_sec"], color="k", ls="--", alpha=0.5,
                   label=f"perfect scaling ({n} x 1 process)")
        ax.set_ylabel("images/sec")
        ax.legend(fontsize=8)

    common.finish(comm, args, "training_throughput",
                  {"model": "Conv32-Pool-Conv64-Pool-Dense128-Dense10", "parameters": single["parameters"],
                   "batch_per_rank": args.batch, "image": args.image, "steps": args.steps,
                   "warmup": args.warmup, "threads_per_process": 1, "single": single,
                   "horolite": horo, "mwms": mwms, "ratio_vs_mwms": ratio,
                   "ratios_vs_mwms_by_block": block_ratios,
                   "ratio_vs_mwms_by_round_median": round_ratio,
                   "mwms_vs_single_by_block": block_mwms,
                   "scaling_efficiency": efficiency,
                   "scaling_efficiency_vs_plain": efficiency_plain, "rounds": rounds,
                   "ratios_vs_mwms_by_round": ratios, "efficiencies_by_round": effs,
                   "no_exchange_vs_single_by_round": machine,
                   "horolite_vs_no_exchange_by_round": kept,
                   "scaling_efficiency_by_round_median": round_efficiency,
                   "blocks": blocks, "block_steps": args.block_steps,
                   "efficiencies_by_block": block_eff,
                   "efficiencies_vs_plain_by_block": block_eff_plain,
                   "one_rank_vs_single_by_block": block_own,
                   "no_exchange_vs_single_by_block": block_machine,
                   "horolite_vs_no_exchange_by_block": block_kept},
                  columns, table, targets, plot)


def _median(values):
    return sorted(values)[len(values) // 2]


def _list(values) -> str:
    return ", ".join(f"{x:.2f}" for x in values)


def main(argv=None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64, help="images per rank per step")
    p.add_argument("--image", type=int, default=32, help="image side in pixels")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5,
                   help="repeat the four measurements; ratios are medians of per-round ratios")
    p.add_argument("--blocks", type=int, default=12,
                   help="interleaved blocks after the rounds (the efficiency target's reading)")
    p.add_argument("--block-steps", type=int, default=20, help="timed steps per block and system")
    p.add_argument("--block-warmup", type=int, default=3)
    p.add_argument("--child-timeout", type=float, default=900)
    p.add_argument("--worker", choices=["single", "mwms"], help=argparse_hidden())
    p.add_argument("--index", type=int, default=0, help=argparse_hidden())
    p.add_argument("--ports", default="", help=argparse_hidden())
    p.add_argument("--wait-for-go", action="store_true", help=argparse_hidden())
    p.add_argument("--serve-blocks", action="store_true", help=argparse_hidden())
    args = p.parse_args(argv)
    if args.tiny:
        args.batch, args.image, args.steps, args.warmup = 8, 16, 3, 1
        args.blocks, args.block_steps, args.block_warmup = 2, 2, 1
    if args.worker == "single":
        print("RESULT " + json.dumps(run_single(args)), flush=True)
    elif args.worker == "mwms":
        print("RESULT " + json.dumps(run_mwms_worker(args)), flush=True)
    else:
        orchestrate(args)


def argparse_hidden():
    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
