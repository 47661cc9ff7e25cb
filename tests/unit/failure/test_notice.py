"""A failure notice on the wire (failure/channel.py): the sender, its text, and the rank
the failure came from when that is a peer the sender found gone."""
from horolite.failure.channel import NOTICE_BYTES, Notice


def test_a_notice_names_its_sender_as_the_origin_unless_told_otherwise():
    own = Notice.decode(2, Notice(2, "rank 2 (host b) failed: RuntimeError: bad").encode())
    assert (own.rank, own.origin, own.cause, own.text) == \
        (2, -1, 2, "rank 2 (host b) failed: RuntimeError: bad")
    relayed = Notice.decode(0, Notice(0, "rank 3 (host c) is gone (...)", 3).encode())
    assert (relayed.rank, relayed.origin, relayed.cause) == (0, 3, 3)
    assert relayed.text == "rank 3 (host c) is gone (...)"


def test_a_long_notice_fits_the_receive_and_an_empty_one_still_says_who():
    assert len(Notice(1, "x" * 2 * NOTICE_BYTES, 4).encode()) == NOTICE_BYTES
    assert Notice.decode(5, Notice(5, "").encode()).text == "rank 5 failed"
    assert Notice.decode(5, b"").cause == 5
