"""bench/elastic_chaos.py --bed at a small count: a --gloo job on hl-a:2 and hl-b:2
(horolite-run on hl-c) through a kill -9, a SIGSTOP past the stall shutdown and a cut of
one host's cable that heals ends 0 with every batch counted exactly once on every
finishing rank."""
import os
import sys
import time

from jobs import ROOT
from test_multihost_gloo import _job_processes

sys.path.insert(0, os.path.join(ROOT, "bench"))
import elastic_chaos  # noqa: E402


def test_a_kill_a_stop_and_a_cut_that_heals_lose_nothing(bed, monkeypatch):
    monkeypatch.chdir(ROOT)
    # (seed 6 deals the kinds cut, kill, stop; the victims and times stay random)
    result = elastic_chaos.run_chaos(faults=3, seed=6, kinds=["kill", "stop", "cut"],
                                     every=(1.0, 2.0), stall=2.0, np_=4, min_np=2,
                                     commit_every=5, sleep=0.02, timeout=90,
                                     log=lambda _: None, bed=bed, cut=4.0)
    # The cut host's evicted ranks end on their own once they hear they are out.
    deadline = time.monotonic() + 20
    while (_job_processes(bed, "hl-a") or _job_processes(bed, "hl-b")) and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    assert result.get("ok"), (result.get("error"), result.get("problems"),
                              result["stderr_tail"])
    assert result["done"] == {"cut": 1, "kill": 1, "stop": 1}, result
    assert result["recoveries"] >= 2 and len(result["kill_to_next_step_s"]) == 1, result
    assert None not in result["kill_to_next_step_s"] + result["cut_to_next_step_s"], result

