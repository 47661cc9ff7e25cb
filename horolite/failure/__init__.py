"""How ranks fail and hear of each other's failures: the failure channel, heartbeats, the
watch inside collective waits, process hooks (exit, signals, fork), the shared-memory files a
failed job leaves, and the launch check that refuses N separate trainings."""
