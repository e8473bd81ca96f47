"""uvicorn's server with a drain in front of its shutdown.

The first SIGTERM or SIGINT starts a drain instead of stopping at once:
the cluster refuses new work (/readyz and new requests answer 503) while
the requests in flight run to completion, for up to ``drain_timeout_s``;
whatever is left then is cancelled (Abort to its workers). While another proxy
is up (``shared_state``: the live proxies at the last sync), the resumable
streams are not waited out but handed over at once: their workers keep them,
their clients' connections are cut, and the clients reconnect to another proxy,
which takes them over (``proxy.edge.takeover``). Only then does
uvicorn's own shutdown run: listeners close, connections finish, and the
app's lifespan closes the ZeroMQ socket before its context. A second
signal during the drain skips the rest of it; later ones are ignored (uvicorn's
force exit would skip the lifespan's shutdown, and with it the Aborts and the
socket's close), as its shutdown is bounded by ``timeout_graceful_shutdown``.
The handler only sets flags and schedules onto the loop: no lock is taken in
a signal handler, and the signal is not handed on to uvicorn, which would
raise it again once the server stopped and so turn a clean drain into a death
by SIGTERM (exit -15) or a KeyboardInterrupt.
Under systemd (``Type=notify``) the server reports READY=1 once it listens and
STOPPING=1 when the drain starts (``common.runtime.sd_notify``).
"""
from __future__ import annotations

import asyncio
import logging

import uvicorn

from common.runtime import sd_notify
from proxy.cluster.cluster import Cluster
from proxy.edge.resumable import StreamStore

log = logging.getLogger("tessera.proxy")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, cluster: Cluster, drain_timeout_s: float,
                 streams: StreamStore | None = None) -> None:
        super().__init__(config)
        self._cluster = cluster
        self._drain_timeout_s = drain_timeout_s
        self._streams = streams  # the resumable streams, handed over as it drains
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._drain_requested = False
        self._drain_cut = False  # a second signal: the requests still in flight are cancelled now
        self._watchdog_task: asyncio.Task | None = None  # held: the loop keeps only weak references to tasks

    async def startup(self, sockets=None) -> None:
        # Captured here, not in an overridden serve(): that coroutine would be resumed on every tick of
        # uvicorn's main loop for nothing.
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:  # uvicorn sets it once every listener is bound
            sd_notify.ready(f"proxy serving on {self.config.host}:{self.config.port}")
            watchdog = sd_notify.Watchdog()
            if watchdog.period is not None:
                self._watchdog_task = asyncio.create_task(self._pet(watchdog), name="watchdog")

    async def shutdown(self, sockets=None) -> None:
        if self._watchdog_task is not None:  # the drain is over: nothing left for the watchdog to watch
            self._watchdog_task.cancel()
        await super().shutdown(sockets)

    @staticmethod
    async def _pet(watchdog: sd_notify.Watchdog) -> None:
        """Pets systemd's watchdog from the event loop itself: a loop blocked past WatchdogSec misses it."""
        while True:
            watchdog.pet()
            await asyncio.sleep(watchdog.period / 4)

    def handle_exit(self, sig, frame) -> None:
        # Runs in the signal handler: plain assignments and call_soon_threadsafe (a deque append and a
        # wake-up write), never a lock or the loop's objects.
        if self._loop is None:
            self.should_exit = True
        elif not self._drain_requested:
            self._drain_requested = True
            self._loop.call_soon_threadsafe(self.start_drain)
        else:
            self._drain_cut = True

    def start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain(), name="drain")

    def _hand_over(self) -> None:
        """With another proxy up: the resumable streams whose clients hold their response ids are left to their
        workers for it to take over (``Cluster.hand_over_streams``), and their readers here cut."""
        cluster = self._cluster
        if self._streams is None or getattr(cluster.limits.share, "proxies", 0) <= 1:
            return
        handed = cluster.hand_over_streams(self._streams.streams.keys())
        if handed:
            log.info("draining: %d resumable stream(s) handed over for another proxy to take over", len(handed))
            self._streams.sever(handed)

    async def _drain(self) -> None:
        cluster = self._cluster
        cluster.start_draining()
        self._hand_over()
        sd_notify.stopping(f"draining {len(cluster.inflight)} request(s) for up to {self._drain_timeout_s}s")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._drain_timeout_s
        while cluster.inflight and loop.time() < deadline and not self._drain_cut:
            await asyncio.sleep(0.05)
            self._hand_over()  # a stream whose client got its response id since
        if cluster.inflight:
            why = "a second signal came" if self._drain_cut else f"drain timeout ({self._drain_timeout_s}s) reached"
            log.warning("%s: cancelling %d request(s) still in flight", why, len(cluster.inflight))
            cluster.cancel_all("the proxy is shutting down")
        self.should_exit = True
