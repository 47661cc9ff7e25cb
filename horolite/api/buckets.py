"""A step's gradients in buckets that leave while backprop still runs.

Backprop makes the last layers' gradients first. Sent as one request after the
last gradient, a step costs its compute plus its exchange; sent in buckets in
the order backprop makes them, each bucket's exchange runs while the earlier
layers' gradients are still being computed, and the step costs about the
larger of the two (PyTorch DDP's reducer does the same from autograd hooks).

Across hosts the exchange waits on the network while the cores compute, so
buckets pay. On one host the exchange is shared memory on the same cores as
the compute: splitting a step only adds cycles, and one request per step is
faster (measured, docs/tensorflow.md). `plan_for` picks from that topology
unless HOROLITE_GRADIENT_BUCKET_MB says otherwise.

Buckets are cut from the gradients' sizes, in reverse order of the parameters
(backprop's order): a small first bucket so the exchange starts early, then
buckets of up to the cap. The same sizes give the same plan on every rank.

`GradientBuckets` is the NumPy/CuPy side: mark each array ready as it is made,
and its bucket is submitted as soon as its last member is ready.

A step that fails on one rank after some of its buckets left (an op of backprop
raised there) would leave the other ranks waiting for the rest. `BucketRuns`
notices it when that rank's next step sends its first bucket, and tells every
rank that the missing buckets of the failed step will never come: their requests
fail with an error naming the rank, and the next step works.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Sequence

from ..core.handle import Handle
from ..core.ops import ReduceOp
from .collectives import abandon_async, grouped_allreduce_async
from .process_sets import global_process_set, runtime_for

__all__ = ["plan", "plan_for", "bucket_cap_bytes", "cap_from_setting", "GradientBuckets", "BucketRuns",
           "after", "settle", "FIRST_BUCKET_BYTES", "ACROSS_HOSTS_CAP_BYTES"]

MiB = 1 << 20
# The first bucket (the last layers') is small so the exchange starts early.
FIRST_BUCKET_BYTES = 1 * MiB
# Across hosts: the last bucket (the first layers') is exchanged after backprop ends, so
# smaller buckets shorten that tail; each costs one background cycle (measured on the
# simulated hosts at 1 Gbit/s, docs/tensorflow.md).
ACROSS_HOSTS_CAP_BYTES = 2 * MiB


def plan(sizes: Sequence[int], cap: int, first: int = FIRST_BUCKET_BYTES) -> List[List[int]]:
    """Indices of `sizes` (in the parameters' order) grouped into buckets, in the order
    backprop makes them: from the last index back, the first bucket up to `first` bytes,
    then up to `cap` (a tensor larger than the cap is a bucket of its own). Within a
    bucket the indices are ascending. cap <= 0: everything in one bucket."""
    n = len(sizes)
    if cap <= 0 or n <= 1:
        return [list(range(n))] if n else []
    buckets, current, filled, limit = [], [], 0, min(first, cap)
    for i in range(n - 1, -1, -1):
        if current and filled + sizes[i] > limit:
            buckets.append(sorted(current))
            current, filled, limit = [], 0, cap
        current.append(i)
        filled += sizes[i]
    buckets.append(sorted(current))
    return buckets


def bucket_cap_bytes(process_set=global_process_set) -> int:
    """The bucket cap in bytes for a step reduced over `process_set`: 0 means one request
    per step (HOROLITE_GRADIENT_BUCKET_MB, `auto` by default: buckets when the set's
    ranks span hosts)."""
    rt = runtime_for(process_set, "gradient buckets")
    return cap_from_setting(rt.config.gradient_bucket_mb, rt.topology.hosts)


def cap_from_setting(value, hosts: int) -> int:
    """HOROLITE_GRADIENT_BUCKET_MB's value as a cap in bytes, for ranks on `hosts` hosts."""
    raw = str(value or "auto").strip().lower()
    if raw == "auto":
        return ACROSS_HOSTS_CAP_BYTES if hosts > 1 else 0
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"HOROLITE_GRADIENT_BUCKET_MB={raw!r}: expected `auto`, `0` "
                         "(one request per step) or a size in MiB") from None
    if mb < 0:
        raise ValueError(f"HOROLITE_GRADIENT_BUCKET_MB={raw!r} must be >= 0")
    return int(mb * MiB)


