"""The binary control messages: round trips, and a seeded fuzz of the decoders."""
import random

import pytest

from horolite.coordination import wire
from horolite.errors import ControlMessageError
from horolite.core.messages import Kind, Request, Response

# One case per field of each table: a new field gets a value here.
REQUESTS = [
    Request("grad.0", Kind.ALLREDUCE, "float32", (3, 4)),
    Request("w/ünï", Kind.BROADCAST, "int64", (), op=1, root=2, prescale=0.5, postscale=-2.25,
            device="cuda"),
    Request("g", Kind.ALLREDUCE, "float16", (10,), group=((2, 3), (4,), ()), quorum=3),
    Request("gone", Kind.ALLREDUCE, "", (), abandoned="its previous run failed after 1 of 3 — ünïcode"),
    Request("mixed.1", Kind.ALLREDUCE, "float64", (7,), op=4, members=2),
    Request("horolite.join", Kind.JOIN, "", ()),
]
RESPONSES = [
    Response(Kind.ALLREDUCE, "grad.0", "float32", (3, 4), op=3, prescale=2.0, postscale=0.125),
    Response(Kind.ALLREDUCE, "q", "float64", (2,), contributors=(0, 2, 3), present=(0, 1, 2, 3)),
    Response(Kind.ALLGATHER, "ag", "uint8", (5, 2), first_dims=(5, 0, 7), joined=(1,)),
    Response(Kind.BROADCAST, "b", error="tensor 'b': mismatched dtype: rank 0 had int8",
             error_type="invalid", root=1, device="cuda"),
    Response(Kind.ALLREDUCE, "mixed.1", error="tensor 'mixed.1': rank 1 will never send it: why",
             error_type="abandoned", peer=1),
    Response(Kind.JOIN, "horolite.join", last_joined=3),
]


def test_every_field_has_a_case():
    assert [a for a, _ in wire.REQUEST_FIELDS] == [
        f for f in Request.__dataclass_fields__]
    assert {a for a, _ in wire.RESPONSE_FIELDS} == set(Response.__dataclass_fields__) - {"cache_slot"}
    # each field takes a value other than its default in some case above
    for cases, fields in ((REQUESTS, wire.REQUEST_FIELDS), (RESPONSES, wire.RESPONSE_FIELDS)):
        cls = type(cases[0])
        for attr, _ in fields:
            default = cls.__dataclass_fields__[attr].default
            assert any(getattr(c, attr) != default for c in cases), attr


def test_requests_round_trip():
    got = wire.decode_requests(wire.encode_requests(REQUESTS), sender=3)
    assert got == REQUESTS
    assert all(type(r.kind) is Kind for r in got)
    assert wire.decode_requests(wire.encode_requests([]), 1) == []


@pytest.mark.parametrize("stop", [None, ("stall", "tensor 'x' waited 10 s"), ("control", "")])
def test_responses_round_trip(stop):
    got, got_stop = wire.decode_responses(wire.encode_responses(RESPONSES, stop), 0)
    assert got == RESPONSES and got_stop == stop


def test_bad_bytes_name_the_sender():
    good = wire.encode_requests(REQUESTS)
    with pytest.raises(ControlMessageError, match=r"malformed request list from rank 2 .*truncated"):
        wire.decode_requests(good[:-3], sender=2)
    with pytest.raises(ControlMessageError, match=r"from rank 5 .*left over"):
        wire.decode_requests(good + b"x", sender=5)
    with pytest.raises(ControlMessageError, match=r"from rank 1 .*not 0x"):
        wire.decode_requests(wire.encode_responses(RESPONSES), sender=1)
    # kind byte of the first request (after magic, count, name length, name)
    bad = bytearray(good)
    bad[8] = 4  # the kind, first of the fixed fields
    with pytest.raises(ControlMessageError, match="unknown collective kind 4"):
        wire.decode_requests(bytes(bad), sender=1)
    # a pickle is not a message, and decoding it runs nothing
    import pickle
    with pytest.raises(ControlMessageError, match="from rank 1"):
        wire.decode_requests(pickle.dumps(REQUESTS), sender=1)


def _mutations(rng, data: bytes):
    yield data[:rng.randrange(len(data))]  # truncated
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):  # flipped bytes
        b[rng.randrange(len(b))] = rng.randrange(256)
    yield bytes(b)
    b = bytearray(data)  # a length field blown up
    pos = rng.randrange(len(b) - 4)
    b[pos:pos + 4] = rng.choice([b"\xff\xff\xff\xff", b"\x00\x00\x10\x00", b"\x07\x00\x00\x00"])
    yield bytes(b)
    yield bytes(rng.randrange(256) for _ in range(rng.randrange(64)))  # noise


