"""Five "hosts" on one machine, each a Linux network namespace, started by the launch scripts.

Topology: a bridge in the root namespace holds 10.77.N.1/24 (N is the first
subnet this machine does not use), so the test can reach the proxy; each host
is a namespace joined to the bridge by a veth pair whose inner end is
``eth0`` with the host's own address (proxy .10, prefill .11 .12, decode .21
.22), and ``lo`` up. Every role is started as on a real host: its launch
script (``deploy/launch/ROLE.sh``) under ``ip netns exec``, reading the host's
own env file. UCX is forced onto TCP over ``eth0`` (``UCX_TLS=tcp``,
``UCX_NET_DEVICES=eth0``): left alone it moves KV pages by cross-memory
attach, which ignores namespaces, and the test would prove nothing about the
network. Without NIXL the zmq backend is used, which is TCP anyway.

Checked, in order:
1. Every role tells its own sd_notify socket READY=1, as it would tell systemd.
2. Greedy outputs through the proxy equal the in-process engine's.
3. KV pages crossed the veths: the prefill hosts' eth0 sent, and the decode
   hosts' eth0 received, at least the bytes the proxy counted as pulled
   (``tessera_proxy_kv_transfer_bytes_total``), which are at least the KV
   bytes of the prompts.
4. With one prefill and one decode host's link cut, the proxy drops both after
   its heartbeat timeout and requests still succeed, on the survivors only.

Teardown stops every process, then deletes the namespaces (and with them the
veths) and the bridge, whether or not a check failed. Needs root and
``ip netns``; skips with the reason otherwise.
"""
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from common.cli.local_cluster import post_json
from common.runtime.prometheus_text import samples
from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.storage.model_store import default_cache_root
from common.protocol.sampling_params import SamplingParams
from kv_transfer.factory import default_backend_name
from tests.conditions import settle

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "deploy" / "launch"
HOSTS = {"proxy": 10, "prefill-0": 11, "prefill-1": 12, "decode-0": 21, "decode-1": 22}
HEARTBEAT_TIMEOUT_S = 2.0
READY_TIMEOUT_S = 300
STOP_TIMEOUT_S = 30
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 8
PROMPTS = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 7?",
           "Why is the sky blue?", "Write a haiku about the sea."]
BEFORE_CUT, AFTER_CUT = PROMPTS[:3], PROMPTS[3:]


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=check)


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (Debian package iproute2)"
    probe = f"tessera-probe-{secrets.token_hex(3)}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    try:  # inside the probe namespace, so a failure leaves nothing behind
        for what, args in (("a bridge", ("type", "bridge")), ("a veth pair", ("type", "veth", "peer", "name", "p1"))):
            made = _run("ip", "-n", probe, "link", "add", "p0", *args, check=False)
            if made.returncode != 0:
                return f"cannot create {what} here: {made.stderr.strip()}"
            _run("ip", "-n", probe, "link", "del", "p0")
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


