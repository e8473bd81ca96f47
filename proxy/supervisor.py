"""``tessera proxy --processes N``: N proxy processes behind one HTTP port.

Each process is a whole proxy (its own event loop, worker socket and admission) listening on the same host:port
with SO_REUSEPORT, so the kernel spreads new connections over them. Process i binds its worker socket at
``worker_bind``'s port + i, and every worker lists all N in its ``proxy_address`` (comma-separated) to register
with each. What the processes must agree on is shared through ``redis_url`` (proxy/tenancy/shared_state.py); without it
each admits to 1/N of the decode slots (``decode_slot_share``) and keeps its own tenant counters and buckets, which
the supervisor says at start. A metering file gets one per process (``NAME-i.EXT``), and with ``process_port`` each
process also listens on a port of its own (that port + i), where /metrics is that process's.

The supervisor only starts, restarts and stops them: a process that exits while the supervisor is not stopping
is started again (after ``RESTART_DELAY_S``, doubling while it keeps failing at once; the supervisor goes on
answering signals meanwhile); SIGTERM or SIGINT is passed on to each, once, which drains (proxy.server), and the
supervisor waits for them for the drain timeout and a grace, then kills what is left; SIGHUP is passed on (a
config reload). The processes run in sessions of their own, so that a terminal's Ctrl-C is not delivered to them
twice; under systemd the unit's ``KillMode=mixed`` does the same for ``systemctl stop``. Under systemd
(``Type=notify``) the supervisor is the one that reports: READY=1 once it started the processes, STOPPING=1 when
it passes a stop on.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from common.config.roles import ProxyConfig
from common.runtime import sd_notify

log = logging.getLogger("tessera.proxy.supervisor")

RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 30.0
GRACE_S = 10.0


def child_overrides(config: ProxyConfig, index: int, count: int) -> list[str]:
    """The ``--set`` overrides process ``index`` of ``count`` runs with, after the user's own."""
    bind = urlsplit(config.worker_bind)
    if bind.port is None:
        raise ValueError(f"config field 'worker_bind' = {config.worker_bind!r}: --processes needs a tcp://HOST:PORT "
                         "address, process i binding PORT + i")
    host = bind.hostname if ":" not in (bind.hostname or "") else f"[{bind.hostname}]"
    sets = [f"worker_bind={bind.scheme}://{host}:{bind.port + index}",
            f"shared_state.proxy_id={config.shared_state.proxy_id or os.uname().nodename + ':' + str(config.port)}:{index}"]
    # without redis_url each process's share for good; with it, until its first sync
    sets.append(f"shared_state.decode_slot_share={config.shared_state.decode_slot_share / count!r}")
    if not config.shared_state.redis_url and index:  # one planner: process 0 (with Redis, the lease picks one)
        sets.append("planner.plan_here=false")
    if config.http.process_port:
        sets.append(f"http.process_port={config.http.process_port + index}")
    if config.tenancy.metering_path:
        path = Path(config.tenancy.metering_path)
        sets.append(f"tenancy.metering_path={path.with_name(f'{path.stem}-{index}{path.suffix}')}")
    return sets


def worker_addresses(config: ProxyConfig, count: int) -> str:
    """What the workers' ``proxy_address`` must list for ``count`` processes."""
    bind = urlsplit(config.worker_bind)
    host = "127.0.0.1" if bind.hostname in ("0.0.0.0", "*", "::") else bind.hostname
    return ",".join(f"{bind.scheme}://{host}:{bind.port + i}" for i in range(count))


def supervise(config: ProxyConfig, argv: list[str], count: int) -> int:
    """Run ``count`` proxies, each ``tessera proxy`` with ``argv`` (the command's own arguments, less --processes)
    and its ``child_overrides``, until a signal stops them; the exit status: 0 when each drained cleanly."""
    if not config.shared_state.redis_url:
        log.warning("--processes %d without shared_state.redis_url: each process admits to 1/%d of the decode slots and keeps its "
                    "own tenant counters and rate-limit buckets (a tenant's limit is per process)", count, count)
    log.info("%d proxy processes on %s:%d; workers connect with proxy_address=%s", count, config.host,
             config.port, worker_addresses(config, count))
    stopping: list[int] = []
    hup: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _: stopping.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _: stopping.append(signum))
    signal.signal(signal.SIGHUP, lambda signum, _: hup.append(signum))
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}  # the supervisor speaks to systemd

    def start(index: int) -> subprocess.Popen:
        sets = [arg for s in child_overrides(config, index, count) for arg in ("--set", s)]
        # a session of its own: a terminal's Ctrl-C reaches the supervisor alone, which passes one SIGTERM on (a
        # second signal would cut the process's drain short: proxy.server)
        return subprocess.Popen([sys.executable, "-m", "common.cli.main", "proxy", *argv, "--reuse-port", *sets],
                                env=env, start_new_session=True)

    children = [start(i) for i in range(count)]
    delays = [RESTART_DELAY_S] * count
    started = [time.monotonic()] * count
    due: dict[int, float] = {}  # process index -> when it starts again
    sd_notify.ready(f"{count} proxy processes on {config.host}:{config.port}")
    watchdog = sd_notify.Watchdog()  # this loop's own liveness; a child that exits is restarted below
    while not stopping:
        watchdog.pet()
        if hup:
            hup.clear()
            for child in children:
                child.send_signal(signal.SIGHUP)
        now = time.monotonic()
        for i, child in enumerate(children):
            if i in due:
                if now >= due[i]:
                    del due[i]
                    children[i], started[i] = start(i), now
            elif child.poll() is not None:
                quick = now - started[i] < MAX_RESTART_DELAY_S
                delays[i] = min(delays[i] * 2, MAX_RESTART_DELAY_S) if quick else RESTART_DELAY_S
                log.error("proxy process %d exited (status %s); starting it again in %.0fs", i, child.returncode,
                          delays[i])
                due[i] = now + delays[i]
        time.sleep(0.2)
    sd_notify.stopping(f"draining {count} proxy processes")
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + config.drain_timeout_s + GRACE_S
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("proxy process %d did not stop within drain_timeout_s + %.0fs: killing it", child.pid, GRACE_S)
            child.kill()
            child.wait()
    return 0 if all(child.returncode == 0 for child in children) else 1
