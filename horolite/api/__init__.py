"""The NumPy front end with Horovod's names: init and topology, collectives, grouped
collectives, process sets, capability queries. Framework adapters build on it."""