def plan_for(sizes: Sequence[int], process_set=global_process_set) -> List[List[int]]:
    """plan() with the cap this job uses (bucket_cap_bytes)."""
    return plan(sizes, bucket_cap_bytes(process_set))


class BucketRuns:
    """The requests of one step, run after run. A run that stopped part way (the step
    failed on this rank) is found when a request it already sent comes again (the next
    run began): its missing requests are abandoned on every rank (abandon_async; a notice
    covers the group in whichever form the others send it: coordination/abandon.py).
    Two of one name cannot be in flight on a rank, and the others may not have sent
    theirs yet: a request or notice under a name still in flight (sent, or abandoned, by
    an earlier run) goes once that one is done. A run counts a request as its own only
    once it went, so a send that raised is tried again by the next run.

    Both what is in flight and which unfinished run sent a request are kept per process
    set across every BucketRuns: each trace of a tf.function (another input shape, a
    retrace) makes its own, and a step that failed in one trace must be noticed by the
    next step whichever trace that runs (else its buckets pair with the other ranks'
    failed step and the weights silently differ, or every rank waits for ever). What is
    in flight goes by name; which run sent a request goes by its key, which names the
    request the same in every trace (traces may number their names differently: see
    tensorflow/bridge.across_traces); the key is the name where none is given.

    A request may go only `after` another of its run came back whole (a sparse
    gradient's rows after the bucket that checks every rank has rows there): where that
    one never went or failed, no rank sends it, and a run that ended before it owes no
    notice for it."""

    # (process set, name) -> the latest request or notice of that name, until it is done
    _latest: Dict[tuple, Handle] = {}
    _latest_lock = threading.Lock()
    # (process set, key) -> the BucketRuns whose run sent it and has not ended
    _open: Dict[tuple, "BucketRuns"] = {}
    _runs = threading.RLock()  # one submit or stop at a time, over every BucketRuns

    def __init__(self, names: Sequence[str], process_set=global_process_set,
                 keys: Optional[Sequence[str]] = None):
        self.names = list(names)
        self.keys = list(names if keys is None else keys)
        if len(self.keys) != len(self.names):
            raise ValueError(f"BucketRuns: {len(self.keys)} keys for {len(self.names)} names")
        self.process_set = process_set
        self._sent: set = set()  # requests the current run sent
        self._dropped: set = set()  # and those abandoned as it ended (until it has ended)
        self._handles: Dict[int, Handle] = {}  # the current run's sent requests
        self._gates: Dict[int, int] = {}  # request -> the request it goes after
        self._lock = BucketRuns._latest_lock
        self._last = BucketRuns._latest

    def add(self, name: str, key: Optional[str] = None, after: Optional[int] = None) -> int:
        """One more request of the step (its index): `name`, found across traces as `key`,
        sent only once request `after` of the same run came back whole."""
        self.names.append(name)
        self.keys.append(name if key is None else key)
        if after is not None:
            self._gates[len(self.names) - 1] = after
        return len(self.names) - 1

    def _key(self, k: int) -> tuple:
        return (id(self.process_set), self.keys[k])

    def submit(self, k: int, submit: Callable, *args) -> Handle:
        """submit(*args) for request k (its handle, or one that completes as it does)."""
        with self._runs:
            owner = self._open.get(self._key(k))
            if owner is not None:  # the next run began (here or in another trace): what
                # the last one did not send never comes
                owner._end_run(f"its previous run of this step failed there after "
                               f"{len(owner._sent)} of {len(owner.names)} buckets had left, "
                               "and its next run began")
            gate = self._gates.get(k)
            if gate is not None:
                first, go = self._handles.get(gate), submit
                if first is None:
                    raise RuntimeError(f"{self.names[k]}: sent before {self.names[gate]}, "
                                       "which it must follow")
                submit = lambda *a: after(first, go, *a)  # noqa: E731
            handle = self._send(self.names[k], submit, *args)
            self._sent.add(k)
            self._handles[k] = handle
            self._open[self._key(k)] = self
            if len(self._sent) == len(self.names):
                self._close()
            return handle

    def stop(self, why: str) -> List[Handle]:
        """The current run ends here, unfinished: abandon what it did not send (returns
        those requests' handles)."""
        with self._runs:
            return self._end_run(why) if self._sent or self._dropped else []

    def _end_run(self, why: str) -> List[Handle]:
        """Abandon what the current run did not send, then start the next run. (A notice
        that raised leaves the run unended, less what was abandoned: ended again later.)"""
        handles = []
        for k, name in enumerate(self.names):
            if k not in self._sent and k not in self._dropped and not self._owes(k):
                self._dropped.add(k)  # its gate never came back whole: no rank sends it
            elif k not in self._sent and k not in self._dropped:
                handles.append(self._send(name, abandon_async, name, why, self.process_set))
                self._dropped.add(k)
        self._close()
        return handles

    def _owes(self, k: int) -> bool:
        """Whether the other ranks send request k in this run: it goes after nothing, or
        after a request that went and has not failed."""
        gate = self._gates.get(k)
        if gate is None:
            return True
        first = self._handles.get(gate)
        return first is not None and not (first.done() and first.exception() is not None)

    def _close(self) -> None:
        """The current run has ended: its names belong to no open run of this one."""
        for k in self._sent:
            key = self._key(k)
            if self._open.get(key) is self:
                del self._open[key]
        self._sent, self._dropped, self._handles = set(), set(), {}

    def _send(self, name: str, submit: Callable, *args) -> Handle:
        """submit(*args) now, or, while the latest of `name` is in flight, once it is done
        (returns a handle that completes as that one does)."""
        with self._lock:
            pending = self._last.get((id(self.process_set), name))
        if pending is None or pending.done():
            return self._track(name, submit(*args))
        proxy = self._track(name, Handle(name))
        pending.add_done_callback(lambda _: _submit_into(proxy, submit, args))
        return proxy

    def _track(self, name: str, handle: Handle) -> Handle:
        """Remember `handle` as the latest of `name` until it is done (not longer: its
        result's buffer goes back to the pool once nothing holds it)."""
        key = (id(self.process_set), name)
        with self._lock:
            self._last[key] = handle

        def forget(done: Handle) -> None:
            with self._lock:
                if self._last.get(key) is done:
                    del self._last[key]
        handle.add_done_callback(forget)
        return handle


