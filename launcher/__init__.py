"""horolite's launcher, ``horolite-run``: a small wrapper over one real ``mpirun``, or
its own start of the ranks without MPI (``--gloo``)."""
from .main import LaunchConfig, config_from_args, get_args_parser, main

__all__ = ["LaunchConfig", "config_from_args", "get_args_parser", "main"]
