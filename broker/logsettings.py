"""The logging extension (Triton's ``/v2/logging``) applied to this process's Python
logging. Self-contained on purpose (stdlib only): the gateway, the broker (its
``logging`` verb) and the workers (the broker's LOG_SETTINGS message) apply the same
settings with the same code.

Python levels are thresholds; Triton's switches are independent (info off, warning
on is legal), so a filter on the root handlers drops exactly the switched-off levels
and the root level only skips the work of records nobody prints.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

FORMATS = ("default", "ISO8601")
SWITCHES = ("log_info", "log_warning", "log_error")
KEYS = (*SWITCHES, "log_verbose_level", "log_format", "log_file")


class SettingsError(ValueError):
    """A setting that does not validate (HTTP 400); the message names it."""


class ISO8601Formatter(logging.Formatter):
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        stamp = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class SwitchFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__("zeroserve-log-switches")
        self.info = self.warning = self.error = True
        self.verbose = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return self.error
        if record.levelno >= logging.WARNING:
            return self.warning
        if record.levelno >= logging.INFO:
            return self.info
        return self.verbose > 0


def validate(update: Any) -> dict[str, Any]:
    """The update, checked: known keys with the right types."""
    if not isinstance(update, dict):
        raise SettingsError("the body must be a JSON object of log settings")
    unknown = sorted(set(update) - set(KEYS))
    if unknown:
        raise SettingsError(f"unknown log setting {unknown[0]!r} (known: {', '.join(KEYS)})")
    for key in SWITCHES:
        if key in update and not isinstance(update[key], bool):
            raise SettingsError(f"{key} must be true or false, got {update[key]!r}")
    level = update.get("log_verbose_level", 0)
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 2**31 - 1:
        raise SettingsError(f"log_verbose_level must be a non-negative integer, got {level!r}")
    if "log_format" in update and update["log_format"] not in FORMATS:
        raise SettingsError(f"log_format must be one of {', '.join(FORMATS)}, "
                            f"got {update['log_format']!r}")
    if update.get("log_file", ""):
        raise SettingsError("log_file cannot be set: zeroserve logs to stderr (systemd's "
                            "journal or the supervisor's output)")
    return dict(update)


class LogSettings:
    """This process's log settings; ``apply`` changes them in place."""

    def __init__(self, root: logging.Logger | None = None) -> None:
        self.root = root or logging.getLogger()
        self.filter = SwitchFilter()
        level = self.root.getEffectiveLevel()
        self.filter.info = level <= logging.INFO
        self.filter.warning = level <= logging.WARNING
        self.filter.error = level <= logging.ERROR
        self.filter.verbose = 1 if level <= logging.DEBUG else 0
        self.format = "default"

    def current(self) -> dict[str, Any]:
        return {"log_file": "", "log_info": self.filter.info,
                "log_warning": self.filter.warning, "log_error": self.filter.error,
                "log_verbose_level": self.filter.verbose, "log_format": self.format}

    def apply(self, update: dict[str, Any]) -> dict[str, Any]:
        update = validate(update)
        f = self.filter
        f.info = update.get("log_info", f.info)
        f.warning = update.get("log_warning", f.warning)
        f.error = update.get("log_error", f.error)
        f.verbose = update.get("log_verbose_level", f.verbose)
        self.format = update.get("log_format", self.format)
        lowest = [lvl for on, lvl in ((f.verbose > 0, logging.DEBUG), (f.info, logging.INFO),
                                      (f.warning, logging.WARNING), (f.error, logging.ERROR))
                  if on]
        self.root.setLevel(lowest[0] if lowest else logging.CRITICAL + 10)
        for handler in self.root.handlers:
            if f not in handler.filters:
                handler.addFilter(f)
            fmt = handler.formatter._fmt if handler.formatter is not None else None
            cls = ISO8601Formatter if self.format == "ISO8601" else logging.Formatter
            if type(handler.formatter) is not cls:
                handler.setFormatter(cls(fmt))
        return self.current()
