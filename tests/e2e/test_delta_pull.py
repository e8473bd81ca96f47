"""A conversation's turns through a prefill and a decode worker, without a session: from the second turn on the
decode worker pulls only the blocks its prefix cache lacks (``transfer.delta_pull``), and the replies stay the
single-process engine's."""
from __future__ import annotations

import httpx
import pytest

from common.cli.local_cluster import LocalCluster
from tests.e2e.chat_reference import assert_replies_are_the_engines

SYSTEM = " ".join(f"Rule {i}: answer the traveller kindly and name one harbour town in the story." for i in range(24))
MESSAGES = ["Tell me a story about a lighthouse keeper.", "What happened next?", "And how did it end?"]
MAX_TOKENS = 16
KV_BYTES = "tessera_proxy_kv_transfer_bytes_total"


@pytest.fixture(scope="module")
def cluster(short_model_dir, tmp_path_factory):
    c = LocalCluster.for_tests(short_model_dir, tmp_path_factory.mktemp("delta-pull-logs"), prefill=1,
                               decode=1).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


def test_later_turns_pull_only_what_is_new(cluster, short_model_dir):
    history = [{"role": "system", "content": SYSTEM}]
    pulled, answers = [], []
    with httpx.Client(base_url=cluster.url, timeout=120) as client:
        for text in MESSAGES:
            history.append({"role": "user", "content": text})
            before = sum(cluster.metric(KV_BYTES).values())
            body = {"model": "SmolLM2-135M-Instruct", "messages": history, "max_tokens": MAX_TOKENS,
                    "temperature": 0}
            answer = client.post("/v1/chat/completions", json=body).json()
            pulled.append(sum(cluster.metric(KV_BYTES).values()) - before)
            history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            answers.append(answer)
    assert answers[0]["usage"]["prompt_tokens"] > 400 and pulled[0] > 0
    # A turn adds about 40 tokens to a history of 400 and more: its new blocks, and the last one it shares
    # only in part with what the worker computed.
    assert all(0 < later <= 0.3 * pulled[0] for later in pulled[1:]), pulled
    reused = cluster.metric("tessera_worker_kv_blocks_reused_total", cluster.worker_url("decode-0"))
    assert sum(reused.values()) > 0
    assert_replies_are_the_engines(short_model_dir, MESSAGES, answers, MAX_TOKENS, system=SYSTEM)
