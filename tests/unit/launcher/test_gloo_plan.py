"""horolite-run --gloo's pure parts: flags -> config, where each rank goes, its environment,
the plan rank_spawn.py runs (the key on no argv), and the two wrappers' new duties."""
import json
import os
import shlex
import signal
import subprocess
import sys

import pytest

from test_launcher_cli import REPO, config, lmain, _import_launcher  # noqa: F401

import importlib

gloo = importlib.import_module("horolite.launcher.gloo")
_import_launcher()
KEY = bytes(range(32))
RANKWRAP = os.path.join(REPO, "launcher", "rankwrap.py")
RANK_SPAWN = os.path.join(REPO, "launcher", "rank_spawn.py")


# --- flags -> config ---

def test_gloo_flags_and_their_defaults(tmp_path):
    c = config(["--gloo", "-np", "2", "t"])
    assert c.gloo and c.gloo_timeout == 30.0
    assert config(["--gloo", "--gloo-timeout-seconds", "5", "-np", "2", "t"]).gloo_timeout == 5.0
    assert not config(["-np", "2", "t"]).gloo
    f = tmp_path / "h.yaml"
    f.write_text("controller: gloo\nlibrary_options: {gloo_timeout_seconds: 7}\n")
    args = lmain.parse_args(["-np", "2", "--config-file", str(f), "t"])
    c = lmain.config_from_args(args, {})
    assert c.gloo and c.gloo_timeout == 7.0


@pytest.mark.parametrize("argv, message", [
    (["--gloo", "--mpi"], "--gloo and --mpi ask for two ways"),
    (["--gloo", "--mpi-args=-v"], "--mpi-args is for mpirun"),
    (["--gloo", "--binding-args=--bind-to core"], "--binding-args is for mpirun"),
])
def test_what_gloo_cannot_honour_is_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        config(argv + ["-np", "2", "t"])


@pytest.mark.parametrize("argv,message", [
    (["--min-np", "3"], "--min-np 3 is more than -np 2"),
    (["--min-np", "1", "--max-np", "1"], "--max-np 1 is less than -np 2"),
])
def test_gloo_elastic_flags_it_cannot_honour_are_refused(capsys, argv, message):
    assert lmain.main(["--gloo", "-np", "2", *argv, "t"]) == 2
    assert message in capsys.readouterr().err


def test_zero_timeout_is_refused(capsys):
    with pytest.raises(SystemExit):
        lmain.parse_args(["--gloo", "--gloo-timeout-seconds", "0", "t"])
    assert "must be above 0" in capsys.readouterr().err


# --- where each rank goes ---

