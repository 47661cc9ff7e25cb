"""Commits that outlive the process: one file per rank in host memory (/dev/shm).

A job that loses a rank is restarted whole (launcher/elastic.py), so what a rank
committed must survive its process. ``state.commit()`` writes the committed state
to ``<root>/horolite-elastic-<job>/<host>/rank<N>.commit.<0|1>`` (pickle protocol 5
with the arrays written straight from their buffers, no extra copy). Two slots are
used in turn and written in place (2-3x faster than a new file on tmpfs, whose
pages would be allocated and zeroed first): the header is invalidated first and
written last, so a rank killed mid-write leaves the other slot, its previous
commit, whole. Each commit carries its key (commit count, generation): after a
restart the lowest rank holding the largest key is the source of the state.
"""
from __future__ import annotations

import glob
import os
import pickle
import struct
from typing import Any, List, Optional, Tuple

__all__ = ["Key", "CommitStore", "encode", "decode"]

Key = Tuple[int, int]  # (commits made, generation that made the last one)
_MAGIC = b"HLEC1\n"
_HEAD = struct.Struct("<qqqq")  # count, generation, pickle length, number of buffers


def encode(key: Key, obj: Any) -> List[memoryview]:
    """The pieces of one commit file: header, pickle, then each array's raw buffer."""
    buffers: List[pickle.PickleBuffer] = []
    body = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    head = _MAGIC + _HEAD.pack(key[0], key[1], len(body), len(raws))
    head += struct.pack(f"<{len(raws)}q", *(r.nbytes for r in raws))
    return [memoryview(head), memoryview(body)] + raws


def read_key(path: str) -> Optional[Key]:
    try:
        with open(path, "rb") as f:
            head = f.read(len(_MAGIC) + _HEAD.size)
    except OSError:
        return None
    if len(head) < len(_MAGIC) + _HEAD.size or not head.startswith(_MAGIC):
        return None
    count, generation, _, _ = _HEAD.unpack(head[len(_MAGIC):])
    return count, generation


def decode(data) -> Tuple[Key, Any]:
    """(key, state) from a commit file's bytes (a bytes-like object)."""
    view = memoryview(data).cast("B")
    if bytes(view[:len(_MAGIC)]) != _MAGIC:
        raise ValueError("not a horolite elastic commit (bad magic)")
    at = len(_MAGIC)
    count, generation, body_len, nbuf = _HEAD.unpack(view[at:at + _HEAD.size])
    at += _HEAD.size
    lengths = struct.unpack(f"<{nbuf}q", view[at:at + 8 * nbuf])
    at += 8 * nbuf
    body = view[at:at + body_len]
    at += body_len
    buffers = []
    for n in lengths:
        buffers.append(view[at:at + n])
        at += n
    if at != len(view):
        raise ValueError(f"commit is {len(view)} bytes, its header says {at}")
    return (count, generation), pickle.loads(body, buffers=buffers)


class CommitStore:
    """This rank's two commit slots, and the newest commit any rank of this host left."""

    def __init__(self, directory: str, rank: int):
        self.directory = directory
        self.paths = [os.path.join(directory, f"rank{rank}.commit.{slot}") for slot in (0, 1)]

    def write(self, key: Key, obj: Any) -> int:
        """Write one commit into the slot not holding the newest one; returns its size."""
        os.makedirs(self.directory, exist_ok=True)
        keys = [read_key(p) or (0, 0) for p in self.paths]
        path = self.paths[0 if keys[0] <= keys[1] else 1]
        pieces = encode(key, obj)
        head, body = pieces[0], pieces[1:]
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, b"\0" * len(_MAGIC), 0)  # invalid until the header is written
            at = head.nbytes
            for piece in body:
                done = 0
                while done < piece.nbytes:
                    done += os.pwrite(fd, piece[done:], at + done)
                at += piece.nbytes
            os.ftruncate(fd, at)
            os.pwrite(fd, head, 0)
        finally:
            os.close(fd)
        return at

    def newest(self) -> Tuple[Key, Optional[str]]:
        """The largest key among this host's commit files, and its file ((0, 0), None if none)."""
        best: Tuple[Key, Optional[str]] = ((0, 0), None)
        for path in glob.glob(os.path.join(self.directory, "rank*.commit.*")):
            key = read_key(path)
            if key is not None and key > best[0]:
                best = (key, path)
        return best
