"""horolite-run's summary from the ranks' own failure reports (launcher/outcome.py)."""
import pytest

from horolite.launcher.markers import marker_line, parse_marker
from horolite.launcher.supervise import Supervisor


def supervisor(n):
    return Supervisor(["true"], n, ["h"] * n, start_timeout=5, log=lambda msg: None)


def feed(sup, lines, exits_as_the_main_loop=False):
    for line in lines:
        raw = marker_line(line.encode())
        assert raw is not None, line
        kind, fields = parse_marker(raw.decode())
        if kind in ("start", "exit"):
            sup._record(kind, fields)
            if kind == "exit" and exits_as_the_main_loop:
                sup._first_failure(fields)
        else:
            sup._runtime_report(kind, fields)


def test_a_marker_inside_a_ranks_prefixed_line_is_found_with_its_text():
    line = "[2]<stderr>:##horolite-run## cause rank=2 code=1 text=rank 2 (host a) failed: E: x=1 (t.py:3)\n"
    kind, fields = parse_marker(marker_line(line.encode()).decode())
    assert kind == "cause" and fields == {"rank": "2", "code": "1",
                                          "text": "rank 2 (host a) failed: E: x=1 (t.py:3)"}
    assert marker_line(b"[2]<stdout>:hello ##horolite-run## cause rank=1\n") is None


def test_the_failing_rank_comes_first_even_when_it_exits_last():
    sup = supervisor(3)
    feed(sup, ["##horolite-run## exit rank=0 host=h code=1 signal=0 stopped=0",
               "[1]<stderr>:##horolite-run## stopped rank=1 by=2 text=rank 2 failed",
               "[2]<stderr>:##horolite-run## cause rank=2 code=1 text=rank 2 (host h) failed: "
               "RuntimeError: bad (t.py:5)",
               "##horolite-run## exit rank=1 host=h code=1 signal=0 stopped=0",
               "##horolite-run## exit rank=2 host=h code=1 signal=0 stopped=0"])
    result = sup._result(1)
    assert result.message == ("job failed: rank 2 (host h) failed: RuntimeError: bad (t.py:5); "
                              "ranks stopped as a result: 0, 1")
    assert result.exit_code == 1


def test_a_rank_that_left_with_code_0_is_the_cause_and_the_job_fails():
    sup = supervisor(2)
    feed(sup, ["##horolite-run## start rank=1 host=h pid=7 pgid=7",
               "[0]<stderr>:##horolite-run## stopped rank=0 by=1 text=rank 1 left",
               "##horolite-run## exit rank=1 host=h code=0 signal=0 stopped=0",
               "##horolite-run## exit rank=0 host=h code=1 signal=0 stopped=0"])
    result = sup._result(1)
    assert result.message == ("job failed: rank 1 (host h, pid 7) exited with code 0 while other "
                              "ranks still ran collectives; ranks stopped as a result: 0")
    assert result.exit_code == 1


def test_a_stall_shutdown_is_one_message():
    sup = supervisor(2)
    feed(sup, ["[0]<stderr>:##horolite-run## stall rank=0 code=1 text=stall shutdown after "
               "HOROLITE_STALL_SHUTDOWN_TIME_SECONDS=3: tensor 'g' waited 3.1 s"])
    result = sup._result(1)
    assert result.exit_code == 1 and result.message.startswith(
        "job failed: stall shutdown after HOROLITE_STALL_SHUTDOWN_TIME_SECONDS=3: tensor 'g'")


def test_a_sigterm_report_after_another_rank_failed_is_not_the_cause():
    sup = supervisor(2)
    feed(sup, ["##horolite-run## exit rank=1 host=h code=3 signal=0 stopped=0"],
         exits_as_the_main_loop=True)
    feed(sup, ["[0]<stderr>:##horolite-run## cause rank=0 code=143 text=rank 0 (host h) was "
               "killed by signal 15 (SIGTERM)",
               "##horolite-run## exit rank=0 host=h code=143 signal=15 stopped=1"])
    result = sup._result(1)
    assert result.exit_code == 3 and "rank 1 (host h" in result.message, result.message
    assert "SIGTERM" not in result.message


_STARTS = ["##horolite-run## start rank=1 host=b pid=5 pgid=6",
           "##horolite-run## start rank=2 host=c pid=7 pgid=8"]
_KILLED = "##horolite-run## exit rank=1 host=b code=137 signal=9 stopped=0 ended=100.001"
_ABORTED = "##horolite-run## exit rank=2 host=c code=14 signal=0 stopped=0 ended=100.004"


@pytest.mark.parametrize("heard", [
    # Open MPI relays each host's output on its own: the report of a peer that aborted on
    # the broken connection can come before the one of the rank that was killed.
    [_ABORTED, _KILLED,
     "##horolite-run## exit rank=0 host=a code=143 signal=15 stopped=1 ended=100.3"],
    # Open MPI then ends the job with SIGTERM: that signal's report can come first too.
    ["[0]<stderr>:##horolite-run## cause rank=0 code=143 at=100.050 text=rank 0 "
     "(host a) was killed by signal 15 (SIGTERM)",
     "##horolite-run## exit rank=0 host=a code=143 signal=15 stopped=1 ended=100.06",
     _KILLED, _ABORTED],
], ids=["a peer's abort heard first", "Open MPI's SIGTERM heard first"])
def test_a_killed_rank_is_the_first_failure_whatever_report_is_heard_first(heard):
    sup = supervisor(3)
    feed(sup, _STARTS + heard, exits_as_the_main_loop=True)
    result = sup._result(14)
    assert result.exit_code == 137, result.message
    assert result.message == ("job failed: rank 1 (host b, pid 6) was killed by signal 9 "
                              "(SIGKILL); then rank 2 (host c, pid 8) exited with code 14; "
                              "ranks stopped as a result: 0")


