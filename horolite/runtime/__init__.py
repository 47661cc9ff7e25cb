"""One runtime per process set: its background thread and cycle, the end of a job that cannot
go on, and the registry that holds the global runtime and those of the process sets."""
