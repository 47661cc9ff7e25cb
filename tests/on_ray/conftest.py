"""One real Ray cluster (two nodes) for the tests of this folder, and the driver connected
to it: started by the first test that asks, stopped after the last test here, so the rest
of the suite runs without Ray's processes (and with no connected driver that a lost
cluster would end)."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from ray_cluster import RayCluster, RayClusterFailed  # noqa: E402

_cluster = None


@pytest.fixture
def ray_cluster():
    global _cluster
    # Ray comes with the test extra: missing, or a cluster that does not start, fails.
    try:
        import ray
    except ImportError:
        pytest.fail('Ray is not installed: pip install -e ".[test]" (or "horolite[ray]")',
                    pytrace=False)
    if _cluster is None:
        cluster = RayCluster()
        try:
            cluster.start()
            ray.init(address=cluster.address, log_to_driver=True)
            cluster.wait_for_nodes(ray)
        except (RayClusterFailed, ConnectionError) as e:
            ray.shutdown()
            cluster.close()
            pytest.fail(f"the local Ray cluster did not start: {e}", pytrace=False)
        _cluster = cluster
    return _cluster


def pytest_runtest_teardown(item, nextitem):
    global _cluster
    if _cluster is not None and (nextitem is None or
                                 not str(nextitem.path).startswith(HERE + os.sep)):
        import ray
        ray.shutdown()
        _cluster.close()
        _cluster = None
