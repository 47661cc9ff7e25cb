"""The binary layout of control messages: requests to the coordinator, responses back.

Pickle would let a peer's bytes run code in this process; here decoding only
reads numbers and UTF-8 strings at explicit lengths, checks every length and
enum value against the bytes left, and any bad message raises one
ControlMessageError naming the rank that sent it.

Each message is a header (magic, version, count) and `count` records; a record
is its class's fields in the order of a table (REQUEST_FIELDS, RESPONSE_FIELDS)
of (attribute, field type). The dataclasses in messages.py stay the model:
adding a field to one is one line in its table (and a case in tests/unit/coordination/test_wire.py).
"""
from __future__ import annotations

import operator
import struct
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

from ..errors import ControlMessageError
from ..core.messages import Kind, Request, Response

__all__ = ["encode_requests", "decode_requests", "encode_responses", "decode_responses",
           "REQUEST_FIELDS", "RESPONSE_FIELDS", "MAX_STRING", "MAX_ITEMS"]

_MAGIC_REQUESTS = 0x48515201  # "HQR" + version 1
_MAGIC_RESPONSES = 0x48515301  # "HQS" + version 1
# Limits a well-formed message never reaches; a length past them is corruption.
MAX_STRING = 1 << 20
MAX_ITEMS = MAX_STRING

_U32 = struct.Struct("<I")
_KINDS = {int(k): k for k in Kind}


class _Malformed(Exception):
    """Raised inside decoding; turned into ControlMessageError with the sender's rank."""


def _need(data, pos: int, nbytes: int) -> None:
    if pos + nbytes > len(data):
        raise _Malformed(f"truncated at byte {pos} (needs {nbytes}, {len(data) - pos} left)")


def _count(data, pos: int, width: int) -> int:
    """A u32 length prefix at `pos` for `width`-byte items, checked against the bytes left."""
    try:
        n = _U32.unpack_from(data, pos)[0]
    except struct.error:
        raise _Malformed(f"truncated at byte {pos} (a length needs 4 bytes, "
                         f"{len(data) - pos} left)") from None
    if n * width > len(data) - pos - 4 or n > MAX_ITEMS:
        raise _Malformed(f"length {n} at byte {pos} exceeds the {len(data) - pos - 4} bytes left")
    return n


# ---- field types ----
# A fixed field is one struct code (all of a record's fixed fields travel first, in one
# struct); a variable one has write(out, value) and read(data, pos) -> (value, new pos).
class Fixed(NamedTuple):
    code: str
    check: Optional[Callable] = None  # value -> value, or raise _Malformed


class Variable(NamedTuple):
    write: Callable
    read: Callable


_encoded_strings = {}  # names recur every cycle: their bytes are kept (bounded)


def _w_str(out: list, value: str) -> None:
    raw = _encoded_strings.get(value)
    if raw is None:
        body = value.encode("utf-8")
        if len(body) > MAX_STRING:
            raise ValueError(f"control message string of {len(body)} bytes exceeds {MAX_STRING}")
        raw = _U32.pack(len(body)) + body
        if len(_encoded_strings) > 4096:
            _encoded_strings.clear()
        _encoded_strings[value] = raw
    out.append(raw)


def _r_str(data, pos: int):
    n = _count(data, pos, 1)  # (so n <= MAX_ITEMS <= MAX_STRING)
    pos += 4
    try:
        return data[pos:pos + n].decode("utf-8"), pos + n
    except UnicodeDecodeError as e:
        raise _Malformed(f"string at byte {pos} is not UTF-8 ({e.reason})") from None


def _w_ints(out: list, value) -> None:
    out.append(struct.pack(f"<I{len(value)}q", len(value), *value))


def _r_ints(data, pos: int):
    n = _count(data, pos, 8)
    return struct.unpack_from(f"<{n}q", data, pos + 4), pos + 4 + 8 * n


def _w_shapes(out: list, value) -> None:
    out.append(_U32.pack(len(value)))
    for shape in value:
        _w_ints(out, shape)


def _r_shapes(data, pos: int):
    count, pos = _count(data, pos, 4), pos + 4
    shapes = []
    for _ in range(count):
        shape, pos = _r_ints(data, pos)
        shapes.append(shape)
    return tuple(shapes), pos


def _optional(write, read):
    def w(out: list, value) -> None:
        if value is None:
            out.append(b"\0")
        else:
            out.append(b"\1")
            write(out, value)

    def r(data, pos: int):
        _need(data, pos, 1)
        flag = data[pos]
        if flag > 1:
            raise _Malformed(f"presence byte {flag} at byte {pos} is neither 0 nor 1")
        return read(data, pos + 1) if flag else (None, pos + 1)
    return Variable(w, r)


def _kind(value: int) -> Kind:
    kind = _KINDS.get(value)
    if kind is None:
        raise _Malformed(f"unknown collective kind {value}")
    return kind


def _w_pair(out: list, value) -> None:
    _w_str(out, value[0])
    _w_str(out, value[1])


def _r_pair(data, pos: int):
    first, pos = _r_str(data, pos)
    second, pos = _r_str(data, pos)
    return (first, second), pos


