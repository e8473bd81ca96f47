"""A proxy and a worker one protocol version apart serve requests together.

The worker that speaks the previous version is, in turn, this release's worker set to it (``protocol_version``),
and the previous release itself (its code from git, commit ``PREVIOUS_RELEASE``, which reads and writes only its
own version). Greedy output through the pair equals the single-process engine's, and what the older version has
(embeddings, new in 11) works through it.
"""
from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import httpx
import pytest

from common.cli.local_cluster import READY_TIMEOUT_S, LocalCluster
from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams
from common.protocol.versions import PIPELINED_SINCE
from common.protocol.wire import PROTOCOL_VERSION
from tests.conditions import settle

PREVIOUS_RELEASE = "7bb9c0b"  # the last landed commit of protocol version 21
# the tests' worker settings PREVIOUS_RELEASE does not know
NEWER_SETTINGS: tuple[str, ...] = ("engine.cpu.huge_pages=",)
FORMER_SETTINGS: list[str] = []  # what PREVIOUS_RELEASE called those
REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["Tell me about the sea.", "What is a hash table?", "Count to five."]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def reference(tiny_chat_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=64))
    chats = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = engine.generate(chats, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def previous_release(tmp_path: Path) -> Path:
    """The previous release's tree, from git; the test skips where the history is not there (a shallow clone)."""
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", PREVIOUS_RELEASE], capture_output=True,
                                 check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        pytest.skip(f"the previous release ({PREVIOUS_RELEASE}) is not in this checkout's git history: {error}")
    tree = tmp_path / "previous"
    with tarfile.open(fileobj=io.BytesIO(archive)) as unpacked:
        unpacked.extractall(tree, filter="data")
    return tree


@pytest.mark.parametrize("older", ["this-release-set-back", "previous-release"])
def test_a_worker_one_version_behind_serves_with_this_proxy(older, tiny_chat_model_dir, reference, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    # Pipelining asked for every prompt: a prefill worker of the version before gets it where that version speaks it.
    cluster = LocalCluster.for_tests(tiny_chat_model_dir, logs, prefill=0, decode=1,
                                     proxy_overrides=["local_prefill_threshold=0", "kv_pipeline.min_tokens=1"]).start()
    behind = LocalCluster.for_tests(
        tiny_chat_model_dir, logs, prefill=1, decode=0, port=cluster.port, worker_port=cluster.worker_port,
        cwd=previous_release(tmp_path) if older == "previous-release" else None,
        # The previous release announces the name set here; this one the model directory's, the same.
        worker_overrides=[f"model_name={Path(tiny_chat_model_dir).name}"]
        + ([f"protocol_version={PROTOCOL_VERSION - 1}"] if older == "this-release-set-back" else []))
    if older == "previous-release":  # a setting added since: the previous release refuses what it does not know
        behind.worker_overrides = [o for o in behind.worker_overrides if not o.startswith(NEWER_SETTINGS)]
        behind.worker_overrides += FORMER_SETTINGS
    try:
        behind.start_worker("prefill", 0)

        def alive() -> float:
            assert not behind.dead(), f"the older worker exited: {logs}"
            return sum(cluster.metric("tessera_proxy_workers_alive").values())
        settle(alive, lambda count: count >= 2, READY_TIMEOUT_S, f"the older worker loads and joins (logs: {logs})")
        with httpx.Client(base_url=cluster.url, timeout=120) as client:
            texts = []
            for prompt in PROMPTS:
                body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
                response = client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                texts.append(response.json()["choices"][0]["message"]["content"])
            assert texts == reference
            sent = cluster.metric("tessera_proxy_worker_requests_total")  # counted as each request was sent
            assert sent.get('{stage="prefill",worker_id="prefill-0"}', 0) >= len(PROMPTS), sent  # it prefilled them
            pipelined = sum(cluster.metric("tessera_proxy_kv_pipelined_total").values())
            assert pipelined == (len(PROMPTS) if PIPELINED_SINCE < PROTOCOL_VERSION else 0)
            embed = client.post("/v1/embeddings", json={"model": "SmolLM2-135M-Instruct", "input": "hi"})
            assert embed.status_code == 200, embed.text  # EmbedRequest is in version 11: the older worker serves it
        log = (logs / "proxy.log").read_text()
        assert f"protocol version {PROTOCOL_VERSION - 1}" in log
    finally:
        for name in list(behind.procs):
            cluster.procs[name] = behind.procs.pop(name)
        codes = cluster.stop()
    assert all(code == 0 for code in codes.values()), codes
