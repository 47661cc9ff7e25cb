"""Autotune's search, driven with synthetic throughput (pure logic)."""
import csv

import pytest

from horolite.core import config
from horolite.coordination.autotune import CYCLE_CHOICES_MS, Autotuner, parse_start


def run(tuner, throughput, seconds=200.0, step=0.01):
    """Feed the tuner cycles whose bytes/s depend on its current setting."""
    now = 0.0
    while now < seconds and not tuner.done:
        fusion, cycle_ms = tuner.setting
        tuner.observe(now, int(throughput(fusion, cycle_ms) * step))
        now += step
    return tuner.setting


def best_at(fusion_mb, cycle):
    return lambda f, c: 1e9 / (1 + abs(c - cycle) + abs((f >> 20) - fusion_mb) / 8)


def test_finds_the_best_setting_from_a_poor_start(tmp_path):
    log = tmp_path / "autotune.csv"
    cfg = config.from_environ({"HOROLITE_AUTOTUNE": "1", "HOROLITE_AUTOTUNE_LOG": str(log)})
    tuner = Autotuner(cfg, window_seconds=0.2, start=parse_start("cycle_time_ms=50"))
    assert tuner.setting[1] == 50
    assert run(tuner, best_at(16, 2.0)) == (16 << 20, 2.0)
    tuner.close()
    rows = list(csv.DictReader(open(log)))
    assert rows[0]["cycle_time_ms"] == "50" and {r["phase"] for r in rows} == {"cycle_ms", "fusion"}
    assert len(rows) == len(CYCLE_CHOICES_MS) + 5


def test_explicit_settings_are_held_fixed():
    cfg = config.from_environ({"HOROLITE_AUTOTUNE": "1", "HOROLITE_CYCLE_TIME": "7"})
    tuner = Autotuner(cfg, window_seconds=0.2)
    fusion, cycle = run(tuner, best_at(4, 1.0))
    assert cycle == 7 and fusion == 4 << 20
    both = config.from_environ({"HOROLITE_AUTOTUNE": "1", "HOROLITE_CYCLE_TIME": "7",
                                "HOROLITE_FUSION_THRESHOLD": "1000"})
    assert Autotuner(both).done and Autotuner(both).setting == (1000, 7.0)


def test_idle_cycles_do_not_count():
    tuner = Autotuner(config.from_environ({"HOROLITE_AUTOTUNE": "1"}), window_seconds=0.2)
    for i in range(100):
        assert not tuner.observe(i * 0.01, 0)
    assert tuner.setting == (128 << 20, 1.0)


def test_bad_start():
    with pytest.raises(ValueError, match="unknown parameter 'speed'"):
        parse_start("speed=3")
