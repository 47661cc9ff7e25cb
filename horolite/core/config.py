"""Runtime configuration: one frozen object read once from the environment.

Every field comes from a declaration in settings.py (``HOROLITE_<NAME>``, or
``HOROVOD_<NAME>`` so Horovod users' job scripts keep working). An explicit
argument beats the environment, which beats the default.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from . import settings
from .settings import env_value

__all__ = ["Config", "from_environ", "env_value", "VARIABLES"]

_RANK_SETTINGS = [s for s in settings.SETTINGS if s.scope == "rank"]

# HOROLITE_<name> -> (default, meaning) of every setting a rank reads.
VARIABLES = {s.name: (s.default, s.meaning) for s in _RANK_SETTINGS}

Config = dataclasses.make_dataclass(
    "Config",
    [(s.field, object, dataclasses.field(default=s.default)) for s in _RANK_SETTINGS]
    # Names of the fields the user set explicitly (autotune holds them fixed).
    + [("explicit", frozenset, dataclasses.field(default=frozenset()))],
    frozen=True, namespace={"__doc__": "The runtime's settings (see horolite/core/settings.py)."})
Config.__module__ = __name__


def from_environ(environ: Optional[Mapping[str, str]] = None, **overrides) -> Config:
    """Build the Config; keyword overrides (field names) win over the environment."""
    values = {settings.BY_NAME[name].field: value
              for name, value in settings.parse(environ).items()}
    explicit = set(values)
    for field, value in overrides.items():
        if value is not None:
            values[field] = value
            explicit.add(field)
    return Config(explicit=frozenset(explicit), **values)
