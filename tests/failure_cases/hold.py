"""Run one rank's command, then hold its place in mpirun until every rank has reported.

    python hold.py OUTDIR COUNT SECONDS -- COMMAND...

Hydra's mpirun ends every rank a few milliseconds after one dies, which would cut short
the survivors' own reports (as horolite-run's rankwrap --hold avoids): this wrapper, the
process mpirun started, outlives its rank until COUNT files named rank.* are in OUTDIR,
or SECONDS passed, then exits as the rank did (128 + signal for a signal). The rank
inherits every descriptor, MPI's process-manager connection among them.
"""
import glob
import os
import subprocess
import sys
import time

outdir, count, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
command = sys.argv[sys.argv.index("--") + 1:]
code = subprocess.run(command, close_fds=False).returncode
deadline = time.monotonic() + seconds
while len(glob.glob(os.path.join(outdir, "rank.*"))) < count and time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(128 - code if code < 0 else code)
