"""The README's two set-up commands stay true: CI runs the same test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```sh\n(python3 -m venv[^\n]+)\n```", text)


def test_readme_starts_with_serve_and_test_commands():
    serve, test = readme_commands()[:2]
    assert serve.endswith("zeroserve serve")
    assert "pytest" in test


def test_ci_runs_the_readme_test_command():
    test = readme_commands()[1]
    assert test in (ROOT / ".ci" / "run").read_text().splitlines()
