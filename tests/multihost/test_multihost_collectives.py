"""The collective matrix across simulated hosts (2x1, 2x2, 3x2 and 1/2/1), over ssh.

The full matrix of variants runs on one host (tests/test_matrix_core.py); here
each layout runs the same rank-side file once, so the ring crosses real
network links and ranks on other hosts start through sshd.
"""
import os

import pytest

from jobs import ROOT, run_pytest_across

LAYOUTS = {"2x1": "hl-a:1,hl-b:1", "2x2": "hl-a:2,hl-b:2", "3x1": "hl-a:1,hl-b:1,hl-c:1",
           "3x2": "hl-a:2,hl-b:2,hl-c:2", "1-2-1": "hl-a:1,hl-b:2,hl-c:1"}
COLLECTIVES = os.path.join(ROOT, "tests", "parallel", "test_collectives.py")
TOPOLOGY = os.path.join(ROOT, "tests", "multihost", "ranks", "topology.py")
ADASUM = os.path.join(ROOT, "tests", "parallel", "test_adasum.py")
# (small collectives across hosts: the control exchange through one rank per host)
SMALL = os.path.join(ROOT, "tests", "parallel", "test_small_collectives.py")


# 2x2 with the hierarchical path (transport/hierarchical.py) on (the default) and with the
# hierarchical allgather too; the flat ring across hosts runs at 2x1 and 1/2/1 (three hosts),
# where the layout does not allow the hierarchical path (default or asked for).
CASES = [("2x1", {}), ("2x2", {}),
         ("2x2", {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROLITE_HIERARCHICAL_ALLGATHER": "1"}),
         ("3x2", {}), ("1-2-1", {}), ("1-2-1", {"HOROLITE_HIERARCHICAL_ALLREDUCE": "1"})]

@pytest.mark.parametrize("layout, env", CASES, ids=lambda c: c if isinstance(c, str) else
                         ",".join(f"{k}={v}" for k, v in c.items()) or "auto")
def test_collectives_and_topology_across_hosts(bed, layout, env):
    args = [TOPOLOGY]
    if layout in ("2x2", "3x2", "1-2-1") and not env:
        args.append(SMALL)
        env = dict(env, HOROLITE_TEST_EXPECT_BOARD="0")  # (ranks on several hosts: no board)
    if layout in ("2x1", "2x2") and not env:
        # Adasum's pairs within a host and across hosts (its file makes a process set)
        args.append(ADASUM)
        env = dict(env, HOROLITE_DYNAMIC_PROCESS_SETS="1")
    run_pytest_across(bed, LAYOUTS[layout], COLLECTIVES, pytest_args=args,
                      env=dict(env, HOROLITE_TEST_LAYOUT=LAYOUTS[layout]))


RING_PIECES = os.path.join(ROOT, "tests", "parallel", "test_ring_pieces.py")


@pytest.mark.parametrize("layout", ["2x2", "1-2-1"])
def test_pipelined_ring_and_hierarchical_across_hosts(bed, layout):
    """The ring (on 1/2/1: three hosts) and the hierarchical pipeline (on 2x2) with tiny
    pieces and chunks. (3x2, the hierarchical path over an odd number of hosts, runs the
    collectives above; its pieces at 6 ranks on CI's 2 cores took two minutes.)"""
    run_pytest_across(bed, LAYOUTS[layout], RING_PIECES)


STRAGGLERS = os.path.join(ROOT, "tests", "parallel", "test_stragglers.py")


def test_stragglers_across_hosts(bed):
    """The straggler record through the control path that crosses hosts: a slow rank on
    the second host named with its delay, a balanced job naming nobody, a process set of
    ranks on both hosts (tests/parallel/test_stragglers.py, a 2 s window)."""
    run_pytest_across(bed, LAYOUTS["2x2"], STRAGGLERS,
                      env={"HOROLITE_STRAGGLER_REPORT_SECONDS": "2"})


TCP_LINK = os.path.join(ROOT, "tests", "parallel", "test_tcp_link.py")


def test_horolites_own_connections_across_hosts(bed):
    """horolite's TCP connections between real hosts (HOROLITE_CROSS_HOST_TRANSPORT=tcp), on
    the interface named (HOROLITE_TCP_IFACE, as horolite-run --network-interface sets it):
    the transport's own tests (real interfaces, a missing one, refused addresses) on 2x2.
    (The collective matrix runs over these connections by default above, on every layout.)"""
    run_pytest_across(bed, LAYOUTS["2x2"], TCP_LINK,
                      env={"HOROLITE_CROSS_HOST_TRANSPORT": "tcp", "HOROLITE_TCP_IFACE": "eth0",
                           "HOROLITE_TEST_LAYOUT": LAYOUTS["2x2"]})
