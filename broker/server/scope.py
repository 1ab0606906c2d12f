"""What a caller on the frontend sees of the read-only control verbs when the broker has
a tenants file: a tenant sees only the models it may call, as if the others were absent.

The verbs that answer about models (:data:`SCOPED`: metadata, config, statistics, the
repository index) need a tenant's key in ``args["api_key"]`` (the gateway passes its
caller's; the direct client sends its own): no key or an unknown one is refused
(unauthorized), a model the tenant may not call is not found with the very words of a
model that does not exist, and a listing keeps only the tenant's models. The
operator's verbs (status, models, metrics, tenants, ...) are not a tenant's: on the
frontend they need the admin token when the broker has one; a call with that token
and no ``api_key`` at all sees everything (the gateway's own calls: readiness, a
scrape); one that names a key, even an empty one, is that caller's (the gateway passes
its caller's key always, so a caller without one is refused though the gateway holds
the token). Without an
admin token they stay open, as every read-only verb was before tenants: the broker
then trusts whoever reaches its socket, as it does for management on loopback.
``ping``, ``draining`` and ``access`` (whether keys are needed at all) are the
gateway's plumbing and always open; ``whoami`` names the tenant of a key, for the
gateway's routes that never reach the broker. The control socket is the operator's
and is never scoped.
"""

from __future__ import annotations

import hmac
from typing import Any, Callable

from zeroserve.broker import wording
from zeroserve.broker.server.control import ControlError, ControlTable
from zeroserve.broker.server.tenancy import Refusal, Tenancy
from zeroserve.broker.server.tenants import Tenant

OPEN = frozenset({"ping", "draining", "access"})
SCOPED = frozenset({"metadata", "config", "stats", "repository_index", "whoami", "text"})
Filter = Callable[[Any], Any]


def _unchanged(result: Any) -> Any:
    return result


class TenantScope:
    def __init__(self, tenancy: Tenancy, admin_token: str = "") -> None:
        self.tenancy = tenancy
        self._token = admin_token

    def add_verbs(self, control: ControlTable) -> None:
        control.add("access", lambda _: {"tenants": self.tenancy.enabled})
        control.add("whoami", lambda _: {"tenant": None})   # a tenant's: see _visible

    def check(self, verb: str, args: dict[str, Any], token: str,
              on_frontend: bool) -> Filter:
        """The filter of the verb's answer for this caller; ControlError where it may not
        call, LookupError (not found) for a model it may not see. ``args`` is the call's
        own copy: the key is taken out of it, so no verb sees one."""
        key = args.pop("api_key", None)
        if not on_frontend or not self.tenancy.enabled or verb in OPEN:
            return _unchanged
        if key is None and self._token and hmac.compare_digest(token.encode(),
                                                               self._token.encode()):
            return _unchanged
        if verb not in SCOPED:
            if not self._token:
                return _unchanged
            raise ControlError("unauthorized", f"{verb!r} is the operator's: with a tenants "
                             "file it needs the admin token (ZEROSERVE_ADMIN_TOKEN)")
        who = self.tenancy.caller(key if isinstance(key, str) else "")
        if isinstance(who, Refusal):
            raise ControlError(who.code.value, who.message)
        model = args.get("model")
        if isinstance(model, str) and not who.allows(model):
            raise LookupError(wording.unknown_model(model))
        return lambda result: _visible(verb, who, result)


def _visible(verb: str, tenant: Tenant, result: Any) -> Any:
    """A listing with only the tenant's models."""
    if verb == "whoami":
        return {"tenant": tenant.name}
    if tenant.models is None:
        return result
    if verb == "stats" and isinstance(result, dict):
        return {**result, "model_stats": [s for s in result.get("model_stats", [])
                                          if tenant.allows(s.get("name", ""))]}
    if verb == "repository_index" and isinstance(result, list):
        return [e for e in result if tenant.allows(e.get("name", ""))]
    return result
