"""A rolling upgrade under steady load, through real processes: V1 serving, V2 workers start, a canary, full
promotion, V1 drained; then a rollback of the upgrade.

Two tiny random models are the two versions, so their greedy outputs differ: a response equal to its version's
reference output was prefilled and decoded by that version alone. Checked: no failed request, every response
served by the version its header names, and a session's turns on one version (unless the response says it moved).
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import threading

import httpx
import pytest

from common.cli.local_cluster import READY_TIMEOUT_S, LocalCluster
from common.storage.registry import ModelRegistry
from tests.conditions import settle
from tests.tiny_models import registered_versions

ADMIN_KEY = "rolling-upgrade-admin-key"
PROMPTS = ["Tell me about the sea.", "What is a hash table?", "Count to five.", "Name three colors."]
MAX_TOKENS = 12
LOOPS = 3
TURNS_PER_SESSION = 3
# Bounds a wait for the clients to be served some more requests, so that a stuck cluster fails rather than hangs;
# never a timing.
SERVED_S = 120.0


@pytest.fixture(scope="module")
def versions(tmp_path_factory, embedded_model_dir):
    """tiny@v1 and tiny@v2, registered in a registry of their own, and each one's greedy answer to each prompt."""
    cache, by_model = registered_versions(tmp_path_factory.mktemp("upgrade"), [("tiny@v1", 1), ("tiny@v2", 2)],
                                          PROMPTS, MAX_TOKENS, embedded_model_dir)
    answers = {model.partition("@")[2]: texts for model, texts in by_model.items()}
    assert answers["v1"] != answers["v2"]
    return cache, ModelRegistry(cache / "registry"), answers


class Load:
    """``LOOPS`` clients, each holding conversations of ``TURNS_PER_SESSION`` turns one after another."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.results: list[tuple[str, str, int, str, str, str]] = []  # session, prompt, status, model, moved, text
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(LOOPS)]

    def __enter__(self) -> "Load":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)

    def _loop(self, index: int) -> None:
        with httpx.Client(timeout=60) as client:
            for n in range(10 ** 6):
                for turn in range(TURNS_PER_SESSION):
                    if self.stop.is_set():
                        return
                    session, prompt = f"loop{index}-{n}", PROMPTS[(n + turn) % len(PROMPTS)]
                    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
                    try:
                        r = client.post(self.url + "/v1/chat/completions", json=body,
                                        headers={"X-Session-Id": session})
                        text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
                        self.results.append((session, prompt, r.status_code, r.headers.get("X-Tessera-Model", ""),
                                             r.headers.get("X-Tessera-Session-Moved", ""), text))
                    except httpx.HTTPError as error:
                        self.results.append((session, prompt, 0, "", "", repr(error)))

    def seen(self, version: str) -> int:
        return sum(model == f"tiny@{version}" for _, _, _, model, _, _ in self.results)


def promote(url: str, key_file, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "common.cli.main", "model", *args, "--proxy", url,
                           "--admin-key-file", str(key_file)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def pinned(cluster: LocalCluster, version: str) -> int:
    (entry,) = [m for m in httpx.get(cluster.url + "/v1/models").json()["data"] if m["id"] == "tiny"]
    return sum(v["pinned_sessions"] for v in entry["versions"] if v["version"] == version)


def served(load: Load, version: str, more: int, what: str) -> None:
    """Until ``more`` responses from now on came from ``version``."""
    before = load.seen(version)
    settle(lambda: load.seen(version), lambda seen: seen >= before + more, SERVED_S, what)


def workers_alive(cluster: LocalCluster, count: int, what: str) -> None:
    """Until the proxy counts ``count`` workers: the ones started have loaded their model and registered."""
    settle(lambda: sum(cluster.metric("tessera_proxy_workers_alive").values()), lambda alive: alive == count,
           READY_TIMEOUT_S, what)


def test_v1_to_v2_under_load_then_back(versions, tmp_path, monkeypatch):
    cache, registry, answers = versions
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(cache))
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN_KEY)
    (tmp_path / "logs").mkdir()
    cluster = LocalCluster.for_tests(
        "tiny@v1", tmp_path / "logs", prefill=1, decode=1,
        proxy_overrides=[f"security.admin_api_key_sha256={hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}",
                         "sessions.session_pin_max_s=3"],
        role_overrides=["prefill-1:engine.model=tiny@v2", "decode-1:engine.model=tiny@v2",
                        "prefill-2:engine.model=tiny@v1", "decode-2:engine.model=tiny@v1"]).start()
    try:
        with Load(cluster.url) as load:
            served(load, "v1", 10, "v1 serves the clients")
            cluster.start_worker("prefill", 1)  # 1. V2's workers join beside V1's
            cluster.start_worker("decode", 1)
            workers_alive(cluster, 4, "V2's workers load their model and register")
            assert "canary tiny@v2 at 30%" in promote(cluster.url, key_file, "promote", "tiny", "v2", "--canary", "30")
            served(load, "v2", 10, "the canary serves")  # 2. a canary
            promote(cluster.url, key_file, "promote", "tiny", "v2")  # 3. all of the traffic
            assert pinned(cluster, "v1") > 0  # sessions that began on V1 go on there ...
            assert "drained after" in promote(cluster.url, key_file, "drain", "tiny", "v1")  # ... until their pins end
            assert pinned(cluster, "v1") == 0
            for name in ("prefill-0", "decode-0"):  # 4. drain V1: its workers finish what they run, then exit
                assert cluster.stop_worker(name) == 0
            served(load, "v2", 10, "V2 alone serves")
            # The way back: V1's workers again, and a rollback (V2 was promoted over V1).
            cluster.start_worker("prefill", 2)
            cluster.start_worker("decode", 2)
            workers_alive(cluster, 4, "V1's workers load their model and register again")
            assert "promoted v1" in promote(cluster.url, key_file, "rollback", "tiny")
            served(load, "v1", 10, "V1 serves after the rollback")
    finally:
        codes = cluster.stop()
    failed = [r for r in load.results if r[2] != 200]
    assert not failed, failed[:5]
    assert all(code == 0 for code in codes.values()), codes
    last: dict[str, str] = {}  # session -> the version of its latest turn (turns are in order per session)
    for session, prompt, _, model, moved, text in load.results:
        assert text == answers[model.partition("@")[2]][prompt], (model, prompt)  # one version computed it all
        assert last.setdefault(session, model) == model or moved == last[session], (session, last[session], model)
        last[session] = model
    assert load.seen("v1") and load.seen("v2")
