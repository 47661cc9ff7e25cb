"""The vocabulary every layer shares: reduce ops and dtypes, requests and responses, handles,
settings and configuration, logging, the timeline, the C kernels and the device helpers.
Nothing here imports from another horolite subpackage."""
