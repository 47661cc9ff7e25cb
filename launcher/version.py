"""horolite's version, as written in horolite/version.py."""
from __future__ import annotations

__all__ = ["horolite_version"]


def horolite_version() -> str:
    from horolite.version import __version__
    return __version__
