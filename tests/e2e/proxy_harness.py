"""Harness for the proxy tests: HTTP in front, scripted fake workers on real ZeroMQ DEALERs behind.

Each test starts its own proxy (uvicorn on uvloop in a thread, the ROUTER on
a free port) with the embedded model's tokenizer; the workers are
``tests.scripted_worker.FakeWorker``s that answer from a script of known text.
``ProxyProcess`` is the same proxy as its own ``tessera proxy`` process, for
what only a process has: its signals, its command line, its exit.
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from common.cli.local_cluster import free_port
from common.config.roles import ProxyConfig, merge
from common.text.tokenizer import Tokenizer
from common.protocol.wire import Abort, DecodeRequest, Peers, PrefillRequest, RegisterAck, ReleaseKV
from proxy.app import create_app
from tests.scripted_worker import FakeWorker
from proxy.edge.listener import listener_config
from proxy.server import DrainingServer
from tests.conditions import settle

MODEL = EMBEDDED = "SmolLM2-135M-Instruct"
SCRIPT_TEXT = " The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "user", "content": "Tell me about foxes."}]
# Bounds a wait for what a proxy does as soon as a message or a request reaches it (a registration, a Goodbye, an
# Abort handed on, a closed connection seen), so that a broken test fails rather than hangs; never a timing.
PATIENCE_S = 30.0
# heartbeat_timeout_s at its default bounds what crosses the worker link: a worker heartbeats well within it (or
# is dropped), and a proxy's send to a worker waits at most that long (the harness's proxies set less).
HEARTBEAT_TIMEOUT_S = ProxyConfig().heartbeat_timeout_s
STARTUP_S = 60.0  # bounds a ``tessera proxy`` process's imports and start-up on a busy 2-core machine
SLOW_TOKEN_INTERVAL_S = 0.05  # the slow cluster's decode worker: a token every this many seconds


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir) -> Tokenizer:
    return Tokenizer(embedded_model_dir)


def script_for(tokenizer: Tokenizer) -> list[tuple[int, str]]:
    """What the scripted workers answer: SCRIPT_TEXT, token by token, with each token's text."""
    ids = tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)
    texts = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    return [(t, texts[i + 1][len(texts[i]):]) for i, t in enumerate(ids)]


@pytest.fixture(scope="module")
def script(tokenizer) -> list[tuple[int, str]]:
    return script_for(tokenizer)


def proxy_config(model_dir, **overrides) -> ProxyConfig:
    # local_prefill_threshold=0: the scripted workers play the disaggregated flow; a test of local prefill sets it.
    settings = dict(model=str(model_dir), worker_bind="tcp://127.0.0.1:*", heartbeat_timeout_s=1.0,
                    local_prefill_threshold=0,
                    requests={"first_token_timeout_s": 20.0, "token_timeout_s": 20.0, "retry_after_s": 3},
                    http={"max_prompt_bytes": 4096})
    return ProxyConfig(**merge(settings, overrides))


