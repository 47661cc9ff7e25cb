"""The rank wrapper run as mpirun runs it: its exit report says when the command ended,
which the launcher orders failures on different hosts by."""
import os
import signal
import subprocess
import sys
import time

import pytest

from launcher.markers import marker_line, parse_marker

WRAPPER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))), "launcher", "rankwrap.py")


def run_wrapped(script):
    started = time.time()
    r = subprocess.run([sys.executable, WRAPPER, "--", "sh", "-c", script],
                       capture_output=True, timeout=60, env=dict(os.environ, PMI_RANK="1",
                                                                 PMI_SIZE="2"))
    finished = time.time()
    markers = [marker_line(line + b"\n") for line in r.stderr.splitlines()]
    exits = [fields for kind, fields in (parse_marker(m.decode()) for m in markers if m)
             if kind == "exit"]
    assert len(exits) == 1, r.stderr
    return r, exits[0], started, finished


def test_a_killed_command_is_reported_with_its_signal_and_the_time_it_died():
    r, fields, started, finished = run_wrapped("sleep 0.5; kill -9 $$")
    assert r.returncode == 128 + 9
    assert (fields["rank"], fields["code"], fields["signal"], fields["stopped"]) == \
        ("1", "137", "9", "0")
    assert started + 0.5 <= float(fields["ended"]) <= finished


def test_the_end_time_is_the_commands_not_the_wrappers_when_leftovers_hold_its_pipes():
    # The background sleep keeps the pipes open; the wrapper waits a second more for it,
    # then kills it, but the command itself ended at once.
    r, fields, started, finished = run_wrapped("sleep 30 & exit 3")
    assert r.returncode == 3 and fields["code"] == "3"
    ended = float(fields["ended"])
    assert started <= ended and finished - ended >= 0.9, (started, ended, finished)


def _exit_marker_then_wrapper(script, *options):
    """The wrapper started as horolite-run starts it, read up to its exit report."""
    proc = subprocess.Popen([sys.executable, WRAPPER, *options, "--", "sh", "-c", script],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=dict(os.environ, PMI_RANK="1", PMI_SIZE="2"))
    for line in proc.stderr:
        marker = marker_line(line)
        if marker and parse_marker(marker.decode())[0] == "exit":
            return proc, parse_marker(marker.decode())[1]
    proc.wait()
    raise AssertionError("no exit report")


def test_a_failed_commands_end_is_reported_at_once_and_held_until_a_signal():
    # mpirun ends every rank once one wrapper ends with an error: held, it cannot cut off
    # another rank's report still on its way (launcher/supervise.py ends the job).
    proc, fields = _exit_marker_then_wrapper("exit 3", "--hold", "60")
    try:
        assert fields["code"] == "3"
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)  # reported, and still there
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 3  # the command's code, not the signal's
    finally:
        proc.kill()
        proc.wait()


def test_a_command_that_succeeded_is_not_held():
    proc, fields = _exit_marker_then_wrapper("exit 0", "--hold", "60")
    assert fields["code"] == "0" and proc.wait(timeout=30) == 0


def test_a_command_whose_wrapper_died_while_it_started_does_not_run_orphaned():
    # The parent-death signal is set in the child after fork: a wrapper that died before
    # that (a SIGTERM as it started) left the command running alone. The child set-up
    # checks its parent is still the wrapper; here it is told another pid, as if the
    # wrapper had gone and the child been handed to init.
    from launcher.rankwrap import _child_setup
    r = subprocess.run(["sh", "-c", "echo ran"], capture_output=True, timeout=30,
                       preexec_fn=lambda: _child_setup(os.getpid() + 1))
    assert r.returncode == 128 + signal.SIGKILL and r.stdout == b"", r
    r = subprocess.run(["sh", "-c", "echo ran"], capture_output=True, timeout=30,
                       preexec_fn=lambda pid=os.getpid(): _child_setup(pid))
    assert r.returncode == 0 and r.stdout == b"ran\n", r
