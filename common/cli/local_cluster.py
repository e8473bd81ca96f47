"""One launcher for a local cluster: ``tessera up``, the benchmarks and the end-to-end tests all use it.

Each role runs as its own process, exactly as on separate hosts, started with
``python -m common.cli.main proxy|prefill|decode|both`` and ``--set``
overrides. Workers are stopped before the proxy, so that they can hand back
their requests to a live proxy. ``Supervisor`` restarts the processes that
exit on their own, with backoff (``tessera up`` and the fault-injection tests).
With ``proxy_processes`` > 1 the proxy is ``tessera proxy --processes N`` on the
one port (its own supervisor restarts a process that dies; ``proxy_children``
names them), sharing ``redis_url`` (``common.cli.local_redis``).
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, ClassVar

from common.config.base import ConfigError
from common.config.roles import ProxyConfig, WorkerConfig, has_field, split_override
from common.runtime.prometheus_text import samples

READY_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60
# Failures found in seconds and a small KV pool: what tests and benchmarks start with (``for_tests``); and the
# embedded model's name for the proxy's model, whatever directory that is: the tests' tiny models carry its tokenizer,
# and their clients ask for it by that name.
# local_prefill_threshold=0: the tests' short prompts go through a prefill worker and a KV pull, the path they
# exercise; tests of the derived default (-1) set it back (tests/e2e/test_kv_index.py).
# tenancy.queue_timeout_s=300: a test's burst (16-64 streams, faults among them) is load to serve, not to shed; on
# 2 cores of a first-generation Zen (AVX2, 2 GHz) some of its requests waited past the default 30 s for admission or
# a decode slot, and were dropped. Tests of the shedding set their own (tests/e2e/test_tenants.py).
TEST_PROXY_OVERRIDES = ("heartbeat_timeout_s=3", "served_model_name=SmolLM2-135M-Instruct", "local_prefill_threshold=0",
                        "tenancy.queue_timeout_s=300")
# engine.steps.calibration_s=0: no step-cost calibration at start (about 1.5 s a worker, serialized on shared cores);
# the tests of capacity set it back (tests/e2e/test_calibration.py).
# engine.cpu.huge_pages=false: the pool and the panels in 4 KB pages, which hold the same bytes; where faulting in a
# 2 MB page is slow (the development and CI machines, VMs whose host takes back free memory: 12 CPU-s a GiB), 2 MB
# pages cost each worker's start about 3 CPU-s for its 256 MiB pool; with the tests' engines in 4 KB pages too the
# suite went from 2,124 CPU-s to 1,790 (docs/benchmarks.md, "A worker's start"). The default's pages are tested in
# tests/unit/test_huge_pages.py.
TEST_WORKER_OVERRIDES = ("engine.kv_cache_memory_bytes=268435456", "heartbeat_interval_s=0.2",
                         "engine.steps.calibration_s=0", "engine.cpu.huge_pages=false")


_RECENT: set[int] = set()  # the ports free_port gave out last (_RECENT_ORDER), never given out again meanwhile
_RECENT_ORDER: deque[int] = deque()
RECENT_PORTS = 1024


def _remember(ports: range) -> None:
    for port in ports:
        _RECENT.add(port)
        _RECENT_ORDER.append(port)
    while len(_RECENT_ORDER) > RECENT_PORTS:
        _RECENT.discard(_RECENT_ORDER.popleft())


def free_port(span: int = 1) -> int:
    """A port free now (with the ``span - 1`` after it), below the kernel's ephemeral range, so that no socket another
    process binds to port 0 (a client's, gloo's or UCX's) takes it before the role that was given it binds it.
    ``TESSERA_FREE_PORTS=LOW-HIGH`` narrows the range: clusters started side by side (the test lanes,
    tests/conftest.py) each pick from their own, so that one never takes a port another picked but has not bound
    yet. Nor is a port given out again while it is among the last ``RECENT_PORTS`` this process gave out: two picks
    made before either binds (a cluster's ports) never collide."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    start, end = 10000, max(10001, low)
    band = os.environ.get("TESSERA_FREE_PORTS", "")
    if band:
        start, _, end_text = band.partition("-")
        start, end = int(start), int(end_text)
    for _ in range(200):
        port = random.randrange(start, max(start + 1, end - span + 1))
        if not _RECENT.isdisjoint(range(port, port + span)):
            continue  # given to a caller that may not have bound it yet (two picks of one cluster, say)
        if _bindable(range(port, port + span)):
            _remember(range(port, port + span))
            return port
    for _ in range(200):  # a crowded range: any free port(s)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if _bindable(range(port, port + span)):
            return port
    raise RuntimeError(f"found no {span} free port(s) in a row")


def _bindable(ports: range) -> bool:
    sockets = []
    try:
        for port in ports:
            sockets.append(socket.socket())
            sockets[-1].bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        for s in sockets:
            s.close()


@dataclass
class LocalCluster:
    model_dir: Path | str = "embedded"  # a model directory, or an embedded model name
    log_dir: Path | None = None  # None: the processes write to this process' terminal
    prefill: int = 1
    decode: int = 1
    both: int = 0
    transfer_backend: str = "zmq"
    dtype: str | None = None  # None: the config's default
    threads: int = 1  # torch threads per worker; 0: the machine's cores, split or time-shared (share_cores)
    share_cores: bool = True  # with threads=0 and several workers: each has every core, one step at a time
    proxy_overrides: list[str] = field(default_factory=list)
    worker_overrides: list[str] = field(default_factory=list)
    role_overrides: list[str] = field(default_factory=list)  # [ROLE:]KEY=VALUE, ROLE a role or a process name
    port: int = field(default_factory=free_port)
    worker_port: int = 0  # the proxy's worker socket (process i of proxy_processes: + i); 0: free ones
    proxy_processes: int = 1  # tessera proxy --processes N behind ``port`` (proxy.supervisor)
    redis_url: str = ""  # with proxy_processes > 1: the shared_state.redis_url they share (common.cli.local_redis)
    process_port: int = 0  # with proxy_processes > 1: process i's own port is this + i; 0: free ones
    own_session: bool = False  # start the processes in their own session (a terminal's Ctrl-C skips them)
    entry_module: str = "common.cli.main"  # what ``python -m`` runs for each role (tests wrap it)
    cwd: Path | None = None  # the processes' working directory (``python -m`` imports from there first)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)  # or what ``launch`` returns
    metrics_ports: dict[str, int] = field(default_factory=dict)  # worker name -> its /metrics port

    # How a process may start other than as a fresh ``python -m entry_module``: called with its arguments,
    # environment, log file and whether it gets its own session, it returns a handle with ``subprocess.Popen``'s
    # pid, poll, wait, returncode and signals, or None for a fresh interpreter. The test suite forks its clusters'
    # processes from one that has imported them already (tests/fork_server.py); None everywhere else.
    launch: ClassVar[Callable[[list[str], dict, IO | None, bool], object | None] | None] = None

    def __post_init__(self) -> None:
        self.worker_port = self.worker_port or free_port(self.proxy_processes)
        if self.proxy_processes > 1:
            self.process_port = self.process_port or free_port(self.proxy_processes)

    @classmethod
    def for_tests(cls, model_dir: Path | str, log_dir: Path | None = None, **options) -> "LocalCluster":
        cluster = cls(model_dir, log_dir, **options)
        # New lists: the caller's (one list may serve both sides) stay as they were.
        cluster.proxy_overrides = [*TEST_PROXY_OVERRIDES, *cluster.proxy_overrides]
        cluster.worker_overrides = [*TEST_WORKER_OVERRIDES, *cluster.worker_overrides]
        return cluster

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def proxy_urls(self) -> list[str]:
        """Each proxy process's own address (with one process, ``url``): its /metrics are that process's."""
        if self.proxy_processes == 1:
            return [self.url]
        return [f"http://127.0.0.1:{self.process_port + i}" for i in range(self.proxy_processes)]

    def proxy_children(self) -> dict[str, int]:
        """With ``proxy_processes`` > 1, ``proxy-I`` -> pid of each process the proxy's supervisor runs now (process
        I binds worker_port + I); with one, ``proxy`` -> its pid."""
        proxy = self.procs["proxy"]
        if self.proxy_processes == 1:
            return {"proxy": proxy.pid} if proxy.poll() is None else {}
        try:
            pids = Path(f"/proc/{proxy.pid}/task/{proxy.pid}/children").read_text().split()
        except OSError:
            return {}
        children = {}
        for pid in map(int, pids):
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue  # gone since
            binds = [a for a in args if a.startswith("worker_bind=")]
            if binds:  # the last one is the supervisor's, after the command's own
                children[f"proxy-{int(binds[-1].rpartition(':')[2]) - self.worker_port}"] = pid
        return children

    @property
    def core_share_file(self) -> Path:
        return Path(tempfile.gettempdir()) / f"tessera-cores-{self.worker_port}"

    @property
    def num_workers(self) -> int:
        return self.prefill + self.decode + self.both

    def start(self, timeout: float = READY_TIMEOUT_S) -> "LocalCluster":
        """Starts every process and waits until the cluster is ready; one that fails to come up stops the rest
        before the error propagates (no process outlives a cluster that never started)."""
        try:
            self.start_proxy()
            for role, count in (("prefill", self.prefill), ("decode", self.decode), ("both", self.both)):
                for i in range(count):
                    self.start_worker(role, i)
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_proxy(self) -> None:
        """Start the proxy on this cluster's ports; once more after it died, it starts knowing no worker."""
        args = ["proxy", "--set", f"port={self.port}", "--set", f"worker_bind=tcp://127.0.0.1:{self.worker_port}",
                "--set", f"model={self.model_dir}"]
        if self.proxy_processes > 1:
            args += ["--processes", str(self.proxy_processes), "--set", f"http.process_port={self.process_port}"]
            if self.redis_url:
                args += ["--set", f"shared_state.redis_url={self.redis_url}"]
        if self.dtype:
            args += ["--set", f"dtype={self.dtype}"]
        self._spawn("proxy", args + self._overrides("proxy", self.proxy_overrides))

    def start_worker(self, role: str, index: int) -> str:
        name = f"{role}-{index}"
        self.metrics_ports.setdefault(name, free_port())  # a restarted worker keeps its port
        cores = os.cpu_count() or 1
        shared = not self.threads and self.share_cores and self.num_workers > 1
        threads = self.threads or (cores if shared else max(1, cores // max(1, self.num_workers)))
        args = [role, "--set", f"worker_id={name}", "--set", f"observability.metrics_port={self.metrics_ports[name]}",
                "--set", "proxy_address=" + ",".join(f"tcp://127.0.0.1:{self.worker_port + i}"
                                                     for i in range(self.proxy_processes)),
                "--set", f"engine.model={self.model_dir}", "--set", f"engine.num_threads={threads}",
                "--set", f"transfer_backend={self.transfer_backend}"]
        if shared:  # common/runtime/core_share.py: one lock file per cluster
            args += ["--set", f"core_share={self.core_share_file}"]
        if self.dtype:
            args += ["--set", f"engine.dtype={self.dtype}"]
        self._spawn(name, args + self._overrides(name, self.worker_overrides))
        return name

    def _overrides(self, name: str, general: list[str]) -> list[str]:
        """``general``, then the ``role_overrides`` for process ``name``: those whose ROLE: prefix names its role
        or the process itself (``decode-0``), and those without a prefix where its config has the field."""
        pairs = list(general)
        config = ProxyConfig if name == "proxy" else WorkerConfig
        for item in self.role_overrides:
            role, key, raw = split_override(item)
            if role is None:
                if not has_field(ProxyConfig, key) and not has_field(WorkerConfig, key):
                    raise ConfigError(f"override {item!r}: no role's config has {key.split('.')[0]!r}")
                if has_field(config, key):
                    pairs.append(f"{key}={raw}")
            elif name == role or name.startswith(role + "-"):
                pairs.append(f"{key}={raw}")
        return [arg for pair in pairs for arg in ("--set", pair)]

    def _spawn(self, name: str, args: list[str]) -> None:
        log: IO | None = None
        if self.log_dir is not None:
            log = open(Path(self.log_dir) / f"{name}.log", "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        proc = None
        if self.launch is not None and self.entry_module == "common.cli.main" and self.cwd is None:
            proc = self.launch(args, env, log, self.own_session)
        self.procs[name] = proc or subprocess.Popen(
            [sys.executable, "-m", self.entry_module, *args], stdout=log, stderr=subprocess.STDOUT if log else None,
            env=env, start_new_session=self.own_session, cwd=self.cwd,
        )
        if log is not None:
            log.close()  # the child holds its own descriptor

    def restart(self, name: str) -> None:
        """Start process ``name`` (``proxy`` or ``ROLE-INDEX``) again after it exited."""
        self.procs.pop(name, None)
        if name == "proxy":
            self.start_proxy()
        else:
            role, _, index = name.rpartition("-")
            self.start_worker(role, int(index))

    def worker_url(self, name: str) -> str:
        """Where worker ``name`` serves /metrics, /healthz and /readyz."""
        return f"http://127.0.0.1:{self.metrics_ports[name]}"

    def get(self, path: str, base: str | None = None) -> tuple[int, str]:
        try:
            with urllib.request.urlopen((base or self.url) + path, timeout=10) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def dead(self) -> dict[str, int]:
        """Processes that exited, with their exit codes."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def wait_ready(self, timeout: float = READY_TIMEOUT_S, stopping=lambda: False) -> None:
        """Until /readyz answers 200 and the proxy (each process of it) counts every worker; raises when a process
        exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stopping():
            if dead := self.dead():
                where = f"; logs in {self.log_dir}" if self.log_dir else ""
                raise RuntimeError(f"cluster processes exited: {dead}{where}")
            try:
                if all(self.get("/readyz", base)[0] == 200 and sum(
                        self.metric("tessera_proxy_workers_alive", base).values()) >= self.num_workers
                       for base in self.proxy_urls):
                    return
            except OSError:
                pass
            time.sleep(0.3)
        if not stopping():
            raise TimeoutError(f"cluster not ready in {timeout}s" + (f"; logs in {self.log_dir}" if self.log_dir else ""))

    def metric(self, name: str, base: str | None = None) -> dict[str, float]:
        """Samples of one Prometheus metric on the proxy (or at ``base``), keyed by their label string."""
        return samples(self.get("/metrics", base)[1], name)

    def stop_worker(self, name: str, timeout: float = STOP_TIMEOUT_S) -> int:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=timeout)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> dict[str, int]:
        """SIGTERM to the workers, then the proxy; each gets ``timeout`` seconds to drain before it is killed."""
        order = [n for n in self.procs if n != "proxy"] + [n for n in self.procs if n == "proxy"]
        for name in order:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        codes = {}
        deadline = time.monotonic() + timeout
        for name in order:
            proc = self.procs[name]
            try:
                codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        self.procs.clear()
        self.core_share_file.unlink(missing_ok=True)
        return codes


@dataclass
class Supervisor:
    """Restarts the processes of ``cluster`` that exit on their own, each after a backoff of its own.

    The first restart of a process waits ``backoff_s``, each next one twice as long, up to
    ``max_backoff_s``; a process that then runs ``stable_s`` without exiting starts over at ``backoff_s``.
    A restarted worker registers under a new epoch, and a restarted proxy is rejoined by the workers.
    ``check`` is called from the owner's loop; it returns a line for each thing it did.
    """
    cluster: LocalCluster
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 60.0
    restarts: dict[str, int] = field(default_factory=dict)
    _delay: dict[str, float] = field(default_factory=dict)
    _due: dict[str, float] = field(default_factory=dict)
    _started: dict[str, float] = field(default_factory=dict)

    def check(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        lines = []
        for name, code in self.cluster.dead().items():
            if name not in self._due:
                ran = now - self._started.get(name, float("-inf"))
                delay = self.backoff_s if ran >= self.stable_s else min(
                    self._delay.get(name, self.backoff_s / 2) * 2, self.max_backoff_s)
                self._delay[name] = delay
                self._due[name] = now + delay
                lines.append(f"{name} exited with code {code}; restarting it in {delay:g}s")
            elif now >= self._due[name]:
                del self._due[name]
                self.cluster.restart(name)
                self._started[name] = now
                self.restarts[name] = self.restarts.get(name, 0) + 1
                lines.append(f"{name} restarted (restart {self.restarts[name]})")
        return lines


def post_json(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
