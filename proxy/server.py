"""uvicorn's server with a drain in front of its shutdown.

The first SIGTERM or SIGINT starts a drain instead of stopping at once:
the cluster refuses new work (/readyz and new requests answer 503) while
the requests in flight run to completion, for up to ``drain_timeout_s``;
whatever is left then is cancelled (Abort to its workers). Only then does
uvicorn's own shutdown run: listeners close, connections finish, and the
app's lifespan closes the ZeroMQ socket before its context. A second
signal during the drain skips the rest of it, as uvicorn's second Ctrl-C does.
"""
from __future__ import annotations

import asyncio
import logging

import uvicorn

from proxy.cluster import Cluster

log = logging.getLogger("tessera.proxy")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, cluster: Cluster, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._cluster = cluster
        self._drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        # Runs in the signal handler: only schedule, never touch the loop's objects directly.
        if self._drain_task is not None or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self.start_drain)

    def start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain(), name="drain")

    async def _drain(self) -> None:
        cluster = self._cluster
        cluster.start_draining()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._drain_timeout_s
        while cluster.inflight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if cluster.inflight:
            log.warning("drain timeout (%ss) reached: cancelling %d request(s) still in flight",
                        self._drain_timeout_s, len(cluster.inflight))
            cluster.cancel_all("the proxy is shutting down")
        self.should_exit = True
