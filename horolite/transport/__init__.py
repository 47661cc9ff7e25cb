"""Transports move tensor bytes between ranks: the ring over MPI point-to-point, shared memory
between ranks of one host, the hierarchical allreduce across hosts, NCCL for GPU memory."""