def test_ranks_fill_each_hosts_slots_in_order():
    slots = gloo.layout((("h1", 2), ("h2", 2)), 4)
    assert [(s.rank, s.host, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
            for s in slots] == [(0, "h1", 0, 2, 0, 2), (1, "h1", 1, 2, 0, 2),
                                (2, "h2", 0, 2, 1, 2), (3, "h2", 1, 2, 1, 2)]


def test_uneven_hosts_cross_counts_as_horovod():
    # local rank 1 and 2 exist on h1 only: a cross group of one
    slots = gloo.layout((("h1", 3), ("h2", 1)), 4)
    assert [(s.host, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        ("h1", 0, 3, 0, 2), ("h1", 1, 3, 0, 1), ("h1", 2, 3, 0, 1), ("h2", 0, 1, 1, 2)]
    assert [s.host for s in gloo.layout((("h1", 2), ("h2", 2)), 3)] == ["h1", "h1", "h2"]


def test_no_hosts_is_this_host_only():
    slots = gloo.layout((), 3)
    assert {s.host for s in slots} == {"localhost"}
    assert [(s.local_rank, s.local_size, s.cross_size) for s in slots] == [(0, 3, 1), (1, 3, 1),
                                                                           (2, 3, 1)]


# --- the rendezvous address ---

def test_all_local_hosts_use_loopback():
    assert gloo.rendezvous_addresses(["localhost"]) == ("127.0.0.1", {"localhost": "127.0.0.1"})


def test_remote_hosts_get_the_source_address_of_their_route():
    routes = {"h2": "10.0.0.1", "h3": "192.168.1.1"}
    bind, found = gloo.rendezvous_addresses(["localhost", "h2", "h3"], route=routes.__getitem__)
    assert bind == "0.0.0.0"
    assert found == {"localhost": "10.0.0.1", "h2": "10.0.0.1", "h3": "192.168.1.1"}
    bind, found = gloo.rendezvous_addresses(["h2", "h3"], "eth1,eth2",
                                            nic_address={"eth1": "172.16.0.5"}.__getitem__)
    assert found == {"h2": "172.16.0.5", "h3": "172.16.0.5"}


def test_a_host_without_a_route_is_named():
    with pytest.raises(ValueError, match="no route from this machine to host 'no-such.invalid'"):
        gloo.rendezvous_addresses(["no-such.invalid"])


# --- each rank's environment and the plan ---

def test_rank_env_has_horolites_and_horovods_names():
    slot = gloo.RankSlot(3, "h2", 1, 2, 1, 2)
    env = gloo.rank_env(slot, 4, "10.0.0.1", 4242, 20.0, KEY)
    assert env == {
        "HOROLITE_RANK": "3", "HOROLITE_SIZE": "4", "HOROLITE_LOCAL_RANK": "1",
        "HOROLITE_LOCAL_SIZE": "2", "HOROLITE_CROSS_RANK": "1", "HOROLITE_CROSS_SIZE": "2",
        "HOROLITE_HOSTNAME": "h2", "HOROLITE_RENDEZVOUS_ADDR": "10.0.0.1",
        "HOROLITE_RENDEZVOUS_PORT": "4242", "HOROLITE_GLOO_TIMEOUT_SECONDS": "20",
        "HOROLITE_JOB_KEY": KEY.hex(),
        "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
        "HOROVOD_HOSTNAME": "h2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "4242", "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo"}


def test_the_plan_starts_local_ranks_directly_and_remote_ones_over_ssh():
    environ = {"PATH": "/bin:/usr/bin", "PASSED": "yes", "OMP_NUM_THREADS": "2",
               "HOSTNAME": "launcher", "OLDPWD": "/old", "BASH_FUNC_f%%": "() { :; }"}
    c = lmain.config_from_args(lmain.get_args_parser().parse_args(
        ["--gloo", "-np", "3", "-H", "localhost:2,h2:1", "-p", "2222", "-x", "PASSED",
         "-x", "SET=a b", "--output-filename", "/tmp/out", "python", "t.py", "--lr", "1"]),
        environ)
    slots = gloo.layout(c.hosts, c.num_proc)
    plan = gloo.build_plan(c, slots, {"localhost": "10.0.0.1", "h2": "10.0.0.1"}, 4242, KEY,
                           environ, "/work", python="/py")
    local, remote = plan["ranks"][0], plan["ranks"][2]
    assert plan["cwd"] == "/work"
    assert local["argv"] == ["/py", gloo.RANK_SPAWN.replace("rank_spawn.py", "rankwrap.py"),
                             "--output-dir", "/tmp/out", "--", "python", "t.py", "--lr", "1"]
    assert not local["remote"] and remote["remote"] and remote["host"] == "h2"
    assert remote["argv"][:5] == ["ssh", "-o", "BatchMode=yes", "-p", "2222"]
    assert remote["argv"][5] == "h2"
    inner = shlex.split(remote["argv"][6])
    assert inner[0] == "exec" and inner[-6:] == ["--env-stdin", "--", "python", "t.py", "--lr", "1"]
    for rank in plan["ranks"]:
        assert KEY.hex() not in " ".join(rank["argv"])  # never on a command line
        assert rank["env"]["HOROLITE_JOB_KEY"] == KEY.hex()
        assert rank["env"]["PASSED"] == "yes" and rank["env"]["SET"] == "a b"
        assert rank["env"]["PATH"] == "/bin:/usr/bin"
    # A remote rank gets the launcher's whole environment (a local one inherits it), but
    # for what names the launching host or shell, as horovodrun --gloo does.
    assert remote["env"]["OMP_NUM_THREADS"] == "2" and "OMP_NUM_THREADS" not in local["env"]
    assert not {"HOSTNAME", "OLDPWD", "BASH_FUNC_f%%"} & set(remote["env"])


# --- the wrappers ---

def test_rankwrap_takes_its_environment_from_stdin_and_a_signal_after_it(tmp_path):
    line = json.dumps({"env": {"HOROLITE_RANK": "2", "HOROLITE_SIZE": "3", "SECRET": "s3"},
                       "cwd": str(tmp_path)})
    proc = subprocess.Popen(
        [sys.executable, RANKWRAP, "--env-stdin", "--", "sh", "-c",
         "echo $SECRET $(pwd); exec sleep 30"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(line.encode() + b"\n")
    proc.stdin.flush()
    first = proc.stdout.readline()
    assert first == f"[2]<stdout>:s3 {tmp_path}\n".encode()
    proc.stdin.write(b"SIGTERM\n")
    proc.stdin.flush()
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM
    assert b"##horolite-run## exit rank=2 size=3" in err and b"stopped=1" in err


def test_rankwrap_ends_its_rank_when_stdin_ends():
    proc = subprocess.Popen([sys.executable, RANKWRAP, "--env-stdin", "--", "sleep", "30"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(b'{"env": {}, "cwd": "/"}\n')
    proc.stdin.close()  # horolite-run (or its ssh) gone
    proc.wait(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM and b"stopped=1" in proc.stderr.read()


def test_spawn_reports_a_wrapper_that_died_without_its_report():
    # No wrapper here: the "wrapper" itself is killed, so rank_spawn.py writes its report.
    plan = {"cwd": "/", "ranks": [
        {"rank": 0, "host": "localhost", "remote": False, "env": {"MINE": "0"},
         "argv": ["sh", "-c", "echo out $MINE; kill -9 $$"]},
        {"rank": 1, "host": "localhost", "remote": False, "env": {}, "argv": ["true"]}]}
    r = subprocess.run([sys.executable, RANK_SPAWN, "--ssh-args", ""], capture_output=True,
                       input=json.dumps(plan).encode(), timeout=30)
    assert r.returncode == 128 + signal.SIGKILL
    assert r.stdout == b"out 0\n"
    err = r.stderr.decode()
    assert "the wrapper on localhost for rank 0 was killed by signal 9" in err
    assert "##horolite-run## exit rank=0 size=2 host=localhost code=137 signal=9 stopped=0" in err
    assert "##horolite-run## exit rank=1 size=2 host=localhost code=0 signal=0" in err
