"""Start a real local cluster (proxy + workers as separate processes) for tests and benchmarks."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

READY_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    model_dir: Path
    log_dir: Path
    prefill: int = 1
    decode: int = 1
    both: int = 0
    transfer_backend: str = "zmq"
    proxy_overrides: list[str] = field(default_factory=list)
    worker_overrides: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    worker_port: int = field(default_factory=free_port)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)  # worker name -> its /metrics port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Cluster":
        self.start_proxy()
        for role, count in (("prefill", self.prefill), ("decode", self.decode), ("both", self.both)):
            for i in range(count):
                self.start_worker(role, i)
        self.wait_ready()
        return self

    def start_proxy(self) -> None:
        """Start the proxy on this cluster's ports; once more after it died, it starts knowing no worker."""
        self._spawn("proxy", ["proxy", "--set", f"port={self.port}",
                              "--set", f"worker_bind=tcp://127.0.0.1:{self.worker_port}",
                              "--set", f"model={self.model_dir}", "--set", "heartbeat_timeout_s=3"]
                    + [a for kv in self.proxy_overrides for a in ("--set", kv)])

    def start_worker(self, role: str, index: int) -> str:
        name = f"{role}-{index}"
        self.metrics_ports[name] = free_port()
        self._spawn(name, [role, "--set", f"worker_id={name}",
                           "--set", f"metrics_port={self.metrics_ports[name]}",
                           "--set", f"proxy_address=tcp://127.0.0.1:{self.worker_port}",
                           "--set", f"engine.model={self.model_dir}", "--set", "engine.num_threads=1",
                           "--set", "engine.kv_cache_memory_bytes=268435456",
                           "--set", f"transfer_backend={self.transfer_backend}",
                           "--set", "heartbeat_interval_s=0.2"]
                    + [a for kv in self.worker_overrides for a in ("--set", kv)])
        return name

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.log_dir / f"{name}.log", "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "common.cli.main", *args], stdout=log, stderr=subprocess.STDOUT, env=env,
        )

    def worker_url(self, name: str) -> str:
        """Where worker ``name`` serves /metrics, /healthz and /readyz."""
        return f"http://127.0.0.1:{self.metrics_ports[name]}"

    def get(self, path: str, base: str | None = None) -> tuple[int, str]:
        try:
            with urllib.request.urlopen((base or self.url) + path, timeout=10) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"cluster processes exited: {dead}; logs in {self.log_dir}")
            try:
                expected = self.prefill + self.decode + self.both
                alive = sum(self.metric("tessera_proxy_workers_alive").values())
                if self.get("/readyz")[0] == 200 and alive >= expected:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"cluster not ready in {timeout}s; logs in {self.log_dir}")

    def metric(self, name: str) -> dict[str, float]:
        """Samples of one Prometheus metric, keyed by their label string."""
        _, text = self.get("/metrics")
        out = {}
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                key, _, value = line.rpartition(" ")
                out[key[len(name):]] = float(value)
        return out

    def stop_worker(self, name: str, timeout: float = 60) -> int:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=timeout)

    def stop(self) -> dict[str, int]:
        codes = {}
        for name in [n for n in self.procs if n != "proxy"] + ["proxy"]:
            proc = self.procs.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                codes[name] = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        self.procs.clear()
        return codes


def post_json(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
