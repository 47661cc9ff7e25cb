"""TensorFlow training across simulated hosts equals one process on the whole batch.

Reuses the rank side of tests/tensorflow/test_tf_training.py (the tape, the
legacy optimizer and Keras fit, each against a NumPy reference) on an uneven
layout: one rank on hl-a, two on hl-b.
"""
import importlib.util
import os

import pytest

from jobs import ROOT, run_pytest_across

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                                reason="TensorFlow is not installed")

TRAINING = os.path.join(ROOT, "tests", "tensorflow", "test_tf_training.py")


def test_training_across_hosts_equals_one_process(bed):
    run_pytest_across(bed, "hl-a:1,hl-b:2", TRAINING, timeout=400, pytest_args=[
        "-k", "tape_data_parallel_equivalence or legacy_optimizer_graph_equivalence "
              "or keras_fit_equivalence"])


BUCKETS = os.path.join(ROOT, "tests", "tensorflow", "test_tf_buckets.py")


# (2 hosts x 1 rank: buckets over real links; hosts of two ranks each, where shared memory
# and the hierarchical path carry them, run on pretend hosts 2+2 in test_matrix_tensorflow)
@pytest.mark.parametrize("hosts", ["hl-a:1,hl-b:1"])
def test_gradient_buckets_across_hosts(bed, hosts):
    # Ranks on two hosts: buckets by default, each against NumPy, the overlap from the timeline.
    run_pytest_across(bed, hosts, BUCKETS, timeout=400,
                      env={"HOROLITE_TEST_EXPECT_BUCKETS": "1", "HOROLITE_TEST_EXPECT_LANE": "1",
                           "TF_CPP_MIN_LOG_LEVEL": "3"})
