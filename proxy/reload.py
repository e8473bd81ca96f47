"""Reloading the proxy's tenant settings from its config file, on SIGHUP or when the file changes.

``ConfigSource`` is where the running config came from: the ``--config``
file and the ``--set`` overrides of the command line. ``ConfigReloader`` runs
in the app's lifespan: SIGHUP (``loop.add_signal_handler``; uvicorn leaves
that signal alone) asks for a reload, and every ``config_watch_interval_s``
the file's identity is checked (device, inode, size, modification time, so
that a file renamed over it, as editors and Kubernetes' ConfigMap volumes do,
counts). A change is read once the file has held still for one check, so
that a writer that is not atomic is not read halfway. A reload:

    read the file and apply the same overrides (a thread: ``load_config``, as at start-up)
      -> it does not load or validate: the error, naming the field, is logged;
         config_reloads{result="error"}; the running settings stay
      -> it does: the fields only a restart applies that differ are logged as such and keep
         their running values; the tenant settings (``LIVE_FIELDS``) replace the running ones
         (``Cluster.apply_tenants``); config_reloads{result="ok"}

The replacement happens on the event loop, between two handlers, in one
assignment: a request sees the old settings or the new, never a mix, and one
that already started keeps its ``Tenant`` (``proxy.tenancy.tenants``). Nothing on a
request's path calls into this module.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass, field, replace

import yaml

from common.config.base import fields_of
from common.config.roles import ProxyConfig, load_config
from proxy.cluster.cluster import Cluster
from proxy.core.metrics import ProxyMetrics

log = logging.getLogger("tessera.proxy.reload")

# Who sends a request and what it may do: applied by a reload. Every other field needs a restart.
# The tenancy section's fields that a reload applies; every other field needs a restart.
LIVE_FIELDS = ("tenants", "default_tenant", "auth_enabled", "tenant_from_user_field")

FileIdentity = tuple[int, int, int, int] | None  # (device, inode, size, mtime in ns); None: no such file


@dataclass(frozen=True)
class ConfigSource:
    """The command line's config: its file (None: none) and its overrides, read again by a reload."""
    path: str | None
    overrides: dict = field(default_factory=dict)

    def load(self) -> ProxyConfig:
        return load_config(ProxyConfig, self.path, self.overrides)

    def identity(self) -> FileIdentity:
        if self.path is None:
            return None
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


class ConfigReloader:
    def __init__(self, source: ConfigSource, running: ProxyConfig, cluster: Cluster, metrics: ProxyMetrics) -> None:
        """``running``: the config the process started with."""
        self.source = source
        self._running = running  # with the tenant settings of the last reload
        self._cluster = cluster
        self._metrics = metrics
        self._watch_s = running.tenancy.config_watch_interval_s if source.path else 0.0
        self._hangup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._loaded = source.identity()  # the file's identity when it was last read

    def start(self) -> None:
        """SIGHUP reloads from now on, and the file is watched (``config_watch_interval_s``)."""
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._hangup.set)
        except (RuntimeError, ValueError) as exc:  # not the main thread's loop
            log.warning("SIGHUP will not reload the config: %s", exc)
        self._task = asyncio.create_task(self._run(), name="config-reload")

    def stop(self) -> None:
        """No more reloads. The SIGHUP handler stays until the loop closes: a SIGHUP during the rest of the
        shutdown does nothing, where the signal's default action would end the process before its last
        metering record."""
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        pending: list[FileIdentity] = []  # a change seen at the last check, read once the file holds still
        while True:
            try:
                async with asyncio.timeout(self._watch_s or None):
                    await self._hangup.wait()
                self._hangup.clear()
                reason = "SIGHUP"
            except TimeoutError:
                seen = self.source.identity()
                if seen == self._loaded or pending != [seen]:
                    pending = [] if seen == self._loaded else [seen]
                    continue
                reason = "the config file changed"
            pending, self._loaded = [], self.source.identity()  # a write from here on is a change again
            await self.reload(reason)

    async def reload(self, reason: str) -> bool:
        """Read the config again and apply its tenant settings; False (logged, counted) when it does not load."""
        running = self._running
        try:
            new = await asyncio.to_thread(self.source.load)
            live = {name: getattr(new.tenancy, name) for name in LIVE_FIELDS}
            applied = replace(running, tenancy=replace(running.tenancy, **live))  # validated again
        except (ValueError, OSError, yaml.YAMLError) as exc:  # ConfigError is a ValueError
            self._metrics.config_reloads.labels("error").inc()
            log.error("config reload (%s) failed, the running settings stay: %s", reason, exc)
            return False
        restart = [name for name in fields_of(ProxyConfig)
                   if name != "tenancy" and getattr(new, name) != getattr(running, name)]
        restart += [f"tenancy.{name}" for name in fields_of(type(running.tenancy))
                    if name not in LIVE_FIELDS and getattr(new.tenancy, name) != getattr(running.tenancy, name)]
        if restart:
            log.warning("config reload (%s): the file changes %s, which needs a restart; the running values stay",
                        reason, ", ".join(restart))
        self._cluster.apply_tenants(applied)
        self._running = applied
        self._metrics.config_reloads.labels("ok").inc()
        log.info("config reloaded (%s): %s", reason, _changes(running, new) or "the tenant settings are the same")
        return True


def _changes(old: ProxyConfig, new: ProxyConfig) -> str:
    """What a reload changes in the tenant settings, in words (tenant names, never keys)."""
    before, after = {t.name: t for t in old.tenancy.tenants}, {t.name: t for t in new.tenancy.tenants}
    parts = [f"tenants {what}: {', '.join(sorted(names))}" for what, names in (
        ("added", after.keys() - before.keys()), ("removed", before.keys() - after.keys()),
        ("changed", {n for n in after.keys() & before.keys() if after[n] != before[n]})) if names]
    parts += [f"{name} {getattr(old.tenancy, name)!r} -> {getattr(new.tenancy, name)!r}" for name in LIVE_FIELDS[1:]
              if getattr(old.tenancy, name) != getattr(new.tenancy, name)]
    return "; ".join(parts)
