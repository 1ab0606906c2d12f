"""Shared by the rollout and release tests: a Python-handler model whose output is its
version number (optionally failing a fifth of its inputs, or slower), and a closed-loop
keyed load from direct and HTTP clients that records, for every answer, the version its
output names and the build the server said computed it."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from tests.conftest import Server, http
from zeroserve.broker.client import Client, InferError

HANDLER = '''
import time


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        x = inputs["input"]
        if {fails} and any(int(v) % 5 == 3 for v in x[:, 0]):  # warm-up sends zeros
            raise ValueError("version {version} fails on this input")
        time.sleep({sleep_s})  # noqa: sleep-ok (each version has a known service time)
        return {{"output": x[:, :3] * 0.0 + {version}.0}}
'''
SERVICE_S = 0.005
KEYS = 40


def write_version(folder: Path, version: int, fails: bool = False,
                  sleep_s: float = SERVICE_S) -> Path:
    """A version folder at ``folder`` (its model.py), for a repository or an import."""
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(HANDLER.format(version=version, fails=fails,
                                                    sleep_s=sleep_s))
    return folder


def add_version(repo: Path, version: int, fails: bool = False,
                sleep_s: float = SERVICE_S) -> None:
    """Written beside the model, then renamed into place: the watcher sees it whole."""
    tmp = write_version(repo / "m" / f".tmp-{version}", version, fails, sleep_s)
    os.rename(tmp, repo / "m" / str(version))


@dataclass(frozen=True)
class Answer:
    sent: float          # time.monotonic() when sent
    got: float           # and when answered
    outcome: int | str   # the version the output names, or the error's message
    build: str = ""      # "<version>/<sha256>" as the server named it ("" on an error)


@dataclass
class Answers:
    """Every answer of the load, by routing key."""

    by_key: dict[str, list[Answer]] = field(default_factory=dict)
    sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, key: str, answer: Answer) -> None:
        with self.lock:
            self.by_key.setdefault(key, []).append(answer)

    def all(self) -> list[Answer]:
        with self.lock:
            return [a for answers in self.by_key.values() for a in answers]


class Load:
    """Closed-loop senders to model ``m`` until stopped: two direct clients and one HTTP
    one, each cycling over its own routing keys; a request's first input value names it,
    so a fifth of them are the inputs a failing version fails on."""

    def __init__(self, srv: Server) -> None:
        self.srv, self.answers, self.stop = srv, Answers(), threading.Event()
        self.threads = [threading.Thread(target=self._direct, args=(f"d{i}",), daemon=True)
                        for i in range(2)]
        self.threads.append(threading.Thread(target=self._http, daemon=True))
        self.errors: list[BaseException] = []
        for t in self.threads:
            t.start()

    def _keys(self, prefix: str) -> Iterator[tuple[str, np.ndarray, float]]:
        n = 0
        while not self.stop.is_set():
            n += 1
            x = np.full((1, 4), float(n), np.float32)
            with self.answers.lock:
                self.answers.sent += 1
            yield f"{prefix}-{n % KEYS}", x, time.monotonic()

    def _direct(self, prefix: str) -> None:
        try:
            with Client(self.srv.frontend, timeout_s=30) as c:
                for key, x, sent in self._keys(prefix):
                    try:
                        res = c.infer("m", {"input": x}, routing_key=key)
                        answer = Answer(sent, time.monotonic(),
                                        int(res.outputs["output"].flat[0]),
                                        f"{res.version}/{res.build}")
                    except InferError as exc:
                        answer = Answer(sent, time.monotonic(), exc.message)
                    self.answers.add(key, answer)
        except BaseException as exc:   # the test fails on it, not the thread alone
            self.errors.append(exc)

    def _http(self) -> None:
        try:
            url = f"{self.srv.url}/v2/models/m/infer"
            for key, x, sent in self._keys("h"):
                body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4],
                                               "datatype": "FP32",
                                               "data": x.ravel().tolist()}]}).encode()
                status, headers, raw = http("POST", url, body, {"X-Routing-Key": key})
                doc = json.loads(raw)
                build = {k.lower(): v for k, v in headers.items()}.get("x-model-build", "")
                self.answers.add(key, Answer(
                    sent, time.monotonic(),
                    int(doc["outputs"][0]["data"][0]) if status == 200 else doc["error"],
                    build if status == 200 else ""))
        except BaseException as exc:
            self.errors.append(exc)

    def finish(self) -> Answers:
        self.stop.set()
        for t in self.threads:
            t.join(40)
        assert not any(t.is_alive() for t in self.threads), "a sender hangs"
        assert not self.errors, self.errors
        return self.answers


def control(srv: Server, verb: str, **args: Any) -> Any:
    with Client(srv.control, timeout_s=10) as c:
        return c.control(verb, **args)


def rollout_of(srv: Server) -> dict[str, Any]:
    return control(srv, "models")["models"]["m"].get("rollout") or {}


def ended(srv: Server, canary: int) -> dict[str, Any] | None:
    r = rollout_of(srv)
    return r if r.get("canary") == canary and r.get("outcome") else None


def never_back(answers: Answers, old: int, new: int) -> None:
    """Sticky while a canary grows: no key that met ``new`` meets ``old`` again."""
    for key, seq in answers.by_key.items():
        versions = [a.outcome for a in sorted(seq, key=lambda a: a.sent)
                    if a.outcome in (old, new)]
        first = versions.index(new) if new in versions else len(versions)
        assert old not in versions[first:], f"key {key} went back to version {old}"
