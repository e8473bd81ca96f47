"""The proxy's heartbeat watch (``Cluster.watch_heartbeats``): a turn that comes more than a turn late, because the
proxy's own process did not run, removes no worker (their heartbeats of that while are still unread); the next turn
checks, and of two such turns in a row the second checks."""
from __future__ import annotations

import asyncio
import logging
import time

from common.config.roles import ProxyConfig
from proxy.cluster.cluster import Cluster
from proxy.core.metrics import ProxyMetrics
from proxy.core.routing import PrefixAwareRouting

TIMEOUT_S = 2.0  # a turn every 0.5 s
STALL_S = 1.3  # the process stops this long: the next turn is more than a turn late


def watched(stalls: int) -> list[str]:
    """What the watch did from its first check on, when the process then stops (``time.sleep`` in the loop's thread,
    between two of the watch's turns) ``stalls`` times, each after the watch's last doing: its checks ("check"), its
    turns that waited ("late")."""
    cluster = Cluster(ProxyConfig(heartbeat_timeout_s=TIMEOUT_S), PrefixAwareRouting(), ProxyMetrics())
    events: list[str] = []

    class Late(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "did not run" in record.getMessage():
                events.append("late")

    cluster.expire_workers = lambda: events.append("check")
    handler = Late()
    log = logging.getLogger("tessera.proxy")
    log.addHandler(handler)

    async def main() -> None:
        watch = asyncio.create_task(cluster.watch_heartbeats())
        seen, left = 0, stalls
        while events.count("check") < 2:
            if len(events) > seen and events[0] == "check" and left:
                seen, left = len(events) + 1, left - 1
                events.append("stall")
                time.sleep(STALL_S)
            await asyncio.sleep(0.05)
        watch.cancel()

    try:
        asyncio.run(main())
    finally:
        log.removeHandler(handler)
    return events


def test_a_turn_after_the_proxy_stopped_waits_for_the_heartbeats_that_came_meanwhile():
    assert watched(stalls=1) == ["check", "stall", "late", "check"]


def test_of_two_late_turns_in_a_row_the_second_checks():
    assert watched(stalls=2) == ["check", "stall", "late", "stall", "check"]
