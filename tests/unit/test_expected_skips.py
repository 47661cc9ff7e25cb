"""Which rank-side skips the matrix drivers accept, judged from fake device lists.

tests/mpirun.py fails a job on any skip its machine should not have; on a GPU machine
that judgement is the difference between the GPU checks passing and hiding a test that
did not run. The NCCL reason comes from transport/nccl.py's own decide_nccl.
"""
import pytest

from mpirun import Machine, gpu_count, unexpected_skips

from horolite.transport.nccl import decide_nccl

H200 = "GPU 0: NVIDIA H200 (UUID: GPU-4a3c1e2b-0000-1111-2222-333344445555)"
H100 = "GPU {}: NVIDIA H100 80GB HBM3 (UUID: GPU-9f{}00000-0000-1111-2222-333344445555)"
SWITCH = {"HOROLITE_TEST_NCCL_SHARED_GPU": "1"}


def shared_reason(np_):
    ok, why = decide_nccl([(True, "NCCL 2.28.9 with 1 CUDA device(s)", "vm", "0000:19:00.0")] * np_)
    assert not ok
    return why


ONE_GPU_NP1 = ["needs two visible GPUs", "needs at least two ranks",
               "TensorFlow is not installed here (a GPU build needs CUDA 12 libraries): ..."]
NO_GPU = ["no CUDA device: no driver (libcuda.so.1 not found)",
          "no NCCL transport here: no CUDA device: no driver (libcuda.so.1 not found)"]


def judge(reasons, np_, machine, env=None):
    return [why for _, why in unexpected_skips([("t", r) for r in reasons], np_, env or {}, machine)]


def test_gpu_count_from_nvidia_smi_and_dev_lists():
    assert gpu_count([H200]) == 1
    assert gpu_count([H100.format(i, i) for i in range(8)] + ["  MIG 1g.10gb Device 0: (UUID: x)"]) == 8
    assert gpu_count(["/dev/nvidia0", "/dev/nvidia1"]) == 2
    assert gpu_count([]) == 0
    eight = [H100.format(i, i) for i in range(8)]
    assert gpu_count(eight, "3") == 1 and gpu_count(eight, "0,5") == 2
    assert gpu_count(eight, "") == 0 and gpu_count(eight, "-1") == 0
    assert gpu_count(eight, "1,9,2") == 1  # CUDA stops at the first ordinal it cannot use
    assert gpu_count([H200], "GPU-4a3c1e2b") == 1


def test_one_gpu_one_rank_accepts_only_its_own_skips():
    one = Machine(gpu_count([H200]), tensorflow=False, cupy=True)
    assert judge(ONE_GPU_NP1, 1, one) == []
    # A GPU case skipped for want of a GPU, CuPy or NCCL hides a test on this machine.
    assert judge(NO_GPU + ["cupy not importable here: x", "TensorFlow sees no GPU (a CPU build?)"],
                 1, one) == NO_GPU + ["cupy not importable here: x", "TensorFlow sees no GPU (a CPU build?)"]
    with_tf = Machine(1, tensorflow=True, cupy=True)
    assert judge(ONE_GPU_NP1, 1, with_tf) == [ONE_GPU_NP1[2]]


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_ranks_sharing_one_gpu(np_):
    one = Machine(1, tensorflow=False, cupy=True)
    share = [shared_reason(np_), f"no NCCL transport here: {shared_reason(np_)}"]
    assert judge(share + ONE_GPU_NP1[:1], np_, one) == []  # as users run it: NCCL is off
    assert judge(share, np_, one, SWITCH) == share  # with the test switch NCCL must be up
    assert judge(ONE_GPU_NP1[1:2], np_, one) == ONE_GPU_NP1[1:2]  # np >= 2 has two ranks


def test_several_gpus():
    two = Machine(2, tensorflow=False, cupy=True)
    assert judge(["needs two visible GPUs"], 1, two) == ["needs two visible GPUs"]
    assert judge([shared_reason(2)], 2, two) == [shared_reason(2)]  # a GPU per rank
    assert judge([shared_reason(3)], 3, two) == []


def test_no_gpu_accepts_every_gpu_skip():
    none = Machine(gpu_count([]), tensorflow=False, cupy=False)
    reasons = NO_GPU + ["needs two visible GPUs", "cupy not importable here: no module",
                        "no CUDA device: cupy not installed"]
    assert judge(reasons, 1, none) == []
    assert judge(["something else"], 1, none) == ["something else"]


NATIVE_OFF = "HOROLITE_TF_NATIVE_OPS=0 in this run"


@pytest.mark.parametrize("value", ["0", "false", "off", " No "])
def test_the_native_op_skip_is_expected_only_where_the_driver_turned_it_off(value):
    cpu = Machine(0, tensorflow=True, cupy=False)
    assert judge([NATIVE_OFF], 2, cpu, {"HOROLITE_TF_NATIVE_OPS": value}) == []
    # the default run, or the op asked for: the file's tests were hidden
    assert judge([NATIVE_OFF], 2, cpu) == [NATIVE_OFF]
    assert judge([NATIVE_OFF], 2, cpu, {"HOROLITE_TF_NATIVE_OPS": "1"}) == [NATIVE_OFF]


def test_run_at_some_sizes_only_is_expected_at_the_other_sizes_only():
    cpu = Machine(0, tensorflow=True, cupy=False)
    for sizes, np_, expected in [((2, 3), 1, True), ((2, 3), 2, False), ((2, 3), 3, False),
                                 ((2, 3), 4, True), ((3,), 3, False), ((3,), 2, True)]:
        why = f"run at np {sizes} only (suite time)"
        assert (judge([why], np_, cpu) == []) == expected, (sizes, np_)


def test_not_a_member_is_expected_only_where_a_member_ran_the_test():
    cpu = Machine(0, tensorflow=False, cupy=False)
    skips = [("t::a", "not a member"), ("t::b", "not a member")]
    assert unexpected_skips(skips, 3, {}, cpu, passed={"t::a", "t::b", "t::c"}) == []
    assert unexpected_skips(skips, 3, {}, cpu, passed={"t::a"}) == [
        ("t::b", "not a member (and no rank ran it)")]
    # other skips expected on every rank need nobody to have run the test
    assert unexpected_skips([("t::c", "needs at least two ranks")], 1, {}, cpu, passed=set()) == []
    # and an expected skip stays unexpected where its condition does not hold
    assert unexpected_skips([("t::c", "needs at least two ranks")], 2, {}, cpu,
                            passed={"t::c"}) == [("t::c", "needs at least two ranks")]
