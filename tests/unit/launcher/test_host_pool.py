"""The elastic host pool: discovery, blacklist with Horovod's cooldown, assignment."""
import importlib

import pytest

from test_launcher_cli import _import_launcher

_import_launcher()  # horolite.launcher from this checkout, installed or not
lmain = importlib.import_module("horolite.launcher.main")
elastic_flags = importlib.import_module("horolite.launcher.elastic_flags")
_pool = importlib.import_module("horolite.launcher.host_pool")
DiscoveryScript, FixedHosts, HostPool, assign = (_pool.DiscoveryScript, _pool.FixedHosts,
                                                 _pool.HostPool, _pool.assign)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_blacklisted_for_good_without_cooldown():
    pool = HostPool(FixedHosts([("a", 2), ("b", 2)], "the hosts"))
    pool.refresh(first=True)
    pool.blacklist_host("b", "rank 3 was killed")
    assert pool.available() == [("a", 2)]
    assert not pool.can_change()
    assert "blacklisted: b (rank 3 was killed; for good)" in pool.describe()


def test_cooldown_brings_a_host_back_within_the_range(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("random.uniform", lambda a, b: 1.0)
    pool = HostPool(FixedHosts([("a", 1), ("b", 1)], "the hosts"), cooldown=(2, 5), clock=clock)
    pool.refresh(first=True)
    pool.blacklist_host("a", "x")  # first time: 2 * 2 + 1 * 2 = 6 -> kept at 5
    assert pool.available() == [("b", 1)] and pool.can_change()
    clock.now += 4.9
    assert pool.is_blacklisted("a")
    pool.blacklist_host("a", "again while cooling down")  # no new period, as in Horovod
    clock.now += 0.2
    assert pool.available() == [("a", 1), ("b", 1)]


def test_discovery_script_lines_and_slots_per_host(tmp_path):
    script = tmp_path / "d.sh"
    script.write_text("#!/bin/sh\necho h1:4\necho\necho h2\n")
    script.chmod(0o755)
    assert DiscoveryScript(str(script), 2).find() == {"h1": 4, "h2": 2}
    with pytest.raises(RuntimeError, match="without slots"):
        DiscoveryScript(str(script), None).find()
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/sh\necho oops >&2\nexit 3\n")
    bad.chmod(0o755)
    pool = HostPool(DiscoveryScript(str(bad), 1))
    with pytest.raises(RuntimeError, match="exited with code 3: oops"):
        pool.refresh(first=True)
    pool.refresh()  # later failures are remembered, not raised
    assert "last discovery error" in pool.describe()


def test_hosts_keep_their_first_order_and_fill_up_to_max_np():
    found = {"b": 2, "a": 2}
    pool = HostPool(type("D", (), {"find": lambda self: dict(found), "describe": lambda s: "d"})())
    pool.refresh(first=True)
    found.clear()
    found.update({"c": 1, "a": 2, "b": 2})
    pool.refresh()
    assert pool.available() == [("b", 2), ("a", 2), ("c", 1)]
    assert assign(pool.available(), 3) == (("b", 2), ("a", 1))
    assert assign(pool.available(), None) == (("b", 2), ("a", 2), ("c", 1))


def test_cooldown_range_is_checked():
    with pytest.raises(ValueError, match="1 <= MIN <= MAX <= 3600"):
        HostPool(FixedHosts([], ""), cooldown=(0, 10))


def test_elastic_flags_and_their_defaults():
    parse = lmain.get_args_parser().parse_args
    args = parse(["-np", "4", "--min-np", "2", "--max-np", "8", "--blacklist-cooldown-range",
                  "10", "20", "--reset-limit", "3", "python", "t.py"])
    assert elastic_flags.is_elastic(args)
    cfg = elastic_flags.elastic_config(args, {}, None)
    assert (cfg.num_proc, cfg.min_np, cfg.max_np, cfg.reset_limit, cfg.cooldown, cfg.timeout) == \
        (4, 2, 8, 3, (10, 20), 600.0)
    cfg = elastic_flags.elastic_config(parse(["--host-discovery-script", "d.sh", "-np", "2", "t"]),
                                       {"HOROVOD_ELASTIC_TIMEOUT": "30"}, None)
    assert cfg.timeout == 30.0 and cfg.min_np == 2
    with pytest.raises(ValueError, match="--min-np 5 is more than -np 4"):
        elastic_flags.elastic_config(parse(["-np", "4", "--min-np", "5", "t"]), {}, None)
    assert not elastic_flags.is_elastic(parse(["-np", "2", "t"]))
