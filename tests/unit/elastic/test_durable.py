"""Commit files: what is written is read back whole, the newest key wins, a torn write is
never taken for a commit."""
import os

import numpy as np
import pytest

from horolite.elastic import protocol
from horolite.elastic.durable import CommitStore, decode, encode, read_key


def test_a_commit_round_trips_with_its_arrays(tmp_path):
    obj = {"objects": {"step": 7, "name": "x"}, "model": [np.arange(10.0), np.ones((3, 4), "f4")]}
    store = CommitStore(str(tmp_path / "h"), 3)
    size = store.write((4, 2), obj)
    key, path = store.newest()
    assert key == (4, 2) and size == os.path.getsize(path)
    with open(path, "rb") as f:
        key, back = decode(f.read())
    assert key == (4, 2) and back["objects"] == obj["objects"]
    for a, b in zip(back["model"], obj["model"]):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_the_newest_key_of_the_host_wins(tmp_path):
    d = str(tmp_path)
    CommitStore(d, 0).write((5, 0), {"objects": {}})
    CommitStore(d, 1).write((5, 1), {"objects": {}})  # same count, later generation
    CommitStore(d, 2).write((4, 3), {"objects": {}})
    key, path = CommitStore(d, 9).newest()
    assert key == (5, 1) and path.endswith("rank1.commit.0")
    assert CommitStore(str(tmp_path / "empty"), 0).newest() == ((0, 0), None)


def test_slots_alternate_and_a_torn_write_leaves_the_previous_commit(tmp_path):
    store = CommitStore(str(tmp_path), 0)
    for count in range(1, 5):
        store.write((count, 0), {"objects": {"count": count}, "a": np.full(1000, count)})
    key, path = store.newest()
    assert key == (4, 0) and path.endswith(".commit.1")
    other = store.paths[0]
    assert read_key(other) == (3, 0)
    # A rank killed in the middle of its next write: the header is gone first.
    with open(other, "r+b") as f:
        f.write(b"\0" * 6)
        f.seek(200)
        f.write(b"garbage")
    assert store.newest() == ((4, 0), path)
    with open(path, "rb") as f:
        assert decode(f.read())[1]["objects"] == {"count": 4}
    store.write((5, 1), {"objects": {"count": 5}})  # goes into the torn slot
    assert store.newest()[0] == (5, 1) and read_key(path) == (4, 0)


def test_a_torn_or_foreign_file_is_not_a_commit(tmp_path):
    pieces = b"".join(bytes(p) for p in encode((2, 0), {"objects": {"a": np.zeros(5)}}))
    (tmp_path / "rank0.commit.0").write_bytes(pieces[:10])
    (tmp_path / "rank1.commit.0").write_bytes(b"hello world, not a commit at all......")
    assert read_key(str(tmp_path / "rank0.commit.0")) is None
    assert CommitStore(str(tmp_path), 5).newest() == ((0, 0), None)
    with pytest.raises(ValueError, match="header says"):
        decode(pieces[:-3])


def test_update_file_round_trip(tmp_path):
    path = str(tmp_path / "u")
    assert protocol.read_update(path) == (0, 0)
    protocol.write_update(path, 3, True)
    assert protocol.read_update(path) == (3, 1)
    assert protocol.read_update("") == (0, 0)
