"""Rank source: the hostfile the Kubernetes MPI Operator (MPIJob v2beta1) gives the launcher pod.

The operator mounts ``/etc/mpi/hostfile`` and points the MPI at it:
``HYDRA_HOST_FILE`` (mpiImplementation: MPICH), ``I_MPI_HYDRA_HOST_FILE``
(Intel) or ``OMPI_MCA_orte_default_hostfile`` (OpenMPI). Lines are
``worker-0.job.ns.svc:2`` (MPICH, Intel) or ``... slots=2`` (OpenMPI); both
parse. The workers are reached over ssh, which the operator sets up.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

from . import hosts as hostlib
from .rank_source import SSH, Ranks

__all__ = ["HOSTFILE", "VARIABLES", "discover"]

HOSTFILE = "/etc/mpi/hostfile"
VARIABLES = ("HYDRA_HOST_FILE", "I_MPI_HYDRA_HOST_FILE", "OMPI_MCA_orte_default_hostfile")
HELP = ("Check that the worker pods are running and reachable with ssh from the launcher pod "
        "(kubectl get pods -l training.kubeflow.org/job-role=worker)")


def discover(args, environ: Mapping[str, str]) -> Optional[Ranks]:
    for name in VARIABLES:
        if environ.get(name):
            path, where = environ[name], f"the MPI Operator hostfile {environ[name]} ({name})"
            break
    else:
        if not os.path.isfile(HOSTFILE):
            return None
        path, where = HOSTFILE, f"the MPI Operator hostfile {HOSTFILE}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read {where}: {e.strerror}") from None
    return Ranks(hostlib.parse_hostfile(text, path), where, start=SSH, help=HELP)
