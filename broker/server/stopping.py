"""The broker's stop state: whether it stops (SIGTERM, or ``drain --all``), whether it
stops to exit, and which gateways are draining their open connections. The request
path asks it one question, :meth:`StopState.admits`; the broker alone changes it."""

from __future__ import annotations


class StopState:
    def __init__(self) -> None:
        self.stopping = False     # no new work from clients at large
        self.exiting = False      # stopping to exit, not only drained (drain --all)
        self._draining: set[bytes] = set()   # gateways draining their connections

    def admits(self, client: bytes) -> bool:
        """Whether a request from ``client`` may queue: always, until the broker stops;
        then only a draining gateway's, and only when the broker exits (its open
        connections were accepted before the signal)."""
        return not self.stopping or (self.exiting and client in self._draining)

    def halt(self) -> None:
        """Admit nothing new (SIGTERM, ``drain --all``)."""
        self.stopping = True

    def exit(self) -> None:
        """The stop is to exit: draining gateways' requests are still admitted."""
        self.exiting = True

    def resume(self) -> None:
        """``undrain --all``: admitting again (refused while exiting, by the caller)."""
        self.stopping = False

    def client_draining(self, client: bytes) -> None:
        self._draining.add(client)

    def client_gone(self, client: bytes) -> None:
        self._draining.discard(client)
