"""horolite-run's command line: flags -> LaunchConfig -> the mpirun argv for each MPI."""
import dataclasses
import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _import_launcher():
    """horolite.launcher, installed or (in a bare checkout) mapped from launcher/."""
    try:
        import horolite.launcher  # noqa: F401
    except ImportError:
        if REPO not in sys.path:
            sys.path.insert(0, REPO)
        import horolite
        if REPO not in horolite.__path__:
            horolite.__path__.append(REPO)  # horolite.launcher -> <repo>/launcher
    import importlib
    return tuple(importlib.import_module(f"horolite.launcher.{name}") for name in
                 ("check_build", "hosts", "main", "mpi", "rankwrap", "supervise"))


check_build, hosts, lmain, mpi, rankwrap, supervise = _import_launcher()
WRAP = ("python", "rankwrap.py", "--")


def config(argv, environ=None):
    environ = {} if environ is None else environ
    return lmain.config_from_args(lmain.get_args_parser(environ).parse_args(argv), environ)


def command(argv, impl, environ=None, as_root=False):
    return mpi.build_mpirun_command(config(argv, environ), impl, "mpirun", as_root=as_root,
                                    wrapper=WRAP)


# --- flags -> config ---

def test_minimal_config():
    c = config(["-np", "4", "python", "train.py", "--lr", "0.1"])
    assert c.num_proc == 4 and c.hosts == () and c.env == ()
    assert c.command == ("python", "train.py", "--lr", "0.1")
    assert c.start_timeout == 30.0 and not c.verbose


