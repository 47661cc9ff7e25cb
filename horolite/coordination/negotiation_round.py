"""One negotiation round over the transport: every rank's new requests to rank 0, and
rank 0's ordered responses back to all. The Coordinator (negotiation.py) decides; this
moves its input and its answer."""
from __future__ import annotations

import logging
import time
from typing import List, Optional, Sequence, Tuple

from . import wire
from ..core.messages import Request, Response
from ..errors import ControlMessageError

__all__ = ["negotiate"]

_log = logging.getLogger("horolite")


def negotiate(transport, coordinator, rank: int, mine: Sequence[Request],
              stop: Optional[Tuple[str, str]]
              ) -> Tuple[List[Response], Optional[Tuple[str, str]]]:
    """The responses every rank runs next, in order, and a (reason, message) when every
    rank must stop (rank 0's stall check, or a request it could not read)."""
    gathered = transport.gather_bytes(wire.encode_requests(mine) if rank else b"")
    if rank != 0:
        return wire.decode_responses(transport.bcast_bytes(b""), 0)
    now = time.monotonic()
    try:
        decoded = [list(mine)] + [wire.decode_requests(data, q)
                                  for q, data in enumerate(gathered) if q]
    except ControlMessageError as e:
        _log.error("rank 0: %s; stopping the job", e)
        decoded, stop = [], ("control", str(e))
    for q, requests in enumerate(decoded):
        coordinator.add(q, requests, now)
    responses = coordinator.responses() if decoded else []
    transport.bcast_bytes(wire.encode_responses(responses, stop))
    return responses, stop
