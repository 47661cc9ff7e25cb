"""The rank-prefixed log format, the TRACE level name and the hidden timestamp."""
import logging
import re

from horolite.core import log


def _line(capsys, level_name, hide_time=False):
    log.configure(level_name, 2, 4, hide_time=hide_time)
    try:
        logging.getLogger("horolite.test").log(log.TRACE, "tracing %d", 7)
        logging.getLogger("horolite.test").debug("debugging")
    finally:
        log.configure("WARNING", 0, 1)
    return capsys.readouterr().err


def test_trace_lines_say_trace(capsys):
    err = _line(capsys, "TRACE")
    assert "rank 2/4] TRACE horolite.test: tracing 7" in err
    assert "Level 5" not in err and "DEBUG horolite.test: debugging" in err
    # (what level 5 is called: Ray Data, once imported, names its own level 9 TRACE too)
    assert logging.getLevelName(log.TRACE) == "TRACE"


def test_trace_is_below_debug(capsys):
    err = _line(capsys, "DEBUG")
    assert "tracing" not in err and "debugging" in err


def test_timestamp_shown_unless_hidden(capsys):
    assert re.search(r"^\[\d{4}-\d\d-\d\d [\d:,]+ horolite rank 2/4\]", _line(capsys, "TRACE"), re.M)
    assert re.search(r"^\[horolite rank 2/4\] TRACE", _line(capsys, "TRACE", hide_time=True), re.M)
