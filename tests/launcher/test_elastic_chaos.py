"""bench/elastic_chaos.py at a small count: a --gloo -np 4 --min-np 2 job with three faults
drawn from kill -9, SIGSTOP of a rank past the stall shutdown and a paused rank with its
wrapper ends 0 with every batch counted exactly once on every finishing rank."""
import os
import sys

from launcher_util import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import elastic_chaos  # noqa: E402


def test_three_random_faults_lose_nothing():
    result = elastic_chaos.run_chaos(faults=3, seed=7, kinds=["kill", "stop", "pause"],
                                     every=(1.5, 2.5), stall=2.0, np_=4, min_np=2,
                                     commit_every=5, sleep=0.02, timeout=120, log=lambda _: None)
    assert result.get("ok"), (result.get("error"), result.get("problems"),
                              result["stderr_tail"])
    assert sum(result["done"].values()) == 3 and result["recoveries"] >= 3, result
