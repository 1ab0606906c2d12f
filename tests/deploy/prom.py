"""A real Prometheus for the tests: the rule files rendered with test-time windows, the
server started on a free loopback port with a temp data dir (always reaped), and
queries through its HTTP API."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import free_port, short_tmpdir, wait_for

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules"
PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
MISSING = ("Prometheus is not installed (Debian: apt-get install prometheus): "
           "the alert, recording-rule and dashboard checks need promtool and the server")

# the production windows, shortened so a test sees an alert go pending and fire in
# seconds; scrapes and rule evaluations every second
WINDOWS = {"5m": "10s", "15m": "60s", "1h": "60s"}
FOR_S = 5
RATE_INTERVAL = WINDOWS["5m"]   # what the dashboard's $__rate_interval stands for


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = []
    for path in sorted(RULES.glob("*.yml")):
        groups += yaml.safe_load(path.read_text())["groups"]
    return groups


def rules(kind: str) -> list[dict[str, Any]]:
    return [r for g in rule_groups() for r in g["rules"] if kind in r]


def shorten(expr: str) -> str:
    def window(m: re.Match[str]) -> str:
        if m.group(1) not in WINDOWS:
            raise AssertionError(f"no test-time window for [{m.group(1)}] in {expr}")
        return f"[{WINDOWS[m.group(1)]}]"
    return re.sub(r"\[(\d+[smhd])\]", window, expr)


def render_rules(folder: Path) -> list[Path]:
    """Each rule file with short windows and every ``for:`` at FOR_S seconds."""
    out = []
    for path in sorted(RULES.glob("*.yml")):
        doc = yaml.safe_load(path.read_text())
        for group in doc["groups"]:
            for rule in group["rules"]:
                rule["expr"] = shorten(rule["expr"])
                if "for" in rule:
                    rule["for"] = f"{FOR_S}s"
        target = folder / path.name
        target.write_text(yaml.safe_dump(doc, sort_keys=False))
        out.append(target)
    return out


def measures(expr: str) -> list[str]:
    """The sides of an alert's top-level comparison that are not numbers: the series
    its threshold is compared with. ``a / on (m) b > 0.01`` gives ``["a / on (m) b"]``."""
    depth, quote, cut = 0, "", None
    for i, ch in enumerate(expr):
        if quote:
            quote = "" if ch == quote and expr[i - 1] != "\\" else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and ch in "<>=!" and expr[i + 1:i + 2] != "~" and \
                (ch != "=" or expr[i + 1:i + 2] == "="):
            if cut is None:
                cut = i
    if cut is None:
        raise AssertionError(f"no top-level comparison in {expr!r}")
    lhs, rhs = expr[:cut].strip(), re.sub(r"^[<>=!]+", "", expr[cut:]).strip()
    rhs = re.sub(r"^bool\s+", "", rhs)
    return [side for side in (lhs, rhs) if not re.fullmatch(r"-?[\d.e+]+", side)]


class Prometheus:
    """``prometheus`` scraping one zeroserve gateway every second, with the rendered rules."""

    def __init__(self, target_port: int) -> None:
        assert PROMETHEUS is not None, MISSING
        self.folder = short_tmpdir("zsprom")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        files = render_rules(self.folder)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                       "scrape_timeout": "900ms"},
            "rule_files": [str(f) for f in files],
            "scrape_configs": [{"job_name": "zeroserve", "honor_labels": True,
                                "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}],
        }
        (self.folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self._log = open(self.folder / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self.folder / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return (self.folder / "prometheus.log").read_text(errors="replace")

    def wait_ready(self) -> "Prometheus":
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False
        wait_for(ready, 30, "Prometheus to be ready")
        return self

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as err:
            raise AssertionError(f"{path} {params}: {err.code} {err.read()[:500]!r}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]  # type: ignore[no-any-return]

    def alerts(self, name: str, state: str = "firing") -> list[dict[str, Any]]:
        return [a for a in self.api("alerts")["alerts"]
                if a["labels"]["alertname"] == name and a["state"] == state]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()
        self._log.close()
        shutil.rmtree(self.folder, ignore_errors=True)
