"""Configuration: HOROLITE_ beats HOROVOD_, explicit beats both, clear errors."""
import dataclasses

import pytest

from horolite.core import config
from horolite.core import settings


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


def test_bad_horovod_spelling_is_named_as_set():
    with pytest.raises(ValueError, match="HOROVOD_CYCLE_TIME='x' is not a float"):
        config.from_environ({"HOROVOD_CYCLE_TIME": "x"})


def test_choices():
    c = config.from_environ({"HOROLITE_LOG_LEVEL": "debug", "HOROVOD_WAIT_MODE": "BLOCK"})
    assert (c.log_level, c.wait_mode) == ("DEBUG", "block")
    assert config.from_environ({"HOROLITE_LOG_LEVEL": "warn"}).log_level == "WARNING"
    with pytest.raises(ValueError, match="HOROLITE_LOG_LEVEL='LOUD' must be one of TRACE, DEBUG"):
        config.from_environ({"HOROLITE_LOG_LEVEL": "LOUD"})


def test_hierarchical_allreduce_is_on_unless_switched_off_allgather_off_unless_asked():
    c = config.from_environ({})
    assert c.hierarchical_allreduce is True and c.hierarchical_allgather is False
    c = config.from_environ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0",
                             "HOROLITE_HIERARCHICAL_ALLGATHER": "1"})
    assert c.hierarchical_allreduce is False and c.hierarchical_allgather is True


def test_config_is_the_declaration():
    fields = {f.name: f.default for f in dataclasses.fields(config.Config)}
    declared = {s.field: s.default for s in settings.SETTINGS if s.scope == "rank"}
    assert fields == dict(declared, explicit=frozenset())
    assert set(config.VARIABLES) == {s.name for s in settings.SETTINGS if s.scope == "rank"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.from_environ({}).cycle_time_ms = 3


def test_unhonoured_variables_are_named_with_what_to_do():
    found = dict(settings.unhonoured({
        "HOROVOD_CYCLE_TIME": "1", "HOROLITE_GPU_DEVICE": "0", "HOROLITE_MPIRUN": "x",
        "HOROVOD_TORUS_ALLREDUCE": "1", "HOROLITE_CYCLETIME": "3", "HOROVOD_ELASTIC": "1",
        "HOROLITE_TEST_OUTDIR": "/tmp", "HOROLITE_UNDER_MPIRUN": "1", "PATH": "/bin"}))
    assert set(found) == {"HOROVOD_TORUS_ALLREDUCE", "HOROLITE_CYCLETIME", "HOROVOD_ELASTIC"}
    assert "HIERARCHICAL_ALLREDUCE" in found["HOROVOD_TORUS_ALLREDUCE"]
    assert "not a horolite setting" in found["HOROLITE_CYCLETIME"]
    assert "--min-np" in found["HOROVOD_ELASTIC"]
