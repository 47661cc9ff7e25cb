"""layout.py: ranks by machine, Horovod's local and cross numbers, the settings passed on."""
import pytest

pytest.importorskip("ray")

from horolite.ray.layout import NodeInfo, forwarded_settings, place  # noqa: E402

KEY = bytes(range(32))


def nodes(*machines):
    return [NodeInfo(f"{m}{i:040x}", f"198.18.0.{ord(m[-1]) % 50}", m, 1000 + i)
            for i, m in enumerate(machines)]


def test_each_machines_workers_get_consecutive_ranks():
    placed = place(nodes("b", "a", "b", "a", "c"), ("198.18.0.1", 5000), KEY, 30.0)
    assert [p.worker for p in placed] == [0, 2, 1, 3, 4]  # b's first (met first), then a, c
    assert [p.rank for p in placed] == [0, 1, 2, 3, 4]
    env = [p.env for p in placed]
    assert [e["HOROLITE_LOCAL_RANK"] for e in env] == ["0", "1", "0", "1", "0"]
    assert [e["HOROLITE_LOCAL_SIZE"] for e in env] == ["2", "2", "2", "2", "1"]
    assert [e["HOROVOD_CROSS_RANK"] for e in env] == ["0", "0", "1", "1", "2"]
    assert [e["HOROVOD_CROSS_SIZE"] for e in env] == ["3", "2", "3", "2", "3"]
    assert {e["HOROLITE_RENDEZVOUS_PORT"] for e in env} == {"5000"}
    assert {e["HOROLITE_JOB_KEY"] for e in env} == {KEY.hex()}
    assert env[0]["HOROLITE_HOSTNAME"] == "198.18.0.48 node b0000000"  # ip, node id


def test_ray_train_keeps_its_own_world_ranks():
    placed = place(nodes("b", "a", "b"), ("h", 1), KEY, 30.0, keep_order=True)
    assert [(p.worker, p.rank) for p in placed] == [(0, 0), (1, 1), (2, 2)]
    assert [p.env["HOROLITE_LOCAL_RANK"] for p in placed] == ["0", "0", "1"]


def test_settings_pass_on_but_not_an_identity():
    env = {"HOROLITE_FUSION_THRESHOLD": "1", "HOROVOD_CYCLE_TIME": "2", "HOROLITE_RANK": "3",
           "HOROVOD_GLOO_RENDEZVOUS_PORT": "4", "HOROLITE_JOB_KEY": "ab", "PATH": "/bin"}
    assert forwarded_settings(env) == {"HOROLITE_FUSION_THRESHOLD": "1",
                                       "HOROVOD_CYCLE_TIME": "2"}
