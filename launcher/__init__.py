"""horolite's launcher, ``horolite-run``: a small wrapper over one real ``mpirun``."""
from .main import LaunchConfig, config_from_args, get_args_parser, main

__all__ = ["LaunchConfig", "config_from_args", "get_args_parser", "main"]
