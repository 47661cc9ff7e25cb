"""Transports move tensor bytes between ranks: MPI for host memory, NCCL for GPU memory."""
