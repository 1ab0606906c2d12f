"""Triton's independent log switches over Python's threshold levels, in process."""

from __future__ import annotations

import io
import logging

import pytest

from zeroserve.broker.logsettings import LogSettings, SettingsError


def settings() -> tuple[LogSettings, logging.Logger, io.StringIO]:
    out = io.StringIO()
    root = logging.getLogger("zs-test-root")   # registered, so setLevel clears its cache
    root.handlers[:] = []
    root.propagate = False
    root.setLevel(logging.INFO)
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root.addHandler(handler)
    return LogSettings(root), root, out


def test_switches_drop_exactly_the_levels_turned_off() -> None:
    s, root, out = settings()
    assert s.current()["log_info"] and s.current()["log_verbose_level"] == 0
    s.apply({"log_info": False})
    for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
        root.log(level, "at %s", logging.getLevelName(level))
    assert out.getvalue().count("\n") == 2 and "at INFO" not in out.getvalue()
    s.apply({"log_verbose_level": 2, "log_warning": False})
    root.debug("verbose now")
    root.warning("warning off")
    assert "verbose now" in out.getvalue() and "warning off" not in out.getvalue()


def test_iso8601_format_and_validation() -> None:
    s, root, out = settings()
    assert s.apply({"log_format": "ISO8601"})["log_format"] == "ISO8601"
    root.info("stamped")
    stamp = out.getvalue().split()[0]
    assert stamp.endswith("Z") and "T" in stamp, stamp
    for bad, word in (({"log_info": 1}, "log_info"), ({"log_format": "json"}, "log_format"),
                      ({"log_file": "/tmp/x"}, "log_file"), ({"nope": 1}, "unknown"),
                      ([], "JSON object")):
        with pytest.raises(SettingsError, match=word):
            s.apply(bad)  # type: ignore[arg-type]
    assert s.current()["log_format"] == "ISO8601"   # a refused update changes nothing
