"""The metering file: each tenant's usage, appended as JSON lines every ``metering_interval_s``.

The numbers are the per-tenant counters of ``proxy.core.metrics``
(``ProxyMetrics.tenant_usage``), which a choice adds to once, when it ends;
this module only reads them back once per interval and writes the change.
Nothing on a request's path calls into it. Each interval, one line per
tenant whose usage changed, with the interval's amounts and the running
totals (docs/observability.md gives the record's fields):

    {"time": "2025-05-01T12:01:00.000+00:00", "unix_time": 1746100860.0,
     "interval_start": "...", "interval_end": "...", "tenant": "search",
     "requests": 3, "prompt_tokens": 120, "cached_prompt_tokens": 64, "generated_tokens": 90,
     "totals": {"requests": 41, ...}, "final": false}

One write per interval, in a thread (the event loop never waits on the
disk), to a file opened for that write: a file moved away by a log rotation
is created again. A write that fails is logged and its usage is carried into
the next record, whose interval then starts where the last written one
ended. At shutdown (``close``, from the app's lifespan after the drain) a
last record covers the interval cut short, marked ``"final": true``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from common.config.base import ConfigError
from proxy.core.daemon_executor import DaemonExecutor
from proxy.core.metrics import ProxyMetrics, TenantUsage

log = logging.getLogger("tessera.proxy.metering")


def check_path(path: str) -> None:
    """ConfigError naming ``metering_path`` when the proxy cannot append to it (found at start-up, not after an
    interval)."""
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ConfigError(f"config field 'metering_path' = {path!r}: cannot append to it: {exc}") from None


def _iso(unix_time: float) -> str:
    return datetime.fromtimestamp(unix_time, UTC).isoformat(timespec="milliseconds")


def records(before: dict[str, TenantUsage], after: dict[str, TenantUsage], start: float, end: float,
            final: bool = False) -> list[dict]:
    """One record per tenant whose usage changed from ``before`` to ``after`` (unix times ``start``, ``end``)."""
    out = []
    for tenant in sorted(after):
        totals = after[tenant]
        earlier = before.get(tenant, TenantUsage())
        change = {name: value - getattr(earlier, name) for name, value in dataclasses.asdict(totals).items()}
        if any(change.values()):
            out.append({"time": _iso(end), "unix_time": round(end, 3), "interval_start": _iso(start),
                        "interval_end": _iso(end), "tenant": tenant, **change,
                        "totals": dataclasses.asdict(totals), "final": final})
    return out


class MeteringLog:
    """Appends the usage records to ``path``; ``run`` is the interval loop, ``close`` its last record."""

    def __init__(self, path: str, interval_s: float, metrics: ProxyMetrics,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.interval_s = interval_s
        self._metrics = metrics
        self._clock = clock
        self._written = metrics.tenant_usage()  # the totals the file has accounted for
        self._written_at = clock()
        self._closing = asyncio.Event()
        self._files = DaemonExecutor("metering")  # a write stuck on the file system does not hold the proxy's exit

    async def run(self) -> None:
        """Every ``interval_s`` a record, until ``close``; then the final one."""
        loop = asyncio.get_running_loop()
        due = loop.time() + self.interval_s
        while True:
            try:
                async with asyncio.timeout_at(due):
                    await self._closing.wait()
            except TimeoutError:
                pass
            closing = self._closing.is_set()
            await self.flush(final=closing)
            if closing:
                self._files.shutdown()
                return
            due = max(due + self.interval_s, loop.time())

    def close(self) -> None:
        """Ask ``run`` for its last record; the caller awaits the task that runs it."""
        self._closing.set()

    async def flush(self, final: bool = False) -> None:
        """Append the usage since the last record that was written; on failure keep it for the next."""
        now, usage = self._clock(), self._metrics.tenant_usage()
        lines = records(self._written, usage, self._written_at, now, final)
        if lines:
            text = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines)
            try:
                await asyncio.get_running_loop().run_in_executor(self._files, self._append, text)
            except OSError as exc:
                log.error("could not append usage to metering_path %r (kept for the next record): %s",
                          str(self.path), exc)
                return
        self._written, self._written_at = usage, now

    def _append(self, text: str) -> None:
        with open(self.path, "a", encoding="utf-8") as file:
            file.write(text)
