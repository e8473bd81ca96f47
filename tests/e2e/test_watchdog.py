"""systemd's watchdog: a worker whose step loop hangs stops petting it, and under systemd is restarted.

A worker started as systemd starts a ``Type=notify`` unit with ``WatchdogSec=``: ``NOTIFY_SOCKET`` names a
datagram socket the test reads (with the sender's credentials, as systemd does), ``WATCHDOG_USEC`` the period.
The worker sends READY=1, then WATCHDOG=1 several times a period; a step that never returns
(``testing.fault_hang_token``) stops the pets while the worker's I/O thread goes on heartbeating, which is what
lets systemd tell a hung worker from a busy one. Where this machine runs systemd (PID 1) and the test runs as
root, the same worker runs as a transient unit (``systemd-run``) and systemd itself restarts it; elsewhere that
test skips with the reason.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from common.cli.local_cluster import LocalCluster
from tests import fork_server

HANG_TOKEN = 4242
PERIOD_S = 2.0


class NotifySocket:
    """systemd's side of sd_notify: datagrams with the sending process's pid (SO_PASSCRED)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)

    def receive(self, seconds: float) -> list[tuple[int, str]]:
        """Every (pid, datagram) for ``seconds``."""
        got, deadline = [], time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except TimeoutError:
                break
            pid = next((struct.unpack("iII", d[:12])[0] for level, kind, d in ancillary
                        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), 0)
            got.append((pid, data.decode()))
        return got


def hang_request(url: str) -> None:
    """A completion whose prompt holds the hang token, sent from a thread (it is never answered)."""
    def send():
        try:
            httpx.post(url + "/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": [1, HANG_TOKEN, 7],
                                                      "max_tokens": 4}, timeout=30)
        except httpx.HTTPError:
            pass
    threading.Thread(target=send, daemon=True).start()


def wait_for_log(path: Path, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert time.monotonic() < deadline, f"{path.name} never logged {text!r}"
        time.sleep(0.1)


def test_a_hung_step_stops_the_pets_while_the_io_thread_goes_on(tiny_chat_model_dir, tmp_path, monkeypatch):
    notify = NotifySocket(tmp_path / "notify.sock")
    c = LocalCluster.for_tests(tiny_chat_model_dir, tmp_path, prefill=0, decode=0, both=1,
                               role_overrides=[f"both:testing.fault_hang_token={HANG_TOKEN}"])
    try:
        c.start_proxy()
        with monkeypatch.context() as env:  # the worker alone is "under systemd"
            env.setenv("NOTIFY_SOCKET", str(notify.path))
            env.setenv("WATCHDOG_USEC", str(int(PERIOD_S * 1e6)))
            c.start_worker("both", 0)
        c.wait_ready()
        worker = c.procs["both-0"].pid
        first = notify.receive(3 * PERIOD_S)
        assert any(pid == worker and "READY=1" in text for pid, text in first), first
        pets = [t for pid, t in first if pid == worker and t == "WATCHDOG=1"]
        assert len(pets) >= 4, f"a healthy idle worker pets several times a period: {first}"
        hang_request(c.url)
        wait_for_log(tmp_path / "both-0.log", "this step hangs")
        notify.receive(PERIOD_S / 2)  # a pet already on its way
        after = notify.receive(2 * PERIOD_S)
        assert not [t for _, t in after if t == "WATCHDOG=1"], f"a hung worker went on petting: {after}"
        assert c.procs["both-0"].poll() is None
        beats = sum(c.metric("tessera_worker_heartbeats_sent_total", c.worker_url("both-0")).values())
        time.sleep(1.0)
        assert sum(c.metric("tessera_worker_heartbeats_sent_total", c.worker_url("both-0")).values()) > beats, \
            "the I/O thread stopped too: the watchdog would not be what tells hung from dead"
    finally:
        if c.procs.get("both-0") is not None and c.procs["both-0"].poll() is None:
            c.procs["both-0"].kill()
        c.stop()
        notify.sock.close()


def test_the_proxy_pets_from_its_event_loop_and_still_stops_cleanly(tiny_chat_model_dir, tmp_path, monkeypatch):
    notify = NotifySocket(tmp_path / "notify.sock")
    c = LocalCluster.for_tests(tiny_chat_model_dir, tmp_path, prefill=0, decode=0, both=0)
    try:
        with monkeypatch.context() as env:
            env.setenv("NOTIFY_SOCKET", str(notify.path))
            env.setenv("WATCHDOG_USEC", str(int(PERIOD_S * 1e6)))
            c.start_proxy()
        proxy = c.procs["proxy"].pid
        seen: list[tuple[int, str]] = []
        deadline = time.monotonic() + 60
        while len([t for pid, t in seen if pid == proxy and t == "WATCHDOG=1"]) < 4:
            assert time.monotonic() < deadline, f"the proxy sent {seen}"
            seen += notify.receive(0.5)
        assert any(pid == proxy and "READY=1" in text for pid, text in seen), seen
    finally:
        codes = c.stop()
        notify.sock.close()
    assert codes == {"proxy": 0}, codes


def _systemd_reason() -> str | None:
    if not Path("/run/systemd/system").is_dir():
        return "this machine does not run systemd (no /run/systemd/system): the socket-level test above stands in"
    if os.geteuid() != 0 or shutil.which("systemd-run") is None:
        return "a transient system unit needs root and systemd-run"
    return None


@pytest.mark.skipif(_systemd_reason() is not None, reason=_systemd_reason() or "")
def test_systemd_restarts_a_worker_whose_step_hangs(tiny_chat_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(fork_server.ENV, "0")  # a fresh interpreter: its command line is what systemd runs below
    c = LocalCluster.for_tests(tiny_chat_model_dir, tmp_path, prefill=0, decode=0, both=1,
                               role_overrides=[f"both:testing.fault_hang_token={HANG_TOKEN}"]).start()
    unit = f"tessera-watchdog-test-{os.getpid()}"
    try:
        # the same worker, now a unit of systemd's: its command line, cwd and environment
        proc = psutil.Process(c.procs["both-0"].pid)
        argv, cwd, environ = proc.cmdline(), proc.cwd(), proc.environ()
        c.procs["both-0"].send_signal(signal.SIGTERM)
        c.procs["both-0"].wait(timeout=60)
        kept = ("PATH", "HOME", "PYTHONPATH", "TESSERA_CACHE_DIR")
        sets = [f"--setenv={k}={v}" for k, v in environ.items() if k in kept]
        subprocess.run(["systemd-run", f"--unit={unit}", "-p", "Type=notify", "-p", "NotifyAccess=main",
                        "-p", f"WatchdogSec={int(PERIOD_S * 2)}", "-p", "Restart=on-failure", "-p", "RestartSec=1",
                        f"--working-directory={cwd}", *sets, *argv], check=True, timeout=120)

        def restarts() -> int:
            out = subprocess.run(["systemctl", "show", "-p", "NRestarts", "--value", unit], capture_output=True,
                                 text=True, check=True).stdout.strip()
            return int(out or 0)

        c.wait_ready()
        hang_request(c.url)
        deadline = time.monotonic() + 4 * PERIOD_S + 60
        while restarts() == 0:
            assert time.monotonic() < deadline, "systemd did not restart the hung worker"
            time.sleep(0.5)
    finally:
        subprocess.run(["systemctl", "stop", unit], capture_output=True, timeout=120)
        subprocess.run(["systemctl", "reset-failed", unit], capture_output=True, timeout=30)
        c.stop()
