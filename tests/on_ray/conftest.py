"""One real Ray cluster (two nodes) per session, and the driver connected to it."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ray_cluster import RayCluster, RayClusterFailed  # noqa: E402


@pytest.fixture(scope="session")
def ray_cluster():
    # Ray comes with the test extra: missing, or a cluster that does not start, fails.
    try:
        import ray
    except ImportError:
        pytest.fail('Ray is not installed: pip install -e ".[test]" (or "horolite[ray]")',
                    pytrace=False)
    cluster = RayCluster()
    try:
        cluster.start()
        ray.init(address=cluster.address, log_to_driver=True)
        cluster.wait_for_nodes(ray)
    except RayClusterFailed as e:
        cluster.close()
        pytest.fail(f"the local Ray cluster did not start: {e}", pytrace=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.close()