class Network:
    """The bridge, the namespaces and their veths; ``destroy`` removes whatever was made."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(3)  # unique names: runs side by side never collide
        used = _run("ip", "-o", "-4", "addr").stdout + _run("ip", "-4", "route").stdout
        self.prefix = next(f"10.77.{n}" for n in range(256) if f"10.77.{n}." not in used)
        self.bridge = f"tsb{self.tag}"
        self.namespaces: dict[str, str] = {}
        self.outer: list[str] = []

    def address(self, host: str) -> str:
        return f"{self.prefix}.{HOSTS[host]}"

    def create(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, host in enumerate(HOSTS):
            ns = f"tessera-{self.tag}-{host}"
            _run("ip", "netns", "add", ns)
            self.namespaces[host] = ns
            outer, inner = f"ts{self.tag}h{i}", f"ts{self.tag}n{i}"
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            self.outer.append(outer)
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "link", "set", outer, "master", self.bridge, "up")
            _run("ip", "-n", ns, "link", "set", inner, "name", "eth0")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def eth0_bytes(self, host: str, direction: str) -> int:
        path = f"/sys/class/net/eth0/statistics/{direction}_bytes"
        return int(_run("ip", "netns", "exec", self.namespaces[host], "cat", path).stdout)

    def cut(self, host: str) -> None:
        _run("ip", "-n", self.namespaces[host], "link", "set", "eth0", "down")

    def destroy(self) -> None:
        for ns in self.namespaces.values():
            _run("ip", "netns", "del", ns, check=False)  # takes its veth end, and so the pair, with it
        for outer in self.outer:
            _run("ip", "link", "del", outer, check=False)  # a pair whose inner end never moved
        _run("ip", "link", "del", self.bridge, check=False)


def _env_file(path: Path, net: Network, host: str, model_dir: Path, backend: str) -> Path:
    settings = {
        "TESSERA_BIN": Path(sys.executable).with_name("tessera"), "TESSERA_CONFIG_DIR": ROOT / "configs" / "multi-node",
        "TESSERA_CACHE_DIR": default_cache_root(), "TESSERA_LOG_DIR": path.parent / "logs",
        "TESSERA_MODEL": model_dir, "TESSERA_DTYPE": "float32", "TESSERA_THREADS": 1,
        "TESSERA_PROXY_HOST": net.address("proxy"), "TESSERA_HOST_ADDRESS": net.address(host),
        "TESSERA_TRANSFER_BACKEND": backend, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0",
        # local_prefill_threshold=0: every prompt through a prefill host and a pull across the veths, the path under
        # test (with the derived default an idle decode host prefilled the short prompts itself on a slow CPU)
        "TESSERA_PROXY_SET": f'"heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S} requests.first_token_timeout_s=60 '
                             f'local_prefill_threshold=0"',
        "TESSERA_PREFILL_SET": '"heartbeat_interval_s=0.3 engine.kv_cache_memory_bytes=134217728"',
        "TESSERA_DECODE_SET": '"heartbeat_interval_s=0.3 kv_pull_timeout_s=20 '
                              'engine.kv_cache_memory_bytes=134217728"',
    }
    path.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))
    return path


class NotifySocket:
    """What systemd would see from one host: the sd_notify datagrams of its role."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.fields: list[str] = []

    def poll(self) -> list[str]:
        while True:
            try:
                self.fields += self.sock.recv(4096).decode().split("\n")
            except BlockingIOError:
                return self.fields


