"""Where rank 0 of a scheduler-started job serves the rendezvous: ports every rank
derives from its own environment, without talking to the others.

A derived port can be taken: torchrun's agent serves its own store on MASTER_PORT for
the whole job; another job, or another user, may hold the one port a Slurm step's id
hashes to. So a scheduler's source yields a few candidates: rank 0 serves on the first
that it can bind, and the other ranks try them in turn, moving on from any server that
fails the key's proof (another job's, or a stranger's: the proof is a MAC, so probing
one reveals nothing). HOROLITE_RENDEZVOUS_PORT, where set, is the only candidate.
"""
from __future__ import annotations

import hashlib
from typing import Mapping, Tuple

__all__ = ["CANDIDATES", "SLURM_BASE", "SLURM_SPAN", "under_torchrun", "slurm_ports",
           "after"]

CANDIDATES = 4  # how many ports a derived rendezvous may be on
SLURM_BASE, SLURM_SPAN = 20000, 10000


def under_torchrun(environ: Mapping[str, str]) -> bool:
    """Whether torchrun's agent started this process (it sets TORCHELASTIC_* for its
    workers, and serves its own store on MASTER_PORT)."""
    return any(k.startswith("TORCHELASTIC_") and str(v).strip() for k, v in environ.items())


def slurm_ports(job: str, step: str) -> Tuple[int, ...]:
    """CANDIDATES distinct ports in SLURM_BASE..SLURM_BASE+SLURM_SPAN-1 for one step of
    one job, spread by a hash: two steps sharing a node rarely share the first, and a
    squatter on one leaves the others."""
    digest = hashlib.sha256(f"{job}.{step}".encode()).digest()
    ports = []
    for i in range(0, len(digest), 4):
        port = SLURM_BASE + int.from_bytes(digest[i:i + 4], "big") % SLURM_SPAN
        if port not in ports:
            ports.append(port)
        if len(ports) == CANDIDATES:
            break
    return tuple(ports)


def after(port: int) -> Tuple[int, ...]:
    """The CANDIDATES ports right after `port` (that port itself is another server's)."""
    return tuple(p for p in range(port + 1, port + 1 + CANDIDATES) if p < 65536)
