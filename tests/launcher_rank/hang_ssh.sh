#!/bin/sh
# Stands in for ssh to a host that never answers (used with --start-timeout tests).
exec sleep 311