def test_fuzzed_messages_decode_or_raise_one_error():
    """Seeded, a fixed number of cases: any result is either well-typed records or
    ControlMessageError, nothing else."""
    rng = random.Random(18)
    good = [(wire.decode_requests, wire.encode_requests(REQUESTS)),
            (wire.decode_responses, wire.encode_responses(RESPONSES, ("stall", "m")))]
    cases = 0
    for _ in range(300):  # a fixed number of rounds: the same cases on every machine
        for decode, data in good:
            for bad in _mutations(rng, data):
                cases += 1
                try:
                    out = decode(bad, 4)
                except ControlMessageError as e:
                    assert "from rank 4" in str(e)
                    continue
                records = out[0] if isinstance(out, tuple) else out
                for rec in records:
                    assert type(rec) in (Request, Response) and type(rec.kind) is Kind
                    assert isinstance(rec.name, str) and all(type(d) is int for d in rec.shape)
    assert cases > 1000


def test_exact_error_messages():
    # (found by mutation testing: the texts name where and why, and their numbers are right)
    good = wire.encode_requests(REQUESTS)
    with pytest.raises(ControlMessageError) as e:
        wire.decode_requests(good[:3], sender=2)
    assert str(e.value) == ("malformed request list from rank 2 (3 bytes, near byte 0): "
                            "truncated at byte 0 (needs 8, 3 left)")
    one = wire.encode_requests([Request("ab", Kind.ALLREDUCE, "f", ())])
    fixed = wire._REQUESTS.fixed.size  # the name's length comes right after the fixed fields
    # a string length past the bytes left
    bad = one[:8 + fixed] + (1000).to_bytes(4, "little") + one[8 + fixed + 4:]
    with pytest.raises(ControlMessageError) as e:
        wire.decode_requests(bad, sender=1)
    left = len(bad) - 8 - fixed - 4
    assert str(e.value).endswith(f"length 1000 at byte {8 + fixed} exceeds the {left} bytes left")
    with pytest.raises(ControlMessageError, match=r"from rank 0 .*: 1 bytes left over after the last record$"):
        wire.decode_responses(wire.encode_responses([]) + b"\0", 0)
    with pytest.raises(ControlMessageError, match=r"^malformed response list from rank 4 "
                                                  r"\(9 bytes, near byte 8\): presence byte 2 at "
                                                  r"byte 8 is neither 0 nor 1$"):
        wire.decode_responses(wire.encode_responses([])[:8] + b"\2", 4)
    header = wire.encode_requests([])[:4]
    with pytest.raises(ControlMessageError, match=r"2 records cannot fit in 16 bytes"):
        wire.decode_requests(header + (2).to_bytes(4, "little") + bytes(8), 0)


def test_tight_messages_round_trip():
    # The last record ends with a non-empty integer list, or empty shapes: the length
    # checks are exact, not loose.
    last = [Response(Kind.ALLREDUCE, "q", "float64", (2,), contributors=(0, 2), present=(0, 1, 2))]
    assert wire.decode_responses(wire.encode_responses(last), 0) == (last, None)
    requests = [Request("g", Kind.ALLREDUCE, "float32", (1,), group=((), ()))]
    assert wire.decode_requests(wire.encode_requests(requests), 0) == requests


def test_the_longest_string_and_one_byte_more():
    longest = "x" * wire.MAX_STRING
    reqs = [Request(longest, Kind.ALLREDUCE, "f", ())]
    assert wire.decode_requests(wire.encode_requests(reqs), 0) == reqs
    with pytest.raises(ValueError, match=f"string of {wire.MAX_STRING + 1} bytes exceeds"):
        wire.encode_requests([Request(longest + "y", Kind.ALLREDUCE, "f", ())])


def test_exact_error_messages_past_the_header():
    size = wire._REQUESTS.fixed.size
    one = wire.encode_requests([Request("ab", Kind.ALLREDUCE, "f", ())])

    def message(data, decode=wire.decode_requests):
        with pytest.raises(ControlMessageError) as e:
            decode(data, 0)
        return str(e.value).split("): ", 1)[1]

    assert message(wire.encode_responses([])[:8], wire.decode_responses) == \
        "truncated at byte 8 (needs 1, 0 left)"
    assert message(one[:8 + size + 2]) == f"truncated at byte {8 + size} (a length needs 4 bytes, 2 left)"
    bad_utf8 = one[:8 + size + 4] + b"\xff" + one[8 + size + 5:]
    assert message(bad_utf8) == f"string at byte {8 + size + 4} is not UTF-8 (invalid start byte)"
    header = one[:4]
    assert message(header + b"\xff\xff\xff\xff" + bytes(8)) == "4294967295 records cannot fit in 16 bytes"
    assert message(header + (2).to_bytes(4, "little") + bytes(2 * size - 6)) == \
        f"2 records cannot fit in {8 + 2 * size - 6} bytes"
    two = wire.encode_requests([Request("x" * 100, Kind.ALLREDUCE, "f", ()),
                                Request("y", Kind.ALLREDUCE, "f", ())])
    second = len(one) - 2 + 100  # where the second record starts
    assert message(two[:second + 5]) == f"truncated record at byte {second}"
