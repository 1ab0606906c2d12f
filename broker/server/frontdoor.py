"""The clients' side of the broker: the frontend and control sockets' messages handed
to the request path's intake and to the control verbs. A message that cannot be used but
names its requests (or its control call) answers each of them with what is wrong."""

from __future__ import annotations

import logging
from typing import Any, Callable

from zeroserve.broker import protocol as p
from zeroserve.broker.server.answering import Answering
from zeroserve.broker.server.control import ControlTable
from zeroserve.broker.server.extverbs import ExtensionVerbs
from zeroserve.broker.server.intake import Intake
from zeroserve.broker.server.replicas import Replicas
from zeroserve.broker.server.stopping import StopState
from zeroserve.broker.server.types import Send

logger = logging.getLogger(__name__)


class FrontDoor:
    def __init__(self, limits: p.Limits, control_limits: p.Limits, to_client: Send,
                 to_controller: Send, intake: Intake, answering: Answering,
                 replicas: Replicas, control: ControlTable, extensions: ExtensionVerbs,
                 stop: StopState, clock: Callable[[], float]) -> None:
        self.limits = limits
        self.control_limits = control_limits
        self._to_client = to_client
        self._to_controller = to_controller
        self.intake = intake
        self.answering = answering
        self.replicas = replicas     # offered load, counted as it arrives
        self.control = control
        self.extensions = extensions
        self.stop = stop
        self.clock = clock

    def on_frontend(self, client: bytes, frames: list[Any]) -> None:
        """A client's message. One that cannot be used but names its requests (or its
        control call) answers each of them with what is wrong, then counts as malformed."""
        try:
            self._on_frontend(client, frames)
        except (p.Refused, p.VersionMismatch) as exc:   # the latter: say which we speak
            ids = exc.ids if isinstance(exc, p.Refused) else p.ids_of(exc.header)
            code = exc.code if isinstance(exc, p.Refused) else p.ErrorCode.BAD_INPUT
            if bytes(frames[0]) == p.Kind.CONTROL.value:   # answered as the call expects
                for call_id in ids:
                    self._to_client(client, p.encode(p.ControlReply(
                        call_id, False, code=code.value, error=str(exc)[:500])))
            else:
                self.answering.refuse_ids(client, ids, code, str(exc))
            raise

    def _on_frontend(self, client: bytes, frames: list[Any]) -> None:
        kind, header, bufs = p.unpack(frames, self.limits)
        if kind is p.Kind.REQUEST or kind is p.Kind.REQUESTS:
            if kind is p.Kind.REQUEST:
                self.replicas.arrived(header.get("model"))   # offered load, refused or not
                self.intake.on_request(client, header, bufs, self.clock())
            else:
                parts = header.get("requests")
                for part in parts if isinstance(parts, list) else ():
                    self.replicas.arrived(part.get("model") if isinstance(part, dict) else None)
                self.intake.on_requests(client, header, bufs, self.clock())
        elif kind is p.Kind.CANCEL:
            self.intake.on_cancel(client, p.decode(p.Cancel, header).request_id)
        elif kind is p.Kind.PING:
            self._to_client(client, p.encode(self.extensions.pong()))
        elif kind is p.Kind.CONTROL:
            msg = self._control_request(header, lambda f: self._to_client(client, f))
            if msg.verb == "draining":
                self._client_draining(client)
            self._to_client(client, self.control.handle(msg, on_frontend=True))
        else:
            raise p.ProtocolError(f"unexpected kind {kind.name} on the frontend")

    def _client_draining(self, client: bytes) -> None:
        """A gateway stopping: what it forwards from now on comes from connections opened
        before its signal, which a stopping broker still takes. It says so on the socket
        its requests use, so the notice precedes them."""
        self.stop.client_draining(client)
        logger.info("a gateway drains its open connections; its requests stay admitted")

    def client_gone(self, client: bytes) -> None:
        self.stop.client_gone(client)
        withdrawn = self.intake.client_gone(client)
        if withdrawn:
            logger.info("a client went away; %d queued request(s) withdrawn", withdrawn)

    def on_control(self, client: bytes, frames: list[Any]) -> None:
        def answer(reply: list[Any]) -> None:
            self._to_controller(client, reply)
        try:
            kind, header, _ = p.unpack(frames, self.control_limits)
        except (p.Refused, p.VersionMismatch) as exc:
            ids = exc.ids if isinstance(exc, p.Refused) else p.ids_of(exc.header)
            code = exc.code if isinstance(exc, p.Refused) else p.ErrorCode.BAD_INPUT
            for call_id in ids:
                answer(p.encode(p.ControlReply(call_id, False, code=code.value,
                                               error=str(exc)[:500])))
            raise
        if kind is p.Kind.PING:  # a long-lived controller (the gateway) watching us
            answer(p.encode(self.extensions.pong()))
            return
        if kind is not p.Kind.CONTROL:
            raise p.ProtocolError(f"unexpected kind {kind.name} on the control socket")
        answer(self.control.handle(self._control_request(header, answer), on_frontend=False))

    @staticmethod
    def _control_request(header: dict[str, Any],
                         answer: Callable[[list[Any]], Any]) -> p.ControlRequest:
        """The call, or (a field of the wrong type) its error answered when it has an id."""
        try:
            msg: p.ControlRequest = p.decode(p.ControlRequest, header)
            return msg
        except p.ProtocolError as exc:
            call_id = p.request_id_of(header)
            if call_id is not None:
                answer(p.encode(p.ControlReply(call_id, False, code="bad_input",
                                               error=str(exc)[:500])))
            raise
