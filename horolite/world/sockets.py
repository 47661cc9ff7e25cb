"""MPI's names for a job without MPI: what mpi4py's MPI module offers, as far as horolite
uses it, so the runtime, its transports and its failure handling run unchanged on either.

A world itself (its COMM_WORLD, the rendezvous served, the connections kept between
generations) is a socket_world.SocketWorld: the object core/mpi_library.MPI stands for
once init() chose, answering these names from here. Ranks find each other through the
rendezvous (rendezvous.py: served by horolite-run, or by rank 0 where a scheduler started
the ranks); each puts where it listens and reads the others', and every pair connects
with the hello of transport/tcp_hello.py under the job's key.
"""
from __future__ import annotations

import hashlib
import hmac

from .sockets_comm import (BAND, BOR, BYTE, COMM_NULL, COMM_TYPE_SHARED, IN_PLACE, LAND, LOR,
                           MAX, MIN, SUM, UNDEFINED, Comm, Group, Op, SocketWorldError, Win,
                           processor_name)
from .requests import ANY_SOURCE, REQUEST_NULL, Request, Status

# What a SocketWorld answers besides its COMM_WORLD (MPI's names, as horolite uses them).
__all__ = ["Comm", "Group", "Op", "Win", "Request", "Status", "Exception", "ANY_SOURCE",
           "REQUEST_NULL", "COMM_NULL", "UNDEFINED", "IN_PLACE", "BYTE", "LAND", "LOR", "BOR",
           "BAND", "SUM", "MAX", "MIN", "COMM_TYPE_SHARED", "THREAD_MULTIPLE", "ERR_NO_MEM",
           "Query_thread", "Get_processor_name", "Get_library_version"]

Exception = SocketWorldError  # noqa: A001 (MPI.Exception's name)
THREAD_MULTIPLE = 3
ERR_NO_MEM = 34  # (an error class a caller may raise Exception with)


def Query_thread() -> int:
    return THREAD_MULTIPLE


def Get_processor_name() -> str:
    return processor_name()


def Get_library_version() -> str:
    return "horolite's own connections (no MPI)"


def generation_key(key: bytes, generation: int) -> bytes:
    """The key the connections of one generation of the world say their hello with: a
    rank of an older generation (a stale peer that comes back) cannot complete it."""
    if generation == 0:
        return key
    return hmac.new(key, b"horolite world generation %d" % generation, hashlib.sha256).digest()


def world_scope(generation: int) -> str:
    """The rendezvous scope where one generation's ranks put where they listen."""
    return "world" if generation == 0 else f"world.{generation}"


class Superseded(RuntimeError):
    """A newer generation of the world was announced while this one was meeting."""
