"""The one stop path, for SIGTERM and ``drain --all`` alike (that one without exiting):
no new work, everything accepted dispatched, workers that were signalled with the broker
kept at work until it is answered, and, when stopping, the exit once every accepted
request is answered or the drain bound passed."""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

from zeroserve.broker import protocol as p
from zeroserve.broker.process import Notifier
from zeroserve.broker.server.answering import Answering
from zeroserve.broker.server.ledger import AnswerLedger
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.pool import WorkerPool
from zeroserve.broker.server.scheduler import Scheduler
from zeroserve.broker.server.stopping import StopState

logger = logging.getLogger(__name__)


class Shutdown:
    def __init__(self, stop: StopState, pool: WorkerPool, scheduler: Scheduler,
                 ledger: AnswerLedger, answering: Answering, metrics: BrokerMetrics,
                 notifier: Notifier, clock: Callable[[], float], drain_timeout_s: float
                 ) -> None:
        self.stop = stop
        self.pool = pool
        self.scheduler = scheduler
        self.ledger = ledger
        self.answering = answering
        self.metrics = metrics
        self.notifier = notifier
        self.clock = clock
        self.drain_timeout_s = drain_timeout_s
        self._stop_requested = False
        self._exit_requested = False
        self.deadline = math.inf   # stopping: when what is left is answered 503

    def request_stop(self) -> None:
        """SIGTERM: stop admitting, finish what was accepted, then exit. Only sets flags:
        a signal handler may run in the middle of a tick, so the change itself happens
        at the next one (:meth:`begin`)."""
        self._exit_requested = self._stop_requested = True

    def begin(self) -> None:
        if not self._stop_requested:
            return
        self._stop_requested = False
        if self._exit_requested and not self.stop.exiting:
            self.stop.exit()
            self.deadline = self.clock() + self.drain_timeout_s
            self.notifier.stopping()
        if self.stop.stopping:
            return
        self.stop.halt()
        kept = [w for w in self.pool.workers.values() if w.exiting and not w.recycle]
        for worker in kept:  # signalled with us: they run our queue until it is done
            self.pool.keep(worker)
        logger.info("%s: %d request(s) to finish, %d leaving worker(s) kept until then",
                    "stopping" if self.stop.exiting else "draining all",
                    len(self.ledger), len(kept))

    def drain_all(self, _: dict[str, Any]) -> dict[str, Any]:
        self._stop_requested = True
        self.begin()
        return {"draining": True, "open_requests": len(self.ledger)}

    def undrain_all(self, _: dict[str, Any]) -> dict[str, Any]:
        if self.stop.exiting:
            raise LookupError("the broker is stopping and cannot be undrained")
        self.stop.resume()
        self.pool.drain_leavers()
        logger.info("undrained: admitting requests again")
        return {"draining": False, "open_requests": len(self.ledger)}

    def next_due(self) -> float | None:
        return self.deadline if self.stop.exiting else None

    def finished(self, now: float) -> bool:
        """Whether a stopping broker may exit: everything it accepted is answered, or the
        drain bound passed (what is left gets 503). Workers that stop too are told."""
        self.begin()
        if not self.stop.exiting or (len(self.ledger) and now < self.deadline):
            return False
        left = len(self.ledger)
        if left:
            self.metrics.shutdown_failed(left)
            logger.error("drain bound of %.0fs passed: %d request(s) answered 503",
                         self.drain_timeout_s, left)
        self.answering.fail_everything(p.ErrorCode.UNAVAILABLE, "broker is shutting down")
        for worker in list(self.pool.workers.values()):
            # a worker stopping with us exits on this; the others wait for the next broker
            self.pool.disconnect(worker.identity, p.DisconnectReason.BROKER_STOPPING)
        logger.info("every accepted request answered; releasing %d worker(s)",
                    len(self.pool.workers))
        return True

    def fail_unservable(self) -> None:
        """While stopping, queued work that no staying worker can take fails now."""
        if not self.stop.stopping:
            return
        for name in list(self.scheduler.models_waiting()):
            if not any(w.holds(name) and not w.draining for w in self.pool.workers.values()):
                self.answering.fail_queued(name, p.ErrorCode.UNAVAILABLE,
                                           "broker is shutting down and no worker can take "
                                           "this")