def _metric(url: str, name: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return samples(resp.read().decode(), name)


class Hosts:
    """One role per namespace, each started by its launch script from its own env file."""

    def __init__(self, net: Network, workdir: Path, model_dir: Path) -> None:
        self.net, self.workdir = net, workdir
        self.url = f"http://{net.address('proxy')}:8000"
        self.backend = default_backend_name()
        self.model_dir = model_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.notify: dict[str, NotifySocket] = {}

    def start(self) -> None:
        """Every host at once: on 2 cores each worker needs 10-20 s to load the model."""
        net, workdir = self.net, self.workdir
        for host in HOSTS:
            env_file = _env_file(workdir / f"{host}.env", net, host, self.model_dir, self.backend)
            self.notify[host] = NotifySocket(workdir / f"{host}.notify")
            clean = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "UCX_", "NOTIFY_"))}
            env = {**clean, "NOTIFY_SOCKET": str(self.notify[host].path), "OMP_NUM_THREADS": "1",
                   "PYTHONUNBUFFERED": "1"}
            if host != "proxy":
                env["TESSERA_WORKER_ID"] = host
            launch = LAUNCH / f"{host.split('-')[0]}.sh"
            with open(workdir / f"{host}.launch.log", "w") as out:
                self.procs[host] = subprocess.Popen(
                    ["ip", "netns", "exec", net.namespaces[host], str(launch), str(env_file)],
                    env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            dead = {h: p.returncode for h, p in self.procs.items() if p.poll() is not None}
            assert not dead, f"exited during start-up: {dead}; logs in {self.workdir}"
            waiting = [h for h, n in self.notify.items() if "READY=1" not in n.poll()]
            if not waiting:
                alive = _metric(self.url, "tessera_proxy_workers_alive")
                assert sum(alive.values()) == len(HOSTS) - 1, alive
                return
            assert time.monotonic() < deadline, \
                f"no READY=1 from {waiting} in {READY_TIMEOUT_S}s; logs in {self.workdir}"
            time.sleep(0.3)

    def stop(self) -> None:
        for host in sorted(self.procs, key=lambda h: h == "proxy"):  # workers first: they say goodbye
            if self.procs[host].poll() is None:
                self.procs[host].terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for notify in self.notify.values():
            notify.sock.close()


@pytest.fixture(scope="module")
def hosts(short_model_dir, tmp_path_factory):
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    net = Network()
    started = None
    try:
        net.create()
        started = Hosts(net, tmp_path_factory.mktemp("netns"), short_model_dir)
        started.start()
        started.wait_ready()
        yield started
    finally:
        if started is not None:
            started.stop()
        net.destroy()


@pytest.fixture(scope="module")
def reference(short_model_dir):
    engine = LLMEngine(EngineConfig(model=str(short_model_dir), num_kv_blocks=64, num_threads=1))
    chats = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = engine.generate(chats, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}


def _chat_all(url: str, prompts: list[str]) -> list[dict]:
    def one(prompt):
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
                "temperature": 0.0}
        status, answer = post_json(url + "/v1/chat/completions", body, timeout=120)
        assert status == 200, answer
        return answer
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _kv_bytes_per_token(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4  # K and V, float32


def _traffic(hosts: Hosts) -> dict[str, int]:
    net = hosts.net
    return {"prefill_tx": sum(net.eth0_bytes(h, "tx") for h in ("prefill-0", "prefill-1")),
            "decode_rx": sum(net.eth0_bytes(h, "rx") for h in ("decode-0", "decode-1")),
            "pulled": int(sum(_metric(hosts.url, "tessera_proxy_kv_transfer_bytes_total").values()))}


def test_every_role_reports_ready_to_its_service_manager(hosts):
    for host, notify in hosts.notify.items():
        fields = notify.poll()
        assert "READY=1" in fields and any(f.startswith("STATUS=") for f in fields), (host, fields)


def test_greedy_outputs_match_and_kv_pages_cross_the_veths(hosts, reference, short_model_dir):
    before = _traffic(hosts)
    answers = _chat_all(hosts.url, BEFORE_CUT)
    assert [a["choices"][0]["message"]["content"] for a in answers] == [reference[p] for p in BEFORE_CUT]
    after = _traffic(hosts)
    grown = {k: after[k] - before[k] for k in after}
    prompt_kv = sum(a["usage"]["prompt_tokens"] for a in answers) * _kv_bytes_per_token(short_model_dir)
    assert grown["pulled"] >= prompt_kv, (grown, prompt_kv)
    assert grown["prefill_tx"] >= grown["pulled"], f"KV pages did not leave the prefill hosts' eth0: {grown}"
    assert grown["decode_rx"] >= grown["pulled"], f"KV pages did not reach the decode hosts' eth0: {grown}"


def test_cut_links_are_routed_around(hosts, reference):
    hosts.net.cut("prefill-1")
    hosts.net.cut("decode-1")
    settle(lambda: _metric(hosts.url, "tessera_proxy_workers_alive"),
           lambda alive: alive.get('{role="prefill"}') == alive.get('{role="decode"}') == 1, HEARTBEAT_TIMEOUT_S + 10,
           "the proxy drops the cut hosts once they miss heartbeat_timeout_s of heartbeats")
    counts_before = _metric(hosts.url, "tessera_proxy_worker_requests_total")  # counted as each request is sent
    answers = _chat_all(hosts.url, AFTER_CUT)
    assert [a["choices"][0]["message"]["content"] for a in answers] == [reference[p] for p in AFTER_CUT]
    counts = _metric(hosts.url, "tessera_proxy_worker_requests_total")
    grew = {k for k, v in counts.items() if v > counts_before.get(k, 0)}
    assert grew == {'{stage="prefill",worker_id="prefill-0"}', '{stage="decode",worker_id="decode-0"}'}, counts
