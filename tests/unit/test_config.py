"""Configuration: HOROLITE_ beats HOROVOD_, explicit beats both, clear errors."""
import pytest

from horolite import config


def test_defaults():
    c = config.from_environ({})
    assert (c.cycle_time_ms, c.fusion_threshold, c.cache_capacity) == (1.0, 128 * 1024 * 1024, 1024)
    assert c.stall_check_time_seconds == 60 and c.stall_shutdown_time_seconds == 0
    assert c.explicit == frozenset()


def test_horovod_spelling_accepted_and_horolite_wins():
    c = config.from_environ({"HOROVOD_FUSION_THRESHOLD": "1000", "HOROVOD_CYCLE_TIME": "5",
                             "HOROLITE_CYCLE_TIME": "2"})
    assert c.fusion_threshold == 1000 and c.cycle_time_ms == 2.0
    assert c.explicit == {"fusion_threshold", "cycle_time_ms"}


def test_override_beats_environment():
    c = config.from_environ({"HOROLITE_CACHE_CAPACITY": "5"}, cache_capacity=9)
    assert c.cache_capacity == 9


@pytest.mark.parametrize("raw,value", [("1", True), ("yes", True), ("OFF", False), ("0", False)])
def test_booleans(raw, value):
    assert config.from_environ({"HOROLITE_STALL_CHECK_DISABLE": raw}).stall_check_disable is value


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="HOROLITE_CACHE_CAPACITY='lots' is not a int"):
        config.from_environ({"HOROLITE_CACHE_CAPACITY": "lots"})
    with pytest.raises(ValueError, match="must not be negative"):
        config.from_environ({"HOROLITE_FUSION_THRESHOLD": "-1"})
    with pytest.raises(ValueError, match="not a boolean"):
        config.from_environ({"HOROLITE_AUTOTUNE": "maybe"})


def test_every_variable_has_a_field():
    assert set(config.VARIABLES) == set(config._FIELDS)
