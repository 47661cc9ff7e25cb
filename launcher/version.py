"""horolite's version, read lazily: the launcher must not need the runtime to import."""
from __future__ import annotations

import sys

__all__ = ["horolite_version"]


def horolite_version() -> str:
    module = sys.modules.get("horolite")
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    try:
        from importlib import metadata
        return metadata.version("horolite")
    except Exception:
        return "unknown"
