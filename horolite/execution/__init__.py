"""Runs what the ranks agreed on: fusion planning, the host executor that packs, reduces
through a transport and completes handles, the device executor for GPU memory."""
