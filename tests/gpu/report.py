"""The device suite's Markdown report, from its JSON: what ran where, every check with
its target and verdict, each part's figures, and why a part was left out."""

from __future__ import annotations

import json
from typing import Any


def _rounded(v: Any) -> Any:
    if isinstance(v, float):
        return float(f"{v:.4g}")
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return v


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return "`" + json.dumps(_rounded(v), separators=(", ", ": ")) + "`"
    return "-" if v is None else str(v)


def _figure(key: str, value: Any) -> list[str]:
    if isinstance(value, list) and value and all(isinstance(x, str) for x in value):
        return [f"- {key}:", "", "  ```", *(f"  {x}" for x in value), "  ```", ""]
    return [f"- {key}: {_value(value)}"]


def _environment(doc: dict[str, Any]) -> str:
    env = doc["parts"].get("environment", {}).get("figures", {})
    if not env:
        return f"Device: {doc['device']} (the environment part did not run)."
    gpu = env.get("gpu_name") or "no CUDA device"
    return (f"Device: {gpu} ({doc['device']}), driver {env.get('driver') or '-'}, "
            f"torch {env.get('torch')}, CUDA {env.get('cuda') or '-'}, cuDNN "
            f"{env.get('cudnn') or '-'}; {env.get('cpus')} CPUs; commit "
            f"{env.get('commit')}{' (with changes)' if env.get('dirty') else ''}.")


def markdown(doc: dict[str, Any]) -> str:
    parts = doc["parts"]
    lines = ["# zeroserve device suite", "", _environment(doc), "",
             f"Wall time {doc['wall_s']:.0f} s of a {doc['budget_s']:.0f} s budget."]
    if doc.get("rehearsal"):
        lines += ["", "**A rehearsal on the CPU: the device parts ran on the CPU with short "
                  "loads to test the suite; their figures mean nothing.**"]
    lines += ["", "## Parts", "", "| part | status | wall s | what, or why not |",
              "|---|---|---:|---|"]
    for name, r in parts.items():
        why = r.get("reason") or r.get("what", "")
        lines.append(f"| {name} | {r['status']} | {_value(r.get('wall_s'))} | {why} |")
    checks = [(name, c) for name, r in parts.items() for c in r.get("checks", [])]
    if checks:
        lines += ["", "## Checks", "", "| part | check | value | target | verdict |",
                  "|---|---|---:|---|---|"]
        for name, c in checks:
            verdict = {True: "pass", False: "**FAIL**", None: "not measured"}[c.get("ok")]
            lines.append(f"| {name} | {c['check']} | {_value(c.get('value'))} | "
                         f"{c.get('target', '')} | {verdict} |")
    for name, r in parts.items():
        if r["status"] == "skipped":
            continue
        lines += ["", f"## {name}", ""]
        for key, value in r.get("figures", {}).items():
            lines += _figure(key, value)
        lines += [f"- note: {n}" for n in r.get("notes", [])]
        if r["status"] in ("failed", "cut"):
            lines += ["", "```", *r.get("log_tail", []), "```"]
    return "\n".join(lines) + "\n"
