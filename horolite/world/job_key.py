"""The job's secret, for jobs started without MPI: from HOROLITE_JOB_KEY (hex) or the
file HOROLITE_JOB_KEY_FILE names, never from the command line, which every user of the
host can read in ``ps``. A key file other users can read is warned about once."""
from __future__ import annotations

import logging
import os
import re
import threading
from typing import Mapping, Optional

from horolite.world.rendezvous_wire import MIN_KEY_BYTES

__all__ = ["job_key", "MIN_KEY_BYTES"]

_log = logging.getLogger("horolite.world.identity")
_warned = set()
_warned_lock = threading.Lock()


def _given(environ: Mapping[str, str], name: str) -> bool:
    return bool(environ.get(name, "").strip())


def job_key(environ: Mapping[str, str] = os.environ) -> Optional[bytes]:
    """The job's secret from HOROLITE_JOB_KEY (hex) or the file HOROLITE_JOB_KEY_FILE
    names (raw bytes or hex text); None when neither is set."""
    inline, path = _given(environ, "HOROLITE_JOB_KEY"), _given(environ, "HOROLITE_JOB_KEY_FILE")
    if inline and path:
        raise ValueError("both HOROLITE_JOB_KEY and HOROLITE_JOB_KEY_FILE are set: set one")
    if inline:
        try:
            key = bytes.fromhex(environ["HOROLITE_JOB_KEY"].strip())
        except ValueError:
            raise ValueError("HOROLITE_JOB_KEY is not hexadecimal (write the key as hex "
                             "digits, or put raw bytes in HOROLITE_JOB_KEY_FILE)") from None
        where = "HOROLITE_JOB_KEY"
    elif path:
        where = f"HOROLITE_JOB_KEY_FILE ({environ['HOROLITE_JOB_KEY_FILE'].strip()})"
        try:
            with open(environ["HOROLITE_JOB_KEY_FILE"].strip(), "rb") as f:
                raw = f.read(1 << 20)
                mode = os.fstat(f.fileno()).st_mode
        except OSError as e:
            raise ValueError(f"{where} cannot be read: {e.strerror or e}") from None
        if mode & 0o077:
            _warn_once(f"{where} can be read by other users (mode {mode & 0o777:04o}): "
                       f"anyone who reads the key can join or disturb the job; `chmod 600` it "
                       f"(a Kubernetes Secret's file is private to the pod already)")
        key = _hex_or_raw(raw)
    else:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{where} holds {len(key)} bytes; the job key needs at least "
                         f"{MIN_KEY_BYTES}")
    return key


def _warn_once(text: str) -> None:
    with _warned_lock:
        if text in _warned:
            return
        _warned.add(text)
    _log.warning(text)


def _hex_or_raw(raw: bytes) -> bytes:
    text = raw.strip()
    if text and re.fullmatch(rb"[0-9a-fA-F]+", text) and len(text) % 2 == 0:
        return bytes.fromhex(text.decode())
    return raw