class RunningProxy:
    def __init__(self, config: ProxyConfig, tokenizer: Tokenizer) -> None:
        self.app = create_app(config, tokenizer=tokenizer)
        self.services = self.app.state.services
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        scheme = "https" if config.security.tls_cert_file else "http"
        self.url = f"{scheme}://127.0.0.1:{listener.getsockname()[1]}"
        self.server = DrainingServer(listener_config(self.app, config, loop="uvloop", log_level="warning"),
                                     self.services.cluster, drain_timeout_s=5.0)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [listener]}, daemon=True)
        self.thread.start()
        settle(lambda: self.server.started, bool, PATIENCE_S, "the proxy's HTTP server starts")
        self.endpoint = self.services.link.endpoint
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def stop(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(15)


class ProxyProcess:
    """``tessera proxy`` as its own process: the in-process harness's settings as overrides, then ``settings``
    (``key=value``), over the YAML file ``config`` when one is given."""

    def __init__(self, model_dir, log_path: Path, settings: list[str] = (), config: Path | None = None) -> None:
        http_port, worker_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{http_port}"
        self.endpoint = f"tcp://127.0.0.1:{worker_port}"
        settings = [f"model={model_dir}", f"port={http_port}", f"worker_bind={self.endpoint}",
                    "heartbeat_timeout_s=1.0", "requests.first_token_timeout_s=20.0", "requests.token_timeout_s=20.0",
                    "http.max_prompt_bytes=4096", "requests.retry_after_s=3", "drain_timeout_s=5",
                    "local_prefill_threshold=0", *settings]
        self.log_path = log_path
        self._log = open(log_path, "w")
        args = [arg for setting in settings for arg in ("--set", setting)]
        if config is not None:
            args += ["--config", str(config)]
        self.proc = subprocess.Popen([sys.executable, "-m", "common.cli.main", "proxy", *args],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=30)
        settle(self._answers, bool, STARTUP_S, f"the proxy process answers /healthz (log: {log_path})")

    def _answers(self) -> bool:
        assert self.proc.poll() is None, f"the proxy exited with {self.proc.returncode}: {self.log()}"
        try:
            return self.http.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return open(self.log_path).read()[-4000:]

    def stop(self) -> int:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._log.close()


def wait_until(condition, timeout: float = 10.0, what: str = "the condition") -> None:
    """``settle`` for a yes/no condition, as test_openapi_fuzz.py still calls it; new waits call ``settle``."""
    settle(condition, bool, timeout, what)


@pytest.fixture
def make_proxy(tokenizer, embedded_model_dir):
    started: list[RunningProxy] = []

    def make(**overrides) -> RunningProxy:
        proxy = RunningProxy(proxy_config(embedded_model_dir, **overrides), tokenizer)
        started.append(proxy)
        return proxy

    yield make
    for proxy in started:
        proxy.stop()


@pytest.fixture
def make_worker(script):
    started: list[FakeWorker] = []

    def make(proxy: RunningProxy, worker_id: str, role: str, **options) -> FakeWorker:
        worker = FakeWorker(proxy.endpoint, worker_id, role, options.pop("script", script), **options)
        started.append(worker.start_and_wait())
        return worker

    yield make
    for worker in started:
        worker.stop(goodbye=False)


def ready(proxy) -> None:
    """Until the proxy answers /readyz with 200: its workers' registrations are in."""
    settle(lambda: proxy.http.get("/readyz").status_code, lambda status: status == 200, PATIENCE_S,
           "/readyz answers 200 once the workers registered")


def workers_of_every_proxy(proxies: list, script, workers: list, decode_slots: int = 0) -> FakeWorker:
    """A prefill and a decode worker (a token every 20 ms; ``decode_slots``: its max_num_seqs, 0: the default)
    registered with every one of ``proxies``, each ready; both appended to ``workers``; the decode worker."""
    address = ",".join(p.endpoint for p in proxies)
    prefill = FakeWorker(address, "p0", "prefill", script)
    decode = FakeWorker(address, "d0", "decode", script, token_interval_s=0.02)
    if decode_slots:
        decode.register_msg = msgspec.structs.replace(decode.register_msg, max_num_seqs=decode_slots)
    for worker in (prefill, decode):
        workers.append(worker.start())
        settle(lambda w=worker: w._worker is not None and w._worker.registered, bool, PATIENCE_S,
               f"{worker.worker_id} registers with every proxy")
    for proxy in proxies:
        ready(proxy)
    return decode


@pytest.fixture
def cluster(make_proxy, make_worker):
    """A proxy with one prefill and one decode worker, ready."""
    proxy = make_proxy()
    prefill = make_worker(proxy, "p0", "prefill")
    decode = make_worker(proxy, "d0", "decode")
    ready(proxy)
    return proxy, prefill, decode


@pytest.fixture
def slow_cluster(make_proxy, make_worker):
    """Makes a proxy (with the given settings) whose decode worker sends a token every 50 ms, so that a client
    can leave and come back mid-stream; returns it and its decode worker."""
    def make(**overrides):
        proxy = make_proxy(**overrides)
        make_worker(proxy, "p0", "prefill")
        decode = make_worker(proxy, "d0", "decode", token_interval_s=SLOW_TOKEN_INTERVAL_S)
        ready(proxy)
        return proxy, decode
    return make


def sse_payloads(raw: str) -> list[str]:
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events[:-1]]


def assert_openai_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error
    return error


@pytest.fixture
def two_versions(tmp_path, monkeypatch, embedded_model_dir, embedded_model_dir_bf16):
    """A model registry of the test's own (the proxy reads $TESSERA_CACHE_DIR's), holding two versions of the
    embedded model, v1 (promoted) and v2; scripted workers announce either with ``model_version``."""
    from common.storage.registry import ModelRegistry

    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    registry = ModelRegistry(tmp_path / "cache" / "registry")
    registry.register(embedded_model_dir, EMBEDDED, "v1")
    registry.register(embedded_model_dir_bf16, EMBEDDED, "v2")
    return registry
