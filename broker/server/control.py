"""Control verbs as a table: who may call each, and what it does.

Read-only verbs (metadata, status, metrics, ...) are answered on the control socket
and, for the gateway's convenience, on the frontend. Verbs that change state are
answered on the control socket only, and need the admin token when the broker has
one (``ZEROSERVE_ADMIN_TOKEN``): anything that reaches the inference socket must not
be able to delete a model or drain a worker.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from zeroserve.broker import protocol as p

logger = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Any]


class ControlError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Scope(Protocol):
    """What a tenant on the frontend may see (scope.py's TenantScope): its verbs, and for
    each call the filter of the answer (None: all of it)."""

    def add_verbs(self, control: "ControlTable") -> None: ...

    def check(self, verb: str, args: dict[str, Any], token: str,
              on_frontend: bool) -> Callable[[Any], Any] | None: ...


@dataclass(frozen=True)
class Verb:
    fn: Handler
    mutates: bool = False


class ControlTable:
    """Verbs by name. Components add theirs with :meth:`add`; the loop calls
    :meth:`handle` with where the call came from."""

    def __init__(self, admin_token: str = "", scope: Scope | None = None) -> None:
        self._token = admin_token
        self._scope = scope   # what a tenant on the frontend may see (scope.py)
        self._verbs: dict[str, Verb] = {"ping": Verb(lambda _: {"ok": True})}
        if scope is not None:
            scope.add_verbs(self)

    def add(self, name: str, fn: Handler, *, mutates: bool = False) -> None:
        self._verbs[name] = Verb(fn, mutates)

    def names(self) -> list[str]:
        return sorted(self._verbs)

    def handle(self, msg: p.ControlRequest, on_frontend: bool) -> list[Any]:
        verb = self._verbs.get(msg.verb)
        try:
            if verb is None:
                raise ControlError("bad_input", f"unknown control verb {msg.verb!r}"[:200]
                                   + f" (known: {', '.join(self.names())})")
            if verb.mutates:
                self._authorize(msg, on_frontend)
            args = dict(msg.args)
            visible = self._scope.check(msg.verb, args, msg.token, on_frontend) \
                if self._scope is not None else None
            result = verb.fn(args)
            if visible is not None:
                result = visible(result)
        except ControlError as exc:
            return p.encode(p.ControlReply(msg.call_id, False, code=exc.code, error=str(exc)))
        except LookupError as exc:
            return p.encode(p.ControlReply(msg.call_id, False, code="not_found",
                                           error=str(exc.args[0]) if exc.args else str(exc)))
        except (TypeError, ValueError) as exc:   # args of the wrong shape for the verb
            return p.encode(p.ControlReply(msg.call_id, False, code="bad_input",
                                           error=f"{msg.verb}: {exc}"[:500]))
        except Exception as exc:  # noqa: BLE001 - a bug of ours still gets its one answer
            logger.exception("control verb %r failed", msg.verb)
            return p.encode(p.ControlReply(msg.call_id, False, code="internal",
                                           error=f"{msg.verb} failed: {exc}"[:500]))
        return p.encode(p.ControlReply(msg.call_id, True, result=result))

    def _authorize(self, msg: p.ControlRequest, on_frontend: bool) -> None:
        if on_frontend:
            raise ControlError("forbidden", f"{msg.verb!r} changes state: it is answered on "
                               "the control socket only")
        if self._token and not hmac.compare_digest(msg.token.encode(), self._token.encode()):
            logger.warning("control verb %r refused: wrong or missing admin token", msg.verb)
            raise ControlError("unauthorized", f"{msg.verb!r} needs the admin token "
                               "(ZEROSERVE_ADMIN_TOKEN)")


def worker_arg(args: dict[str, Any]) -> str:
    worker = args.get("worker")
    if not isinstance(worker, str) or not worker:
        raise ControlError("bad_input", "'worker' must name a worker id such as host/0")
    return worker


def model_arg(args: dict[str, Any]) -> tuple[str, int | None]:
    name, version = args.get("model"), args.get("version")
    if not isinstance(name, str) or not name:
        raise ControlError("bad_input", "'model' must name a model")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise ControlError("bad_input", "'version' must be an integer")
    return name, version
