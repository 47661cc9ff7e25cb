"""Horovod's ``mpi_ops._basics``: the object behind its module-level functions, whose
underscored process-set queries Horovod's own tests (and some user code) call directly.

horolite's functions are the public ones (``horolite.tensorflow.size`` ...); this object
answers the same questions under Horovod's internal names, with Horovod's errors.
"""
from __future__ import annotations

from typing import Dict, List

from horolite.api import process_sets as _sets

__all__ = ["HorovodBasics"]


class HorovodBasics:
    """Horovod's internal process-set queries; any other attribute is the public
    function of ``horolite.tensorflow`` of that name (``_basics.size()``)."""

    HOROVOD_PROCESS_SET_ERROR_INIT = -1
    HOROVOD_PROCESS_SET_ERROR_DYNAMIC = -2
    HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET = -3
    HOROVOD_PROCESS_SET_ERROR_FOREIGN_SET = -4
    HOROVOD_PROCESS_SET_ERROR_SHUTDOWN = -5
    HOROVOD_PROCESS_SET_ERROR_EXISTING_SET = -6

    def _get_process_set_ids_and_ranks(self) -> Dict[int, List[int]]:
        """{process_set_id: its job ranks} of every registered set, the global one too."""
        return _sets.get_process_set_ids_and_ranks()

    def _process_set_size(self, process_set_id: int) -> int:
        return len(self._ranks(process_set_id))

    def _process_set_rank(self, process_set_id: int) -> int:
        ranks = self._ranks(process_set_id)  # (NotInitializedError before init)
        rank = _sets.registry.global_runtime().topology.rank
        if rank not in ranks:
            raise ValueError("Process is not part of provided process set.")
        return ranks.index(rank)

    def _ranks(self, process_set_id: int) -> List[int]:
        assert isinstance(process_set_id, int)
        ranks = self._get_process_set_ids_and_ranks().get(process_set_id)
        if ranks is None:
            raise ValueError("Process set does not exist or has not been registered.")
        return ranks

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        import horolite.tensorflow as hvd
        return getattr(hvd, name)