def test_without_end_times_the_first_report_heard_is_the_first_failure():
    sup = supervisor(2)
    feed(sup, ["##horolite-run## exit rank=1 host=b code=3 signal=0 stopped=0",
               "##horolite-run## exit rank=0 host=a code=137 signal=9 stopped=0 ended=1.0"],
         exits_as_the_main_loop=True)
    assert sup._result(3).exit_code == 3


def test_a_sigterm_from_outside_before_any_rank_ended_stays_the_cause():
    sup = supervisor(2)
    feed(sup, ["[0]<stderr>:##horolite-run## cause rank=0 code=143 at=100.0 text=rank 0 "
               "(host a) was killed by signal 15 (SIGTERM)",
               "##horolite-run## exit rank=1 host=b code=143 signal=15 stopped=0 ended=100.2",
               "##horolite-run## exit rank=0 host=a code=143 signal=15 stopped=0 ended=100.1"],
         exits_as_the_main_loop=True)
    result = sup._result(143)
    assert result.exit_code == 143
    assert result.message == ("job failed: rank 0 (host a) was killed by signal 15 (SIGTERM); "
                              "ranks stopped as a result: 1")


def test_a_rank_the_others_heard_it_through_but_that_never_reported_is_not_the_cause():
    """Rank 3 is killed; mpirun's cleanup ends rank 2 (its host's other rank) before it
    reports anything, and ranks 0 and 1 heard of the death through rank 2's connections."""
    sup = supervisor(4)
    feed(sup, ["##horolite-run## start rank=3 host=b pid=5 pgid=6",
               "##horolite-run## exit rank=3 host=b code=137 signal=9 stopped=0 ended=100.0",
               "[0]<stderr>:##horolite-run## stopped rank=0 by=2 text=the connection to rank 2 closed",
               "[1]<stderr>:##horolite-run## stopped rank=1 by=2 text=the connection to rank 2 closed",
               "##horolite-run## exit rank=0 host=a code=1 signal=0 stopped=0 ended=100.1",
               "##horolite-run## exit rank=1 host=a code=1 signal=0 stopped=0 ended=100.1"],
         exits_as_the_main_loop=True)
    result = sup._result(1)
    assert result.exit_code == 137, result.message
    assert result.message == ("job failed: rank 3 (host b, pid 6) was killed by signal 9 "
                              "(SIGKILL); ranks stopped as a result: 0, 1, 2")


def test_a_rank_that_never_reported_is_the_origin_when_nobody_failed_by_itself():
    sup = supervisor(2)
    feed(sup, ["[0]<stderr>:##horolite-run## stopped rank=0 by=1 text=the connection to rank 1 closed",
               "##horolite-run## exit rank=0 host=a code=1 signal=0 stopped=0 ended=100.1"],
         exits_as_the_main_loop=True)
    result = sup._result(1)
    assert result.message == ("job failed: rank 1 ended while other ranks still ran "
                              "collectives; ranks stopped as a result: 0"), result.message


def test_a_rank_stopped_by_the_launchers_sigterm_is_not_the_cause():
    """Rank 1 exits with code 3; the others sleep, and its wrapper holds its end (rankwrap
    --hold), so horolite-run itself sends SIGTERM. Rank 0 then announces its SIGTERM and
    rank 2 reports being stopped by rank 0: a consequence of the launcher's signal."""
    sup = supervisor(3)
    feed(sup, ["##horolite-run## start rank=1 host=h pid=5 pgid=6",
               "##horolite-run## exit rank=1 host=h code=3 signal=0 stopped=0 ended=100.0"],
         exits_as_the_main_loop=True)
    sup._stopping = True  # (as _send sets it)
    feed(sup, ["[0]<stderr>:##horolite-run## cause rank=0 code=143 text=rank 1 (host h) "
               "stopped answering (its process 6 is gone); then rank 0 (host h) was killed by "
               "signal 15 (SIGTERM)",
               "[2]<stderr>:##horolite-run## stopped rank=2 by=0 text=rank 1 (host h) stopped "
               "answering (its process 6 is gone); then rank 0 (host h) was killed by signal 15",
               "##horolite-run## exit rank=0 host=h code=143 signal=15 stopped=1 ended=102.0",
               "##horolite-run## exit rank=2 host=h code=1 signal=0 stopped=1 ended=102.0"],
         exits_as_the_main_loop=True)
    result = sup._result(1)
    assert result.exit_code == 3, result.message
    assert result.message == ("job failed: rank 1 (host h, pid 6) exited with code 3; "
                              "ranks stopped as a result: 0, 2")
