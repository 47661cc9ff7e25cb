"""Logging with the rank in every line, at the level HOROLITE_LOG_LEVEL gives."""
from __future__ import annotations

import logging

__all__ = ["TRACE", "configure"]

# Horovod's most verbose level, below DEBUG; registered so its lines say TRACE.
TRACE = 5
logging.addLevelName(TRACE, "TRACE")

_LEVELS = {"TRACE": TRACE, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
           "WARN": logging.WARNING, "ERROR": logging.ERROR, "FATAL": logging.CRITICAL,
           "CRITICAL": logging.CRITICAL}


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, size: int):
        super().__init__()
        self.rank, self.size = rank, size

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        record.size = self.size
        return True


_handler = None


def configure(level: str, rank: int, size: int, hide_time: bool = False) -> None:
    """Attach one stderr handler to the 'horolite' logger (idempotent).

    hide_time drops the timestamp (HOROLITE_LOG_HIDE_TIME, horovodrun's
    --log-without-timestamp)."""
    global _handler
    logger = logging.getLogger("horolite")
    logger.setLevel(_LEVELS.get(level.upper(), logging.WARNING))
    if _handler is not None:
        logger.removeHandler(_handler)
    _handler = logging.StreamHandler()
    _handler.addFilter(_RankFilter(rank, size))
    stamp = "" if hide_time else "%(asctime)s "
    _handler.setFormatter(logging.Formatter(
        f"[{stamp}horolite rank %(rank)d/%(size)d] %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(_handler)
    logger.propagate = False
