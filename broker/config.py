"""One TOML file for every component, derived from the command line's own options.

Each option of ``zeroserve broker|worker|gateway|serve`` is declared once, as an
argparse flag in ``broker/options.py``; this module reads the same option as
``[<component>] <option>`` in the file and as ``ZEROSERVE_<COMPONENT>_<OPTION>``
in the environment (``--http-port`` of ``zeroserve gateway`` is
``[gateway] http_port`` and ``ZEROSERVE_GATEWAY_HTTP_PORT``). Precedence: flag >
environment > file > default. The result becomes the subcommand's argparse
defaults, so a flag given on the command line still wins. Unknown tables, keys
and ``ZEROSERVE_<COMPONENT>_*`` variables are errors that name them.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from pathlib import Path
from typing import Any, Mapping

COMPONENTS = ("broker", "worker", "gateway", "serve")
ETC_PATH = Path("/etc/zeroserve/zeroserve.toml")
_NOT_OPTIONS = {"help", "config", "json", "timeout"}


class ConfigError(ValueError):
    """A bad configuration: the message names the file or variable, and the key."""


def default_path() -> Path | None:
    """$ZEROSERVE_CONFIG, else /etc/zeroserve/zeroserve.toml when it exists."""
    explicit = os.environ.get("ZEROSERVE_CONFIG")
    if explicit:
        return Path(explicit)
    return ETC_PATH if ETC_PATH.is_file() else None


def options(sub: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The configurable options of one subcommand, by their key (the argparse dest)."""
    return {a.dest: a for a in sub._actions  # argparse keeps its actions here
            if a.option_strings and a.dest not in _NOT_OPTIONS}


def read_file(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def coerce(action: argparse.Action, value: Any, origin: str, text: bool = False) -> Any:
    """A file value (typed TOML) or an environment one (``text``) as the flag would have
    parsed it."""
    if isinstance(action, argparse._StoreTrueAction):   # a flag: true or false
        word = str(value).strip().lower() if text else value
        flags = {"1": True, "true": True, "yes": True, "on": True,
                 "0": False, "false": False, "no": False, "off": False, "": False}
        if text and word in flags:
            return flags[word]
        if not text and isinstance(value, bool):
            return value
        raise ConfigError(f"{origin}: expected true or false, got {value!r}")
    typ = action.type if callable(action.type) else str
    want = getattr(typ, "__name__", "value")
    if text and typ is not str or typ not in (int, float, str):   # a size: text or bytes
        try:
            value = typ(value)
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"{origin}: {exc}") from None
        except ValueError:
            raise ConfigError(f"{origin}: {value!r} is not a valid {want}") from None
    elif typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif typ in (int, float, str) and (not isinstance(value, typ) or isinstance(value, bool)):
        raise ConfigError(f"{origin}: expected {want}, got {type(value).__name__} {value!r}")
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{origin}: {value!r} is not one of "
                          f"{', '.join(map(str, action.choices))}")
    return value


def check_file(doc: Mapping[str, Any], subparsers: Mapping[str, argparse.ArgumentParser],
               path: Path | None) -> None:
    """Every table is a component and every key one of its options."""
    where = f"config file {path}"
    for table, body in doc.items():
        if table not in COMPONENTS:
            raise ConfigError(f"{where}: unknown table [{table}] "
                              f"(known: {', '.join(COMPONENTS)})")
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: {table} must be a table")
        known = options(subparsers[table])
        for key, value in body.items():
            if key not in known:
                raise ConfigError(f"{where}: unknown key {key!r} in [{table}] "
                                  f"(known: {', '.join(sorted(known))})")
            coerce(known[key], value, f"{where}: [{table}] {key}")


def check_env(component: str, sub: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    prefix = f"ZEROSERVE_{component.upper()}_"
    known = {prefix + dest.upper() for dest in options(sub)}
    for name in environ:
        if name.startswith(prefix) and name not in known:
            raise ConfigError(f"unknown environment variable {name} "
                              f"(known: {', '.join(sorted(known))})")


def resolve(component: str, sub: argparse.ArgumentParser, doc: Mapping[str, Any],
            environ: Mapping[str, str], only: set[str] | None = None) -> dict[str, Any]:
    """env > file > default for each option of ``component`` (``only``: a subset of keys)."""
    table = doc.get(component, {})
    out: dict[str, Any] = {}
    for dest, action in options(sub).items():
        if only is not None and dest not in only:
            continue
        env_name = f"ZEROSERVE_{component.upper()}_{dest.upper()}"
        if env_name in environ:
            out[dest] = coerce(action, environ[env_name], f"environment {env_name}", text=True)
        elif dest in table:
            out[dest] = coerce(action, table[dest], f"[{component}] {dest}")
        else:
            out[dest] = action.default
    return out


def load(subparsers: Mapping[str, argparse.ArgumentParser], path: Path | None,
         environ: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """The effective configuration of every component (flags aside), validated."""
    environ = os.environ if environ is None else environ
    doc = read_file(path)
    check_file(doc, subparsers, path)
    effective = {}
    for component in COMPONENTS:
        check_env(component, subparsers[component], environ)
        effective[component] = resolve(component, subparsers[component], doc, environ)
    return effective


def to_toml(effective: Mapping[str, Mapping[str, Any]]) -> str:
    """The effective configuration as a TOML file (unset options as comments)."""
    lines: list[str] = []
    for component, values in effective.items():
        lines.append(f"[{component}]")
        for key, value in sorted(values.items()):
            if value is None:
                lines.append(f"# {key} = (unset)")
            elif isinstance(value, bool):
                lines.append(f"{key} = {str(value).lower()}")
            elif isinstance(value, (int, float)):
                lines.append(f"{key} = {value!r}")
            else:
                escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
                lines.append(f'{key} = "{escaped}"')
        lines.append("")
    return "\n".join(lines)
