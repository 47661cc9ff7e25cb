"""The control exchange over horolite's TCP connections at n participants: log2(n) steps
(recursive doubling, binomial trees) against a ring of n - 1 hops, in one job.

Run it with one rank per pretend host, so that every rank takes part as a host's
leader would:

    HOROLITE_TEST_HOST_IDENTITY=1+1+1+1+1+1+1+1 horolite-run -np 8 python bench/control_plane.py
    (the same with --runtime-shape ring: the runtime's own 4 KiB allreduce over the ring)

It times an OR round (every idle cycle) and a negotiating round (OR, gather at the first
participant, broadcast from it) for both shapes on a mesh of its own, interleaved, and
the runtime's 4 KiB allreduce, whose cycle runs over the shape --runtime-shape names.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

import common
from common import Target, interleaved_median_times

KiB = 1 << 10


def main(argv=None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=400, help="timed rounds of each variant")
    p.add_argument("--runtime-shape", choices=["tree", "ring"], default="tree")
    args = p.parse_args(argv)
    if args.tiny:
        args.rounds = 16
    comm = MPI.COMM_WORLD
    common.wait_until_quiet(comm, args.quiet_below, args.quiet_timeout)
    from horolite.transport import tcp, tcp_control
    from horolite.transport.tcp_link import TcpLink

    rank, size = comm.Get_rank(), comm.Get_size()
    mine = comm.Dup()
    wanted = tcp_control.partners(rank, size, "tree") | tcp_control.partners(rank, size, "ring")
    mesh = tcp.open_mesh(mine, sorted(wanted), [str(q) for q in range(size)],
                         lambda q: f"rank {q}")

    class Quiet:
        def watch(self, waited, peer):
            pass
    shapes = {shape: tcp_control.TcpControl(TcpLink(mesh, 20 + i, range(size), Quiet()), shape)
              for i, shape in enumerate(("tree", "ring"))}
    vector = np.full(8, 1 << rank % 60, np.uint64)
    request = b"r" * 64

    def or_round(control):
        control.or_in_place(vector.copy())

    def negotiating_round(control):
        control.or_in_place(vector.copy())
        control.gather_bytes(request)
        control.bcast_bytes(request * size if rank == 0 else b"")

    fns = {}
    for shape, control in shapes.items():
        fns[f"or_{shape}_s"] = lambda c=control: or_round(c)
        fns[f"negotiate_{shape}_s"] = lambda c=control: negotiating_round(c)
    res = interleaved_median_times(fns, args.rounds, blocks=8, comm=mine)
    mine.Barrier()
    mesh.close()

    tcp_control.SHAPE = args.runtime_shape
    import horolite as hvd
    hvd.init()
    small = np.ones(KiB, dtype=np.float32)
    res[f"allreduce_4KiB_{args.runtime_shape}_s"] = common.median_time(
        lambda: hvd.allreduce(small, name="lat"), args.rounds, warmup=5, comm=comm)
    hvd.shutdown()

    us = 1e6
    columns = ["participants", "OR tree (us)", "OR ring (us)", "negotiating tree (us)",
               "negotiating ring (us)", f"4 KiB allreduce, runtime over {args.runtime_shape} (us)"]
    table = [[size, f"{res['or_tree_s'] * us:.0f}", f"{res['or_ring_s'] * us:.0f}",
              f"{res['negotiate_tree_s'] * us:.0f}", f"{res['negotiate_ring_s'] * us:.0f}",
              f"{res[f'allreduce_4KiB_{args.runtime_shape}_s'] * us:.0f}"]]
    targets = [Target("negotiating round, tree / ring", res["negotiate_tree_s"] /
                      res["negotiate_ring_s"], 1.0, "x", False,
                      limited_by="hops of a GIL-bound Python relay per step; on one machine "
                                 "with fewer cores than ranks, the scheduler")]
    common.finish(comm, args, "control_plane", {"rounds": args.rounds, "results": res},
                  columns, table, targets, None)


if __name__ == "__main__":
    main()
