"""A killed rank's report that comes after mpirun's clean-up has begun is still heard.

MPICH's mpiexec kills every rank once one ends with an error. Across hosts over horolite's
TCP connections the survivors of a kill -9 fail within milliseconds, so on a busy host the
killed rank's wrapper could be ended before it had reported the signal, and horolite-run's
summary then lacked it (issue 57, item 6). Here the killed rank's wrapper is stopped until
2 s after its rank died: the other rank's wrapper, as horolite-run starts it, holds its end
and the summary names the signal.
"""
import os
import sys
import time

from horolite.launcher.main import config_from_args, get_args_parser, wrapper_argv
from horolite.launcher.supervise import Supervisor

HYDRA_LIKE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hydra_like.py")

# Rank 1 stops its own wrapper, dies of SIGKILL, and a helper wakes the wrapper 2 s later.
# Rank 0 hears of it and fails as the runtime's survivors do.
RANKS = """
if [ "$PMI_RANK" = 1 ]; then
    (sleep 2; kill -CONT $PPID) >/dev/null 2>&1 &
    kill -STOP $PPID
    touch "$DIR/dying"
    kill -9 $$
fi
while [ ! -e "$DIR/dying" ]; do sleep 0.05; done
sleep 0.2
echo "##horolite-run## stopped rank=0 by=1 text=the connection to rank 1 closed" >&2
exit 1
"""


def test_a_killed_ranks_late_report_is_heard_and_the_job_then_ends_at_once(tmp_path, capfd):
    config = config_from_args(get_args_parser({}).parse_args(["-np", "2", "sh"]), {})
    argv = [sys.executable, HYDRA_LIKE, "2", "--", *wrapper_argv(config), "sh", "-c", RANKS]
    # fail_grace: the bound on waiting for the missing report; far above the 2 s here.
    sup = Supervisor(argv, 2, ["h", "h"], start_timeout=60, fail_grace=60,
                     env=dict(os.environ, DIR=str(tmp_path)), log=lambda msg: None)
    started = time.monotonic()
    result = sup.run()
    took = time.monotonic() - started
    pid = sup.ranks[1].pgid
    assert result.exit_code == 137, (result, capfd.readouterr().err[-3000:])
    assert result.message.startswith(f"job failed: rank 1 (host {sup.ranks[1].host}, pid {pid}) "
                                     f"was killed by signal 9 (SIGKILL); ranks stopped as a "
                                     f"result: 0"), result.message
    # Every report in: horolite-run ended the held wrappers without waiting out fail_grace.
    assert took < 30, took