def test_config_is_frozen():
    c = config(["-np", "1", "true"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_proc = 2


def test_tunables_become_horolite_variables():
    c = config(["-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
                "--cache-capacity", "0", "--timeline-filename", "/tmp/t.json",
                "--timeline-mark-cycles", "--no-stall-check",
                "--stall-check-warning-time-seconds", "30",
                "--stall-check-shutdown-time-seconds", "120", "--log-level", "debug",
                "--autotune", "--autotune-log-file", "/tmp/a.csv", "python", "x.py"])
    assert dict(c.env) == {
        "HOROLITE_FUSION_THRESHOLD": "33554432",
        "HOROLITE_CYCLE_TIME": "2.5",
        "HOROLITE_CACHE_CAPACITY": "0",
        "HOROLITE_TIMELINE": "/tmp/t.json",
        "HOROLITE_TIMELINE_MARK_CYCLES": "1",
        "HOROLITE_STALL_CHECK_DISABLE": "1",
        "HOROLITE_STALL_CHECK_TIME_SECONDS": "30",
        "HOROLITE_STALL_SHUTDOWN_TIME_SECONDS": "120",
        "HOROLITE_LOG_LEVEL": "DEBUG",
        "HOROLITE_AUTOTUNE": "1",
        "HOROLITE_AUTOTUNE_LOG": "/tmp/a.csv",
    }


# horovodrun 0.28.1's flags for rank settings and the variables they set, written out here
# (not read from horolite's settings table, which the parser is made from): a wrong name
# or a wrong variable in that table fails this test. Horolite's own additions are marked.
SETTING_FLAGS = {
    "--cycle-time-ms": ("HOROLITE_CYCLE_TIME", "3", "3"),
    "--fusion-threshold-mb": ("HOROLITE_FUSION_THRESHOLD", "3", str(3 * 1024 * 1024)),
    "--cache-capacity": ("HOROLITE_CACHE_CAPACITY", "3", "3"),
    "--hierarchical-allreduce": ("HOROLITE_HIERARCHICAL_ALLREDUCE", None, "1"),
    "--no-hierarchical-allreduce": ("HOROLITE_HIERARCHICAL_ALLREDUCE", None, "0"),
    "--hierarchical-allgather": ("HOROLITE_HIERARCHICAL_ALLGATHER", None, "1"),
    "--no-hierarchical-allgather": ("HOROLITE_HIERARCHICAL_ALLGATHER", None, "0"),
    "--no-stall-check": ("HOROLITE_STALL_CHECK_DISABLE", None, "1"),
    "--stall-check-warning-time-seconds": ("HOROLITE_STALL_CHECK_TIME_SECONDS", "3", "3"),
    "--stall-check-shutdown-time-seconds": ("HOROLITE_STALL_SHUTDOWN_TIME_SECONDS", "3", "3"),
    "--straggler-report-seconds": ("HOROLITE_STRAGGLER_REPORT_SECONDS", "10", "10"),
    "--timeline-filename": ("HOROLITE_TIMELINE", "/tmp/t.json", "/tmp/t.json"),
    "--timeline-mark-cycles": ("HOROLITE_TIMELINE_MARK_CYCLES", None, "1"),
    "--log-level": ("HOROLITE_LOG_LEVEL", "warning", "WARNING"),
    "--log-without-timestamp": ("HOROLITE_LOG_HIDE_TIME", None, "1"),
    "--mpi-threads-disable": ("HOROLITE_MPI_THREADS_DISABLE", None, "1"),
    "--autotune": ("HOROLITE_AUTOTUNE", None, "1"),
    "--autotune-log-file": ("HOROLITE_AUTOTUNE_LOG", "/tmp/a.csv", "/tmp/a.csv"),
    # horolite's own
    "--stall-check": ("HOROLITE_STALL_CHECK_DISABLE", None, "0"),
    "--no-timeline-mark-cycles": ("HOROLITE_TIMELINE_MARK_CYCLES", None, "0"),
    "--log-with-timestamp": ("HOROLITE_LOG_HIDE_TIME", None, "0"),
    "--no-mpi-threads-disable": ("HOROLITE_MPI_THREADS_DISABLE", None, "0"),
    "--no-autotune": ("HOROLITE_AUTOTUNE", None, "0"),
    "--wait-mode": ("HOROLITE_WAIT_MODE", "poll", "poll"),
    "--no-shared-memory": ("HOROLITE_SHARED_MEMORY", None, "0"),
    "--autotune-start": ("HOROLITE_AUTOTUNE_START", "4,1.5", "4,1.5"),
    "--cross-host-transport": ("HOROLITE_CROSS_HOST_TRANSPORT", "TCP", "tcp"),
}


@pytest.mark.parametrize("flag", sorted(SETTING_FLAGS))
def test_each_setting_flag_sets_its_variable(flag):
    variable, value, expect = SETTING_FLAGS[flag]
    argv = ["-np", "1", flag] + ([value] if value is not None else []) + ["t"]
    assert dict(config(argv).env) == {variable: expect}


def test_the_declared_setting_flags_are_the_listed_ones():
    # A flag added to the settings table must be added above, with its variable.
    from horolite.core import settings
    declared = {f for s in settings.SETTINGS if s.scope == "rank" for f in (s.flag, s.flag_false) if f}
    assert declared == set(SETTING_FLAGS)


def test_hierarchical_flags():
    assert dict(config(["-np", "2", "--hierarchical-allreduce", "--no-hierarchical-allgather",
                        "t"]).env) == {"HOROLITE_HIERARCHICAL_ALLREDUCE": "1",
                                       "HOROLITE_HIERARCHICAL_ALLGATHER": "0"}
    with pytest.raises(SystemExit):
        lmain.get_args_parser().parse_args(["--hierarchical-allreduce",
                                            "--no-hierarchical-allreduce", "t"])


def test_unhonoured_horovod_flags_pass_their_variable_on():
    c = config(["-np", "2", "--torus-allreduce", "--num-nccl-streams", "2",
                "--autotune-warmup-samples", "3", "--autotune-gaussian-process-noise", "0.5", "t"])
    assert dict(c.env) == {"HOROVOD_TORUS_ALLREDUCE": "1", "HOROVOD_NUM_NCCL_STREAMS": "2",
                           "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "3",
                           "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5"}


# Every option string of horovodrun 0.28.1 (horovod/runner/launch.py, parse_args).
HOROVODRUN_FLAGS = """-v --version -np --num-proc -cb --check-build --disable-cache --start-timeout
--network-interfaces --network-interface --output-filename --verbose --config-file -p --ssh-port -i
--ssh-identity-file --fusion-threshold-mb --cycle-time-ms --cache-capacity --hierarchical-allreduce
--no-hierarchical-allreduce --hierarchical-allgather --no-hierarchical-allgather --torus-allreduce
--no-torus-allreduce --autotune --no-autotune --autotune-log-file --autotune-warmup-samples
--autotune-steps-per-sample --autotune-bayes-opt-max-samples --autotune-gaussian-process-noise
--min-np --min-num-proc --max-np --max-num-proc --slots-per-host --elastic-timeout --reset-limit
--blacklist-cooldown-range --timeline-filename --timeline-mark-cycles --no-timeline-mark-cycles
--no-stall-check --stall-check --stall-check-warning-time-seconds
--stall-check-shutdown-time-seconds --mpi-threads-disable --no-mpi-threads-disable --mpi-args --tcp
--binding-args --num-nccl-streams --thread-affinity --gloo-timeout-seconds --log-level
--log-with-timestamp --log-without-timestamp -prefix-timestamp --prefix-output-with-timestamp
--log-hide-timestamp --no-log-hide-timestamp -H --hosts -hostfile --hostfile
--host-discovery-script --gloo --mpi --jsrun""".split()
REFUSED = {"--jsrun"}


def test_every_horovodrun_flag_exists():
    known = set(lmain.get_args_parser()._option_string_actions)
    assert not set(HOROVODRUN_FLAGS) - known


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_flags_that_cannot_work_over_mpi_fail_at_once(flag, capsys):
    action = lmain.get_args_parser()._option_string_actions[flag]
    argv = ["-np", "2", flag] + ["1"] * (action.nargs or 0) + ["true"]
    with pytest.raises(SystemExit) as e:
        lmain.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} is not supported: horolite launches through mpirun or by itself" in err


def test_no_abbreviations(capsys):
    # --mpi is horovodrun's controller flag, not an abbreviation of --mpi-args.
    c = config(["-np", "2", "--mpi", "python", "t.py"])
    assert c.command == ("python", "t.py") and c.mpi_args == ()
    with pytest.raises(SystemExit):
        lmain.get_args_parser().parse_args(["-np", "2", "--fusion", "3", "t"])


def test_v_is_version_and_verbose_is_long_only(capsys):
    with pytest.raises(SystemExit) as e:
        lmain.main(["-v"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("horolite-run ")
    assert config(["-np", "1", "--verbose", "t"]).verbose


def test_ssh_port_and_identity(tmp_path):
    argv = ["-np", "2", "-H", "a:1,b:1", "-p", "2222", "-i", "~/key", "t"]
    key = os.path.expanduser("~/key")
    mpich = command(argv, mpi.MPICH)
    assert mpich[:3] == ["env", f"HYDRA_LAUNCHER_EXTRA_ARGS=-p 2222 -i {key}", "mpirun"]
    i = mpich.index("-launcher")
    assert mpich[i + 1] == "ssh" and i < mpich.index("rankwrap.py")
    ompi = command(argv, mpi.OPENMPI)
    i = ompi.index("plm_ssh_args")
    assert ompi[i - 1:i + 2] == ["--mca", "plm_ssh_args", f"-p 2222 -i {key}"]
    assert command(["-np", "2", "t"], mpi.MPICH)[0] == "mpirun"


def test_binding_tcp_timestamp_and_interfaces():
    argv = ["-np", "2", "--binding-args=--bind-to core", "--tcp", "-prefix-timestamp",
            "--network-interface", "eth0", "--network-interface", "eth1", "--disable-cache", "t"]
    c = config(argv)
    # horolite's own TCP connections between hosts use the first interface (HOROLITE_TCP_IFACE)
    assert dict(c.env) == {"NCCL_IB_DISABLE": "1", "HOROLITE_TCP_IFACE": "eth0"}
    assert c.network_interface == "eth0,eth1"
    cmd = command(argv, mpi.OPENMPI)
    assert cmd[cmd.index("--bind-to"):cmd.index("--bind-to") + 2] == ["--bind-to", "core"]
    assert "--timestamp" in lmain.wrapper_argv(c)


def test_config_file_uses_horovodrun_keys_and_the_command_line_wins(tmp_path):
    f = tmp_path / "horovod.yaml"
    f.write_text("""
controller: mpi
params: {fusion_threshold_mb: 32, cycle_time_ms: 5, cache_capacity: 0,
         hierarchical_allreduce: true, torus_allreduce: false}
autotune: {enabled: true, log_file: at.csv, warmup_samples: 4}
timeline: {filename: tl.json, mark_cycles: true}
stall_check: {enabled: false, warning_time_seconds: 7, shutdown_time_seconds: 9}
library_options: {mpi_threads_disable: true, num_nccl_streams: 2, thread_affinity: 1}
logging: {level: debug, with_timestamp: false}
""")
    args = lmain.parse_args(["-np", "2", "--config-file", str(f), "--cycle-time-ms", "2", "t"])
    env = dict(lmain.config_from_args(args, {}).env)
    assert env == {
        "HOROLITE_FUSION_THRESHOLD": str(32 << 20), "HOROLITE_CYCLE_TIME": "2",
        "HOROLITE_CACHE_CAPACITY": "0", "HOROLITE_HIERARCHICAL_ALLREDUCE": "1",
        "HOROVOD_TORUS_ALLREDUCE": "0", "HOROLITE_AUTOTUNE": "1",
        "HOROLITE_AUTOTUNE_LOG": os.path.abspath("at.csv"), "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "4",
        "HOROLITE_TIMELINE": os.path.abspath("tl.json"), "HOROLITE_TIMELINE_MARK_CYCLES": "1",
        "HOROLITE_STALL_CHECK_DISABLE": "1", "HOROLITE_STALL_CHECK_TIME_SECONDS": "7",
        "HOROLITE_STALL_SHUTDOWN_TIME_SECONDS": "9", "HOROLITE_MPI_THREADS_DISABLE": "1",
        "HOROVOD_NUM_NCCL_STREAMS": "2", "HOROVOD_THREAD_AFFINITY": "1",
        "HOROLITE_LOG_LEVEL": "DEBUG", "HOROLITE_LOG_HIDE_TIME": "1"}


@pytest.mark.parametrize("text, message", [
    ("controller: jsrun\n", "controller 'jsrun' is not supported"),
    ("params: {fusion_thresh: 3}\n", "unknown key params.fusion_thresh"),
    ("library_options: {gloo_timeout_seconds: 0}\n", "gloo_timeout_seconds=0: must be above 0"),
    ("params: {cycle_time_ms: -1}\n", "params.cycle_time_ms=-1"),
    ("logging: {level: LOUD}\n", "logging.level='LOUD'"),
    ("- a list\n", "expected a mapping"),
])
def test_bad_config_files(tmp_path, capsys, text, message):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(SystemExit):
        lmain.parse_args(["-np", "1", "--config-file", str(f), "t"])
    assert message in capsys.readouterr().err


def test_fractional_fusion_threshold_and_relative_timeline():
    c = config(["-np", "1", "--fusion-threshold-mb", "0.5", "--timeline-filename", "tl.json", "t"])
    env = dict(c.env)
    assert env["HOROLITE_FUSION_THRESHOLD"] == str(512 * 1024)
    assert env["HOROLITE_TIMELINE"] == os.path.abspath("tl.json")


def test_env_passthrough_and_values():
    c = config(["-np", "2", "-x", "FOO", "--env", "BAR=1=2", "-x", "EMPTY=", "t"],
               environ={"FOO": "f", "HOROVOD_CYCLE_TIME": "3", "HOROLITE_START_TIMEOUT": "9"})
    assert dict(c.env) == {"FOO": None, "BAR": "1=2", "EMPTY": "", "HOROVOD_CYCLE_TIME": None}
    assert c.start_timeout == 9.0


def test_flag_beats_environment_for_start_timeout():
    c = config(["-np", "1", "--start-timeout", "5", "t"], environ={"HOROLITE_START_TIMEOUT": "9"})
    assert c.start_timeout == 5.0


@pytest.mark.parametrize("argv, message", [
    (["-np", "2", "-x", "NOT_SET", "t"], "NOT_SET is not set"),
    (["-np", "2", "-x", "1BAD", "t"], "bad -x/--env"),
    (["-np", "2"], "no command given"),
    (["t"], "give the number of ranks"),
    (["-np", "5", "-H", "a:2,b:2", "t"], "more than the 4 slots"),
    (["-np", "2", "-H", "a:x", "t"], "bad slot count 'x'"),
    (["-np", "2", "-H", "a:0", "t"], "must be at least 1"),
    (["-np", "2", "-H", "a:2,,b:1", "t"], "empty entry"),
    (["-np", "2", "-H", "bad host:2", "t"], "bad host name"),
    (["-np", "2", "--mpi-args", "'unclosed", "t"], "bad --mpi-args"),
    (["-np", "2", "--hostfile", "/nonexistent/hosts", "t"], "cannot read --hostfile"),
])
def test_bad_flags(argv, message):
    with pytest.raises(ValueError, match=message):
        config(argv)


@pytest.mark.parametrize("argv", [["-np", "0", "t"], ["-np", "x", "t"],
                                  ["-np", "1", "--cycle-time-ms", "-1", "t"],
                                  ["-np", "1", "--log-level", "LOUD", "t"]])
def test_argparse_rejects(argv, capsys):
    with pytest.raises(SystemExit) as e:
        lmain.get_args_parser({}).parse_args(argv)
    assert e.value.code == 2


def test_hosts_default_np_from_slots_and_hostfile(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("# cluster\nnode1 slots=2\nnode2:3   # mpich style\n\nnode3\nnode1 slots=1\n")
    c = config(["--hostfile", str(hf), "t"])
    assert c.hosts == (("node1", 3), ("node2", 3), ("node3", 1)) and c.num_proc == 7


def test_hostfile_bad_line(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("node1 slots=2\nnode2 cpus=4\n")
    with pytest.raises(ValueError, match="line 2"):
        config(["--hostfile", str(hf), "t"])


def test_parse_hosts_forms():
    assert hosts.parse_hosts("a:2,b") == (("a", 2), ("b", 1))
    assert hosts.parse_hosts("10.0.0.1:4,[fe80::1]:2") == (("10.0.0.1", 4), ("fe80::1", 2))
    assert hosts.rank_hosts((("a", 2), ("b", 1)), 3) == ["a", "a", "b"]
    assert hosts.rank_hosts((), 2) == ["localhost", "localhost"]


def test_mpi_args_and_command_after_double_dash():
    c = config(["-np", "2", "--mpi-args=-verbose -genv A 'x y'", "--", "python", "-v"])
    assert c.mpi_args == ("-verbose", "-genv", "A", "x y")
    assert c.command == ("python", "-v")


# --- config -> mpirun argv ---

def test_mpich_command():
    argv = command(["-np", "4", "-H", "h1:2,h2:2", "--fusion-threshold-mb", "32", "-x", "FOO",
                    "--network-interface", "eth0", "--mpi-args=-verbose", "python", "t.py"],
                   mpi.MPICH, environ={"FOO": "1"})
    assert argv == ["mpirun", "-np", "4", "-hosts", "h1:2,h2:2",
                    "-genv", "HOROLITE_FUSION_THRESHOLD", "33554432",
                    "-genv", "HOROLITE_TCP_IFACE", "eth0", "-genvall",
                    "-iface", "eth0", "-verbose", *WRAP, "python", "t.py"]


def test_openmpi_command():
    argv = command(["-np", "4", "-H", "h1:2,h2:2", "--fusion-threshold-mb", "32", "-x", "FOO",
                    "--network-interface", "eth0", "--mpi-args=--display-map", "python", "t.py"],
                   mpi.OPENMPI, environ={"FOO": "1"}, as_root=True)
    assert argv == ["mpirun", "-np", "4", "--allow-run-as-root", "--oversubscribe",
                    "--host", "h1:2,h2:2", "--map-by", "slot",
                    "-x", "HOROLITE_FUSION_THRESHOLD=33554432", "-x", "HOROLITE_TCP_IFACE=eth0",
                    "-x", "FOO", "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0",
                    "--display-map", *WRAP, "python", "t.py"]


ENVIRON = {"PATH": "/venv/bin:/usr/bin", "VIRTUAL_ENV": "/venv", "PYTHONPATH": "/src",
           "LD_LIBRARY_PATH": "/lib64", "HOROVOD_CYCLE_TIME": "2", "FOO": "1", "BAR": "x"}


def test_mpich_never_narrows_the_environment():
    # -genvlist would give ranks on other hosts only the listed variables: no PATH.
    argv = command(["-np", "2", "-H", "h1,h2", "-x", "FOO", "-x", "BAR=y", "t"], mpi.MPICH,
                   environ=ENVIRON)
    assert "-genvlist" not in argv and "-genvnone" not in argv and "-genvall" in argv
    assert argv[argv.index("-genv") + 1:argv.index("-genv") + 3] == ["BAR", "y"]


def test_openmpi_names_what_remote_ranks_need():
    argv = command(["-np", "2", "-H", "h1,h2", "-x", "FOO", "-x", "BAR=y", "t"], mpi.OPENMPI,
                   environ=ENVIRON)
    passed = {argv[i + 1] for i, a in enumerate(argv) if a == "-x"}
    assert passed == {"PATH", "VIRTUAL_ENV", "PYTHONPATH", "LD_LIBRARY_PATH",
                      "HOROVOD_CYCLE_TIME", "FOO", "BAR=y"}


@pytest.mark.parametrize("impl", [mpi.MPICH, mpi.OPENMPI])
def test_minimal_commands_and_no_rejected_flags(impl):
    argv = command(["-np", "3", "python", "t.py"], impl)
    assert argv[:3] == ["mpirun", "-np", "3"] and argv[-5:] == [*WRAP, "python", "t.py"]
    # horovodrun's -bind-to none breaks Open MPI 5; we never pass binding flags.
    assert not any("bind" in a for a in argv)
    assert ("--allow-run-as-root" in argv) is False


def test_openmpi_root_only_when_root():
    assert "--allow-run-as-root" not in command(["-np", "1", "t"], mpi.OPENMPI, as_root=False)
    assert "--allow-run-as-root" in command(["-np", "1", "t"], mpi.OPENMPI, as_root=True)


def test_unknown_implementation():
    with pytest.raises(ValueError, match="unknown MPI"):
        command(["-np", "1", "t"], "lam")


def test_wrapper_gets_output_dir(tmp_path):
    c = config(["-np", "2", "--output-filename", str(tmp_path / "logs"), "t"])
    assert lmain.wrapper_argv(c, python="py") == ("py", lmain.RANKWRAP, "--hold", "10",
                                                   "--output-dir", str(tmp_path / "logs"), "--")


# --- MPI discovery ---

@pytest.mark.parametrize("text, impl", [
    ("HYDRA build details:\n    Version:   5.0.2\n", mpi.MPICH),
    ("mpirun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/", mpi.OPENMPI),
    ("prterun (PRRTE) 3.0.6", mpi.OPENMPI),
    ("something else", None),
])
def test_detect_implementation(text, impl):
    assert mpi.detect_implementation(text) == impl


def test_find_mpirun_prefers_interpreter_bin(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "mpirun"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    other = tmp_path / "other"
    other.mkdir()
    (other / "mpirun").write_text("#!/bin/sh\n")
    (other / "mpirun").chmod(0o755)
    found = mpi.find_mpirun({"PATH": str(other)}, executable=str(bindir / "python"))
    assert found == str(fake)
    assert mpi.find_mpirun({"PATH": str(other)}, executable="/nowhere/python") == str(other / "mpirun")
    assert mpi.find_mpirun({"PATH": str(tmp_path)}, executable="/nowhere/python") is None


def test_no_mpi_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HOROLITE_MPIRUN", "/nonexistent/mpirun")
    with pytest.raises(mpi.NoMPIError, match=re.escape('no MPI found (no mpirun): pip install "horolite[mpich]"')):
        mpi.find_mpi()


def test_main_errors_are_clear(monkeypatch, capsys):
    assert lmain.main(["-np", "2", "no-such-program-xyz"]) == 2
    assert "command not found" in capsys.readouterr().err
    assert lmain.main(["-np", "2", "-H", "no-such-host.invalid:2", "true"]) == 2
    assert "cannot resolve host 'no-such-host.invalid'" in capsys.readouterr().err
    monkeypatch.setenv("HOROLITE_MPIRUN", "/nonexistent/mpirun")
    assert lmain.main(["-np", "2", "true"]) == 2
    assert "no MPI found" in capsys.readouterr().err


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        lmain.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("horolite-run ")
    with pytest.raises(SystemExit):
        lmain.main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--fusion-threshold-mb", "--check-build", "--output-filename", "--start-timeout",
                 "--autotune-log-file", "--mpi-args", "--network-interface", "-x VAR[=VALUE]"):
        assert flag in out


# --- rank wrapper and supervisor pieces ---

def test_rank_and_size_from_either_mpi():
    assert rankwrap.rank_and_size({"PMI_RANK": "3", "PMI_SIZE": "4"}) == (3, 4)
    assert rankwrap.rank_and_size({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}) == (1, 2)
    assert rankwrap.rank_and_size({}) == (0, 1)


def test_marker_parsing_and_messages():
    kind, fields = supervise.parse_marker(f"{rankwrap.MARKER} exit rank=1 size=4 host=h code=3 "
                                          f"signal=0 stopped=0\n")
    assert kind == "exit" and fields["rank"] == "1" and fields["code"] == "3"
    assert supervise.parse_marker("[1]<stderr>:hello") is None
    s = supervise.RankStatus(rank=2, host="h", pid=7, code=137, signal=9)
    assert supervise.describe_exit(s) == "rank 2 (host h, pid 7) was killed by signal 9 (SIGKILL)"
    s = supervise.RankStatus(rank=1, host="h", pid=7, code=3)
    assert supervise.describe_exit(s) == "rank 1 (host h, pid 7) exited with code 3"
    # The command's pid (its process group), not the rank wrapper's.
    s = supervise.RankStatus(rank=1, host="h", pid=7, pgid=8, code=3)
    assert supervise.describe_exit(s) == "rank 1 (host h, pid 8) exited with code 3"


def test_output_prefixing():
    r, w = os.pipe()
    stream = rankwrap._Stream(w, b"[1]<stdout>:")
    stream.feed(b"a\nb")
    stream.feed(b"c\n\nd")
    stream.close()
    os.close(w)
    assert os.read(r, 1000) == b"[1]<stdout>:a\n[1]<stdout>:bc\n[1]<stdout>:\n[1]<stdout>:d\n"
    os.close(r)


def test_output_prefixing_with_timestamp():
    r, w = os.pipe()
    stream = rankwrap._Stream(w, b"[1]<stdout>:", timestamp=True)
    stream.feed(b"a\n")
    stream.close()
    os.close(w)
    import re
    assert re.fullmatch(rb"\w{3} \w{3} \d\d \d\d:\d\d:\d\d \d{4}\[1\]<stdout>:a\n", os.read(r, 1000))
    os.close(r)


def test_check_build_report():
    C = check_build.Check
    report = check_build.format_report("0.1.0", {
        "tensorflow": C(True, "2.21.0"), "mpi4py": C(True, "MPICH Version: 5.0.2; mpi4py 4.1.2"),
        "nccl": C(False, reason="no GPU"), "mpirun": C(True, "MPICH hydra 5.0.2 at /x/mpirun")})
    assert report.splitlines()[0] == "horolite v0.1.0:"
    assert "    [X] TensorFlow (2.21.0)" in report
    assert "    [X] MPI (MPICH Version: 5.0.2; mpi4py 4.1.2; mpirun: MPICH hydra 5.0.2 at /x/mpirun)" in report
    assert "    [ ] NCCL (not available: no GPU)" in report
    assert "Warning" not in report
    mixed = check_build.format_report("0.1.0", {
        "tensorflow": C(False, reason="nope"), "mpi4py": C(True, "Open MPI v5.0.11; mpi4py 4.1"),
        "nccl": C(False, reason="no GPU"), "mpirun": C(True, "MPICH hydra 5.0.2 at /x")})
    assert "[ ] TensorFlow (not available: nope)" in mixed
    assert "Warning: mpi4py uses openmpi but mpirun is mpich" in mixed
