"""The one inference path of the gateway: every entry point (HTTP v2 infer, gRPC
ModelInfer and ModelStreamInfer, generate and generate_stream, the seed's predict and
TorchServe's predictions) goes through the same :class:`InferencePath`, in the same
order, so a flood meets the same door wherever it comes in:

1. ``enter()`` at once, before anything of the request is read: the door
   (gateway/door.py) sheds past the in-flight bound or far behind (503 with
   Retry-After, gRPC UNAVAILABLE), else counts the request in flight until its
   ``leave()`` (in a ``finally``) and gives its arrival, which its deadline counts
   from;
2. ``caller(headers)``: the tenant gate (with tenants, 401 without a key);
3. once priority and deadline are known, :meth:`~InferencePath.check_priority` (the
   lag shed of the lower priorities) and :meth:`~InferencePath.budget_ms` (what is left
   of the deadline, 504 when it ran out in the gateway; both counted in
   ``zeroserve_gateway_shed_total``);
4. the trace (:meth:`~InferencePath.trace` ... :meth:`~InferencePath.finish`), the
   broker call (``infer``, ``stream``: the client's own) and the
   answer's classification (:meth:`~InferencePath.classify`).

Shed and refused requests are errors of the table (gateway/errors.py), so each front
end answers them as it answers the broker's. Nothing else counts requests in flight.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable, Mapping, Sequence

from zeroserve.broker import protocol as p
from zeroserve.broker.client import AsyncClient, InferError
from zeroserve.broker.protocol import ErrorCode
from zeroserve.gateway.classification import classify
from zeroserve.gateway.door import SHED_DEADLINE, Door, Shed
from zeroserve.gateway.tenantgate import TenantGate
from zeroserve.gateway.tracing import Trace, Tracer

__all__ = ["InferencePath", "Shed", "as_caller", "routing_key"]

ROUTING_HEADER = "x-routing-key"   # also gRPC metadata; a v2 parameter "routing_key"

Control = Callable[..., Awaitable[Any]]


def as_caller(api_key: str | None) -> dict[str, str]:
    """A control call's args for a caller: its key, or none at all for the operator."""
    return {} if api_key is None else {"api_key": api_key}


def routing_key(headers: Mapping[str, str], params: Mapping[str, Any], api_key: str,
                peer: str) -> str:
    """What sticks a caller to one version of a model's traffic split: the
    ``X-Routing-Key`` header (gRPC metadata alike), else the ``routing_key`` parameter,
    else the API key, else the client's address (without its port, which changes with
    each connection)."""
    key = headers.get(ROUTING_HEADER) or params.get("routing_key")
    if isinstance(key, str) and key:
        return key
    return api_key or peer


def peer_host(peer: Any) -> str:
    """The host of an ASGI ``client`` pair or a gRPC peer (``ipv4:1.2.3.4:5``)."""
    if isinstance(peer, (tuple, list)) and peer:
        return str(peer[0])
    if isinstance(peer, str):
        return peer.rpartition(":")[0] or peer
    return ""


class InferencePath:
    def __init__(self, client: AsyncClient, control: Control, gate: TenantGate,
                 tracer: Tracer, shed_lag_ms: float = 50.0, max_in_flight: int = 2048
                 ) -> None:
        door = self._door = Door(shed_lag_ms, max_in_flight)
        self._control = control
        self._tracer = tracer
        # Bound once: an entry point calls the door, the gate and the client with no
        # layer (no call, no coroutine) between, as the HTTP infer path was measured.
        # enter: the request let in and counted in flight, its arrival returned (the
        # deadline's start), or Shed at once; every enter has one leave, in a finally.
        self.enter = door.admit
        self.leave = door.leave
        # the key the broker judges the caller by ("" for none, None for the operator);
        # with tenants, unauthorized at once without one
        self.caller = gate.caller
        # True: a caller without a key needs no caller() (the broker has no tenants)
        self.open_now = gate.open_now
        self.infer = client.infer_tensors
        self.infer_rows = client.infer_rows   # the inputs of one request, rows of the batcher
        self.stream = client.stream

    def start(self) -> None:
        """In the lifespan: the door's lag ticks on the serving loop."""
        self._door.start()

    def stop(self) -> None:
        self._door.stop()

    # -- the door --------------------------------------------------------------
    def check_priority(self, priority: int, deadline: bool) -> None:
        """Once the header is parsed, before the tensors are decoded: behind, a request
        with a deadline below the highest priority is shed (Shed)."""
        why = self._door.refuse_priority(priority, deadline)
        if why is not None:
            raise Shed(why)

    @staticmethod
    def budget_ms(timeout_ms: float, accepted: float,
                  call_remaining_s: float | None = None) -> float:
        """What is left of the request's budget (``timeout_ms``, and a call's own
        deadline ``call_remaining_s`` counted from now, whichever ends first), 0 for
        none; InferError(deadline) when it ran out in the gateway."""
        if not timeout_ms and call_remaining_s is None:
            return 0.0
        spent_ms = (time.monotonic() - accepted) * 1000.0
        limit_ms = timeout_ms if timeout_ms else float("inf")
        if call_remaining_s is not None:   # counted from now: moved back to the arrival
            limit_ms = min(limit_ms, call_remaining_s * 1000.0 + spent_ms)
        left = limit_ms - spent_ms
        if left <= 0:
            SHED_DEADLINE.inc()
            raise InferError(ErrorCode.DEADLINE, "deadline exceeded in the gateway, before "
                             "the request reached the broker")
        return left

    # -- the trace -------------------------------------------------------------
    def trace(self, model: str, headers: Mapping[str, str],
              first_stamp: str = "HTTP_RECV_START") -> Trace | None:
        """A Trace if this request is sampled (stamped ``first_stamp``), else None."""
        if not self._tracer.active:
            return None
        return self._tracer.begin(model, headers.get("traceparent"),
                                  headers.get("tracestate"), first_stamp)

    def trace_stream(self, model: str, headers: Mapping[str, str],
                     first_stamp: str) -> Trace | None:
        return self._tracer.begin_stream(model, headers.get("traceparent"),
                                         headers.get("tracestate"), first_stamp)

    def finish(self, trace: Trace, reply: p.InferReply | None, sent_ns: int,
               received_ns: int, request_id: str, inputs: Sequence[p.Tensor] = (),
               outputs: Sequence[p.Tensor] = (), error: str = "") -> None:
        self._tracer.finish(trace, reply, sent_ns, received_ns, request_id, inputs,
                            outputs, error)

    def finish_stream(self, trace: Trace | None, error: str = "") -> None:
        if trace is not None:
            self._tracer.finish_stream(trace, error)

    # -- the answer ------------------------------------------------------------
    async def classify(self, model: str, version: int, tensors: list[p.Tensor],
                       counts: dict[str, int], api_key: str | None = None) -> list[p.Tensor]:
        """The top N of each output that asks for it. The model's metadata says
        whether dimension 0 is the batch, and (once the broker sends them) its labels."""
        meta = await self._control("metadata", model=model, version=version,
                                   **as_caller(api_key))
        batched = int(meta.get("max_batch_size") or 0) > 0
        labels = meta.get("labels")
        return [classify(t, counts[t.meta.name], batched, labels)
                if t.meta.name in counts else t for t in tensors]