STR = Variable(_w_str, _r_str)
INT = Fixed("q")
FLOAT = Fixed("d")
KIND = Fixed("B", _kind)
INTS = Variable(_w_ints, _r_ints)
SHAPES = Variable(_w_shapes, _r_shapes)
OPTIONAL_INTS = _optional(_w_ints, _r_ints)
OPTIONAL_STR = _optional(_w_str, _r_str)
# The response list's trailer: None, or (reason, message) when the job must stop.
OPTIONAL_STOP = _optional(_w_pair, _r_pair)

# Every field that crosses the wire, with its type. Response.cache_slot stays local.
REQUEST_FIELDS = (
    ("name", STR), ("kind", KIND), ("dtype", STR), ("shape", INTS), ("op", INT), ("root", INT),
    ("prescale", FLOAT), ("postscale", FLOAT), ("device", STR), ("group", SHAPES), ("quorum", INT),
    ("abandoned", STR), ("members", INT),
)
RESPONSE_FIELDS = (
    ("kind", KIND), ("name", STR), ("dtype", STR), ("shape", INTS), ("op", INT), ("root", INT),
    ("prescale", FLOAT), ("postscale", FLOAT), ("device", STR), ("first_dims", OPTIONAL_INTS),
    ("joined", INTS), ("error", OPTIONAL_STR), ("error_type", STR), ("last_joined", INT),
    ("contributors", INTS), ("present", INTS), ("peer", INT),
)


class _Layout:
    """A table compiled: the fixed fields as one struct, then the variable ones in order."""

    def __init__(self, cls, magic: int, fields, trailer: bool):
        self.cls, self.magic, self.trailer = cls, magic, trailer
        fixed = [(a, t) for a, t in fields if isinstance(t, Fixed)]
        variable = [(a, t) for a, t in fields if isinstance(t, Variable)]
        self.fixed = struct.Struct("<" + "".join(t.code for _, t in fixed))
        self.checks = [(i, t.check) for i, (_, t) in enumerate(fixed) if t.check]
        self.get_fixed = operator.attrgetter(*[a for a, _ in fixed])
        self.variable = [(a, t.write, t.read) for a, t in variable]
        self.attrs = [a for a, _ in fixed] + [a for a, _ in variable]

    def encode(self, records: Sequence, trailer=None) -> bytes:
        out = [_U32.pack(self.magic), _U32.pack(len(records))]
        pack, get_fixed, variable = self.fixed.pack, self.get_fixed, self.variable
        for record in records:
            out.append(pack(*get_fixed(record)))
            for attr, write, _ in variable:
                write(out, getattr(record, attr))
        if self.trailer:
            OPTIONAL_STOP.write(out, trailer)
        return b"".join(out)

    def decode(self, data, what: str, sender: int):
        data = bytes(data)
        size, unpack, cls, attrs = self.fixed.size, self.fixed.unpack_from, self.cls, self.attrs
        pos = 0
        try:
            _need(data, 0, 8)
            magic, count = struct.unpack_from("<II", data)
            if magic != self.magic:
                raise _Malformed(f"starts with 0x{magic:08x}, not 0x{self.magic:08x}")
            if count > (len(data) - 8) // size:
                raise _Malformed(f"{count} records cannot fit in {len(data)} bytes")
            pos = 8
            records = []
            for _ in range(count):
                try:
                    values = list(unpack(data, pos))
                except struct.error:
                    raise _Malformed(f"truncated record at byte {pos}") from None
                pos += size
                for i, check in self.checks:
                    values[i] = check(values[i])
                for _, _, read in self.variable:
                    value, pos = read(data, pos)
                    values.append(value)
                records.append(cls(**dict(zip(attrs, values))))
            trailer = None
            if self.trailer:
                trailer, pos = OPTIONAL_STOP.read(data, pos)
            if pos != len(data):
                raise _Malformed(f"{len(data) - pos} bytes left over after the last record")
        except _Malformed as e:
            raise ControlMessageError(f"malformed {what} from rank {sender} "
                                      f"({len(data)} bytes, near byte {pos}): {e}") from None
        return records, trailer


_REQUESTS = _Layout(Request, _MAGIC_REQUESTS, REQUEST_FIELDS, trailer=False)
_RESPONSES = _Layout(Response, _MAGIC_RESPONSES, RESPONSE_FIELDS, trailer=True)


def encode_requests(requests: Sequence[Request]) -> bytes:
    return _REQUESTS.encode(requests)


def decode_requests(data, sender: int) -> List[Request]:
    """The requests in `data`, sent by rank `sender`; ControlMessageError if malformed."""
    return _REQUESTS.decode(data, "request list", sender)[0]


def encode_responses(responses: Sequence[Response],
                     stop: Optional[Tuple[str, str]] = None) -> bytes:
    """The coordinator's ordered responses, and (reason, message) when every rank must stop."""
    return _RESPONSES.encode(responses, stop)


def decode_responses(data, sender: int = 0
                     ) -> Tuple[List[Response], Optional[Tuple[str, str]]]:
    return _RESPONSES.decode(data, "response list", sender)
