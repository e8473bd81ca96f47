"""systemd's readiness protocol (sd_notify) in pure Python.

A service started with ``Type=notify`` tells systemd how it is doing by
sending newline-separated ``KEY=value`` datagrams to the AF_UNIX socket
named in ``$NOTIFY_SOCKET``. A name starting with ``@`` is in the Linux
abstract namespace (the ``@`` stands for a leading NUL byte). Tessera sends:

- ``READY=1`` once a role can serve: the proxy when its HTTP listener is up,
  a worker when its model is loaded and the proxy acknowledged its
  registration. systemd holds back units ordered after it until then, and
  fails the start if it never comes within ``TimeoutStartSec``.
- ``STOPPING=1`` when a drain starts (SIGTERM), so ``systemctl status``
  shows the unit as deactivating while requests in flight finish.
- ``STATUS=...``, a one-line human-readable state shown by ``systemctl status``.
- ``WATCHDOG=1`` (``Watchdog``) while the unit sets ``WatchdogSec=``: a role's loop pets it each turn it makes
  progress, so a process whose loop hangs (a stuck step, a dead I/O thread, a blocked event loop) misses it and
  systemd kills and restarts it. systemd arms the watchdog once READY=1 came.

Outside systemd (no ``$NOTIFY_SOCKET``) every call is a no-op, so the same
code runs under ``tessera up``, the launch scripts and the tests.

Why this module reads the environment itself, unlike every other setting
(which the config loader reads): ``NOTIFY_SOCKET`` is not configuration an
operator chooses but a channel the service manager hands to the process it
started, like a file descriptor; it has no YAML or ``--set`` form, and
reading it where it is used keeps the loader free of a systemd-only field.
Sending never raises: a service manager that went away must not take the
role down with it, so failures are logged and reported as ``False``.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import time

log = logging.getLogger(__name__)

SOCKET_ENV = "NOTIFY_SOCKET"
WATCHDOG_ENV, WATCHDOG_PID_ENV = "WATCHDOG_USEC", "WATCHDOG_PID"


def notify(*fields: str) -> bool:
    """Send ``fields`` (e.g. ``"READY=1"``, ``"STATUS=serving"``) in one datagram.

    Returns True when a datagram went out, False when there is no service
    manager to tell or the send failed.
    """
    address = os.environ.get(SOCKET_ENV)
    if not address:
        return False
    for item in fields:
        if "=" not in item or "\n" in item:
            raise ValueError(f"sd_notify field {item!r} must be one KEY=value line")
    if address.startswith("@"):
        target = "\0" + address[1:]
    elif address.startswith("/"):
        target = address
    else:
        log.warning("ignoring %s=%r: neither a path nor an abstract socket name", SOCKET_ENV, address)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(target)
            sock.sendall("\n".join(fields).encode())
    except OSError as exc:
        log.warning("sd_notify to %s failed: %s", address, exc)
        return False
    return True


def ready(status: str) -> bool:
    return notify("READY=1", f"STATUS={status}")


def stopping(status: str) -> bool:
    return notify("STOPPING=1", f"STATUS={status}")


def watchdog_period() -> float | None:
    """The watchdog period systemd gave this process (``WATCHDOG_USEC``, for ``WATCHDOG_PID`` when that is set),
    in seconds; None when there is none (no ``WatchdogSec=``, or the variables are another process's)."""
    usec = os.environ.get(WATCHDOG_ENV, "")
    pid = os.environ.get(WATCHDOG_PID_ENV, "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1e6


class Watchdog:
    """Pets systemd's watchdog from a loop that calls ``pet`` every turn: at most four times a period, and only
    when the caller says the process is healthy (its other threads turn too). A no-op without a period."""

    def __init__(self, clock=time.monotonic) -> None:
        self.period = watchdog_period()
        self._clock = clock
        self._last = -math.inf

    def pet(self, healthy: bool = True) -> bool:
        """True when a WATCHDOG=1 went out."""
        if self.period is None or not healthy:
            return False
        now = self._clock()
        if now - self._last < self.period / 4:
            return False
        self._last = now
        return notify("WATCHDOG=1")
