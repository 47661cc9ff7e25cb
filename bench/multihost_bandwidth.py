"""Allreduce across simulated hosts on capped links: horolite against MPI_Allreduce.

Run as root on one machine: the script builds two simulated hosts itself (the
test bed of tests/multihost/bed.py: namespaces, a real sshd each), caps each
host's link at --rate with tc tbf, and launches itself on them with
``horolite-run -H``:

- 2 hosts x 1 rank: horolite.allreduce and MPI_Allreduce (mpi4py) on the same
  float32 buffer, in alternating blocks, medians of the slowest rank's time;
- 2 hosts x 2 ranks: the same with the hierarchical allreduce (the default there,
  set explicitly), plus horolite's flat ring (the hierarchical path switched off
  between blocks).

It prints, per size, each time, the ratios, and the fraction of the link rate:
the bytes that must cross each host's link (2(h-1)/h of the buffer for h hosts)
over the time, against the rate.

    python bench/multihost_bandwidth.py            # as root; --rate 1gbit by default
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
LAYOUTS = {"2x1": "hl-a:1,hl-b:1", "2x2": "hl-a:2,hl-b:2"}


def _rate_bytes(rate: str) -> float:
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"--rate {rate!r}: expected e.g. 1gbit or 500mbit")


# ---- rank side (under horolite-run on the simulated hosts) ----

def worker(args) -> None:
    import numpy as np
    from mpi4py import MPI

    sys.path.insert(0, HERE)
    import horolite as hvd
    from common import interleaved_median_times
    from horolite.api.basics import runtime
    from horolite.transport.ring import Ring

    hvd.init()
    comm = MPI.COMM_WORLD
    transport = runtime().transport
    hier = transport.hierarchical_allreduce
    # Over horolite's TCP connections (--transport tcp), the flat ring over MPI's messages
    # too, swapped in between collectives: the old path, in the same job.
    tcp_ring = transport.ring if transport.cross_host is not None and hier is None else None
    mpi_ring = Ring(transport.link)

    def horolite_mpi_ring():
        transport.ring = mpi_ring
        try:
            hvd.allreduce(a, op=hvd.Sum, name="bw")
        finally:
            transport.ring = tcp_ring

    rows = []
    for nbytes in args.sizes:
        a = np.ones(nbytes // 4, dtype=np.float32)
        out = np.empty_like(a)

        def horolite_default():
            transport.hierarchical_allreduce = hier
            hvd.allreduce(a, op=hvd.Sum, name="bw")

        def horolite_flat():
            transport.hierarchical_allreduce = None  # between collectives: nothing in flight
            hvd.allreduce(a, op=hvd.Sum, name="bw")

        fns = {"horolite": horolite_default, "mpi": lambda: comm.Allreduce(a, out, op=MPI.SUM)}
        if hier is not None:
            fns["flat"] = horolite_flat
        if tcp_ring is not None:
            fns["mpi_ring"] = horolite_mpi_ring
        iters = int(min(args.max_iters, max(args.min_iters, args.budget_mib * MiB // nbytes)))
        times = interleaved_median_times(fns, iters, blocks=args.blocks, comm=comm)
        transport.hierarchical_allreduce = hier
        rows.append({"bytes": nbytes, "iters": iters, "hierarchical": hier is not None,
                     **{f"{k}_s": v for k, v in times.items()}})
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps({"ranks": comm.Get_size(), "rows": rows}), flush=True)
    hvd.shutdown()


# ---- driver (as root, on the machine) ----

def run_layout(bed, layout: str, sizes, args) -> dict:
    argv = [os.path.join(os.path.dirname(sys.executable), "horolite-run"), "-H", LAYOUTS[layout],
            sys.executable, os.path.abspath(__file__), "--worker",
            "--sizes", ",".join(map(str, sizes)), "--blocks", str(args.blocks),
            "--min-iters", str(args.min_iters), "--max-iters", str(args.max_iters),
            "--budget-mib", str(args.budget_mib)]
    # The hierarchical path where the layout allows it (the flat ring is measured beside it).
    env = {"HOROLITE_CROSS_HOST_TRANSPORT": args.transport}
    if layout != "2x1":
        env["HOROLITE_HIERARCHICAL_ALLREDUCE"] = "1"
    proc = bed.run(argv, timeout=3600, env=env)
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"{layout} run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                       f"\n{proc.stderr[-3000:]}")


def report(results: dict, rate: float, args) -> dict:
    sys.path.insert(0, HERE)
    from common import Target, human_bytes
    lines = ["| layout | size | horolite ms | MPI_Allreduce ms | flat ring ms | MPI time / horolite "
             "| flat / horolite | link fraction (horolite) | link fraction (MPI) |",
             "|---|---|---|---|---|---|---|---|---|"]
    targets = []
    ring_rows = []
    for layout, doc in results.items():
        hosts = 2
        for row in doc["rows"]:
            s, h, m = row["bytes"], row["horolite_s"], row["mpi_s"]
            crossing = s * 2 * (hosts - 1) / hosts
            row["link_fraction"] = crossing / h / rate
            row["mpi_link_fraction"] = crossing / m / rate
            flat = row.get("flat_s")
            if row.get("mpi_ring_s"):
                ring_rows.append(f"| {layout} | {human_bytes(s)} | {1e3 * h:.1f} | "
                                 f"{1e3 * row['mpi_ring_s']:.1f} | {1e3 * m:.1f} | "
                                 f"{row['mpi_ring_s'] / h:.2f} | {m / h:.2f} | "
                                 f"{row['link_fraction']:.2f} |")
            lines.append(f"| {layout} | {human_bytes(s)} | {1e3 * h:.1f} | {1e3 * m:.1f} | "
                         f"{'' if flat is None else f'{1e3 * flat:.1f}'} | {m / h:.2f} | "
                         f"{'' if flat is None else f'{flat / h:.2f}'} | "
                         f"{row['link_fraction']:.2f} | {row['mpi_link_fraction']:.2f} |")
            mib = s // MiB
            if layout == "2x1" and mib in (16, 64):
                targets.append(Target(f"2x1 {mib} MiB: busbw / MPI_Allreduce's", m / h, 1.1, "x",
                                      True, "see docs/benchmarks.md"))
                targets.append(Target(f"2x1 {mib} MiB: fraction of the link rate",
                                      row["link_fraction"], 0.9, "", True,
                                      "TCP/IP headers take ~4% of each 1500-byte frame"))
            if layout == "2x1" and mib == 1:
                targets.append(Target("2x1 1 MiB: time / MPI_Allreduce's", h / m, 1.0, "x",
                                      False, "see docs/benchmarks.md"))
            if layout == "2x2" and mib == 64:
                targets.append(Target("2x2 64 MiB: hierarchical / flat ring (speed)",
                                      (flat or float("nan")) / h, 1.4, "x", True,
                                      "see docs/benchmarks.md"))
                targets.append(Target("2x2 64 MiB: hierarchical / MPI_Allreduce (speed)", m / h,
                                      1.2, "x", True, "see docs/benchmarks.md"))
    if ring_rows:
        lines += ["", "| layout | size | horolite over TCP ms | horolite over MPI's messages ms | "
                  "MPI_Allreduce ms | MPI ring / TCP | MPI_Allreduce / TCP | link fraction |",
                  "|---|---|---|---|---|---|---|---|"] + ring_rows
    lines.append("")
    lines += ["| target | value | bound | met |", "|---|---|---|---|"]
    for t in targets:
        value = "n/a" if t.value is None else f"{t.value:.2f}"
        met = {True: "met", False: "**missed**", None: "not measured"}[t.met]
        lines.append(f"| {t.name} | {value} | {'>=' if t.higher_is_better else '<='} "
                     f"{t.bound:g} {t.unit} | {met} |")
    return {"markdown": "\n".join(lines) + "\n", "targets": [t.as_dict() for t in targets]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1 * MiB, 16 * MiB, 64 * MiB])
    p.add_argument("--layouts", default="2x1,2x2")
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of every link ('none': no cap)")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--min-iters", type=int, default=8)
    p.add_argument("--max-iters", type=int, default=60)
    p.add_argument("--budget-mib", type=int, default=512)
    p.add_argument("--transport", default="mpi", choices=("auto", "tcp", "mpi"),
                   help="HOROLITE_CROSS_HOST_TRANSPORT of the jobs (tcp: the flat ring over MPI "
                        "is measured beside it on 2x1)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "multihost_bandwidth.json"))
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    sys.path.insert(0, HERE)
    from common import simulated_hosts
    results = {}
    started = time.time()
    with simulated_hosts(2, args.rate, "multihost_bandwidth") as bed:
        for layout in args.layouts.split(","):
            sizes = args.sizes if layout == "2x1" else ([s for s in args.sizes if s >= 16 * MiB]
                                                        or args.sizes)
            results[layout] = run_layout(bed, layout, sizes, args)
    rate = _rate_bytes(args.rate) if args.rate != "none" else float("nan")
    rep = report(results, rate, args)
    doc = {"benchmark": "multihost_bandwidth", "rate": args.rate, "transport": args.transport,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "load_average": os.getloadavg(), "wall_seconds": round(time.time() - started, 1),
           "results": results, "targets": rep["targets"]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(rep["markdown"])
    print(f"links capped at {args.rate}; load average {os.getloadavg()[0]:.1f} "
          f"(the machine is shared)\n\n{rep['markdown']}\nwrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
