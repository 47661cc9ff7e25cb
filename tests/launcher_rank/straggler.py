"""A job with one slow rank: before each allreduce, the rank named by argv[1] sleeps
argv[2] seconds (the others do not); argv[3] steps."""
import sys
import time

import numpy as np

import horolite as hvd

slow, delay, steps = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
hvd.init()
for step in range(steps):
    if hvd.rank() == slow:
        time.sleep(delay)
    hvd.allreduce(np.ones(8, np.float32), name="grad")
hvd.shutdown()
