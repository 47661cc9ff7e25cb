"""HOROLITE_TEST_HOST_IDENTITY (horolite/core/hosts.py): the pretend hosts' layout is
read as written, and a wrong one is refused naming the variable (a one-rank job)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CODE = ("from horolite.core import hosts\nfrom mpi4py import MPI\n"
        "print(hosts.pretend_layout(), hosts.host_name() == MPI.Get_processor_name())\n"
        "c = hosts.split_by_host(MPI.COMM_WORLD)\nprint(c.Get_size())")


def run(value):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("HOROLITE_TEST_HOST_IDENTITY", None)
    if value is not None:
        env["HOROLITE_TEST_HOST_IDENTITY"] = value
    return subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.parametrize("value, first", [(None, "None True"), ("", "None True"),
                                          ("1", "[1] False")])
def test_layouts(value, first):
    proc = run(value)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == [first, "1"]


@pytest.mark.parametrize("value, says", [("2", "places 2 ranks, but the job has 1"),
                                         ("0+1", "must be host sizes"), ("a", "must be host sizes"),
                                         ("1+", "must be host sizes")])
def test_wrong_layouts_are_refused_naming_the_variable(value, says):
    proc = run(value)
    assert proc.returncode != 0
    assert f"HOROLITE_TEST_HOST_IDENTITY={value!r}" in proc.stderr and says in proc.stderr, proc.stderr


def test_pretend_host_of_each_rank():
    from horolite.core.hosts import pretend_host
    assert [pretend_host(r, [2, 1, 1]) for r in range(4)] == [0, 0, 1, 2]
    assert [pretend_host(r, [1, 3]) for r in range(4)] == [0, 1, 1, 1]
    with pytest.raises(ValueError, match="job rank 4 is outside"):
        pretend_host(4, [2, 2])