def after(first: Handle, submit: Callable, *args) -> Handle:
    """submit(*args) once `first` came back whole (a handle that completes as that one
    does); where `first` failed, nothing is sent and the handle fails with its error."""
    if first.done() and first.exception() is None:
        return submit(*args)
    proxy = Handle(first.name)

    def go(done: Handle) -> None:
        error = done.exception()
        if error is not None:
            proxy._set_exception(error)
        else:
            _submit_into(proxy, submit, args)
    first.add_done_callback(go)
    return proxy


def _submit_into(proxy: Handle, submit: Callable, args) -> None:
    """submit(*args), its outcome (or the error of submitting) reaching `proxy`."""
    try:
        handle = submit(*args)
    except BaseException as e:  # noqa: BLE001 - the caller's handle carries it
        proxy._set_exception(e)
        return
    handle.add_done_callback(lambda h: settle(proxy, h))


def settle(proxy: Handle, handle: Handle) -> None:
    """Complete `proxy` as `handle` completed."""
    error = handle.exception()
    if error is not None:
        proxy._set_exception(error)
        return
    proxy.first_dims = handle.first_dims
    proxy._set_result(handle.result())


class GradientBuckets:
    """Arrays made one at a time (a backward pass) reduced in buckets as they fill.

    >>> buckets = GradientBuckets([g.nbytes for g in shapes_like], "step")
    >>> for i in reversed(range(n)): buckets.ready(i, compute_gradient(i))
    >>> averaged = buckets.results()

    Every rank must declare the same sizes. A bucket is submitted (one grouped
    allreduce, named `<name>.bucket<k>`, so later steps hit the response cache)
    when its last member is marked ready; `results()` waits for all and starts the
    next step. NumPy and CuPy arrays (GPU memory travels over NCCL) both work.
    """

    def __init__(self, sizes: Sequence[int], name: str, op=ReduceOp.AVERAGE,
                 prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                 process_set=global_process_set, cap_bytes: Optional[int] = None):
        if not name:
            raise ValueError("GradientBuckets needs a name (the same on every rank)")
        self.name = name
        self._args = (op, float(prescale_factor), float(postscale_factor), process_set)
        cap = bucket_cap_bytes(process_set) if cap_bytes is None else int(cap_bytes)
        self.buckets = plan([int(s) for s in sizes], cap)
        self._bucket_of = {i: k for k, members in enumerate(self.buckets) for i in members}
        self._lock = threading.Lock()
        self._runs = BucketRuns([self._bucket_name(k) for k in range(len(self.buckets))],
                                process_set)
        self._start()

    def _bucket_name(self, k: int) -> str:
        return f"{self.name}.bucket{k}"

    def _start(self) -> None:
        self._arrays: List = [None] * len(self._bucket_of)
        self._missing = [len(b) for b in self.buckets]
        self._handles: List[Optional[Handle]] = [None] * len(self.buckets)

    def ready(self, index: int, array) -> Optional[Handle]:
        """Array `index` of this step is made; returns its bucket's handle if this
        completed the bucket (it is then on its way), else None."""
        k = self._bucket_of.get(index)
        if k is None:
            raise IndexError(f"{self.name}: no array {index} (declared {len(self._arrays)})")
        with self._lock:
            if self._arrays[index] is not None:
                raise ValueError(f"{self.name}: array {index} was already marked ready this step")
            self._arrays[index] = array
            self._missing[k] -= 1
            if self._missing[k]:
                return None
        op, pre, post, ps = self._args
        handle = self._runs.submit(k, grouped_allreduce_async,
                                   [self._arrays[i] for i in self.buckets[k]], op,
                                   self._bucket_name(k), pre, post, None, ps)
        self._handles[k] = handle
        return handle

    def discard(self, why: str = "the step failed there") -> None:
        """This step failed on this rank: forget what was marked, tell every rank that the
        buckets not yet sent will never come (their waits fail naming this rank), and wait
        for those that left, so the next step can send them again."""
        with self._lock:
            sent = [h for h in self._handles if h is not None]
            self._start()
        for handle in sent + self._runs.stop(why):  # the buckets that left: done once the
            # other ranks send theirs; the notices: done once the coordinator answered
            try:
                handle.result()
            except Exception:  # noqa: BLE001 - this step is given up anyway
                pass

    def results(self) -> List:
        """Every array reduced, in index order; the next step starts afterwards."""
        missing = [i for i, a in enumerate(self._arrays) if a is None]
        if missing:
            raise ValueError(f"{self.name}: arrays {missing[:8]} were never marked ready")
        out: List = [None] * len(self._arrays)
        error = None
        try:
            for members, handle in zip(self.buckets, self._handles):
                try:  # every bucket done before the first error is raised: the next step
                    results = handle.result()  # may then send them all again
                except Exception as e:  # noqa: BLE001 - raised below
                    error = error or e
                    continue
                for i, r in zip(members, results):
                    out[i] = r
        finally:
            self._start()
        if error is not None:
            raise error
        return out
