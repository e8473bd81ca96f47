"""A local ``redis-server`` for proxies that share state on one machine: on a free port, nothing persisted, stopped
and started again on the same port (an outage). The benchmarks of several proxy processes and the tests of shared
state start it; a deployment runs its own Redis (``shared_state.redis_url``)."""
from __future__ import annotations

import shutil
import subprocess
import time

import redis

from common.cli.local_cluster import free_port

START_TIMEOUT_S = 10.0


def have_redis_server() -> bool:
    return shutil.which("redis-server") is not None


class RedisServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        """Start it (again) and wait until it answers a PING."""
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True)

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
