"""A first token's time in parts, through a real cluster: proxy, prefill and decode workers on loopback, the
embedded model, the default configs with local prefill for short prompts (proxy/core/first_token.py).

Long prompts go through the prefill worker and a page pull; short ones prefill on the decode worker. Every choice's
end line must carry its parts, which add up to the TTFT the proxy measured (within 5%; they are differences of the
proxy's own marks), a disaggregated choice's with a pull of more than 0 bytes over the cluster's backend, and the
parts' histograms must count every choice. No assertion on how long anything took.
"""
from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from common.cli.local_cluster import LocalCluster
from common.protocol.names import TRANSFER_BACKENDS

MODEL = "SmolLM2-135M-Instruct"
LOCAL_BELOW = 24  # prompt tokens: shorter prompts prefill on the decode worker (local_prefill_threshold)
LONG = [f"Request {i}: " + "the quick brown fox jumps over the lazy dog and " * 6 for i in range(3)]
SHORT = [f"Hi {i}" for i in range(3)]
REQUEST_TIMEOUT_S = 300
TTFT_PARTS_NAME = "tessera_proxy_time_to_first_token_part_seconds"
HANDOFF_PARTS_NAME = "tessera_proxy_handoff_part_seconds"
END_LINE = re.compile(r"request (\S+) ended: (.*)$")


@pytest.fixture(scope="module")
def cluster(embedded_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("ttft-parts-logs")
    c = LocalCluster.for_tests(embedded_model_dir, log_dir, transfer_backend="zmq",
                               proxy_overrides=[f"local_prefill_threshold={LOCAL_BELOW}"]).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


def end_lines(cluster: LocalCluster) -> dict[str, dict[str, str]]:
    """request id -> the key=value fields of its end line, from the proxy's log."""
    lines = {}
    for line in (cluster.log_dir / "proxy.log").read_text().splitlines():
        if (match := END_LINE.search(line)) is not None:
            lines[match.group(1)] = dict(field.split("=", 1) for field in match.group(2).split())
    return lines


def test_every_choice_is_split_and_its_parts_add_up_to_its_ttft(cluster):
    async def run():
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            return await asyncio.gather(*(client.post(cluster.url + "/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True})
                for prompt in LONG + SHORT))

    answers = asyncio.run(run())
    assert [a.status_code for a in answers] == [200] * len(answers), [a.text for a in answers]
    prompt_tokens = {a.json()["id"]: a.json()["usage"]["prompt_tokens"] for a in answers}
    assert sum(n >= LOCAL_BELOW for n in prompt_tokens.values()) == len(LONG), prompt_tokens

    lines = end_lines(cluster)
    assert set(lines) == {f"{response_id}-0" for response_id in prompt_tokens}, lines
    for request_id, fields in lines.items():
        long = prompt_tokens[request_id.rsplit("-", 1)[0]] >= LOCAL_BELOW
        assert fields["status"] == "ok" and fields["resumes"] == "0", fields
        ttft_ms = float(fields["ttft_ms"])
        parts_ms = float(fields["queue_ms"]) + float(fields["prefill_ms"])
        assert abs(parts_ms - ttft_ms) <= 0.05 * ttft_ms, fields
        if long:
            assert (fields["prefill_worker"], fields["local"], fields["decode_worker"]) == (
                "prefill-0", "no", "decode-0"), fields
            assert int(fields["kv_bytes"]) > 0 and fields["kv_backend"] in TRANSFER_BACKENDS, fields
            assert fields["kv_backend"] == "zmq" and fields["kv_pull"] == "ok", fields
            assert all(float(fields[f"{part}_ms"]) >= 0 for part in ("decode_wait", "transfer", "first_decode"))
        else:
            assert (fields["prefill_worker"], fields["local"]) == ("decode-0", "yes"), fields
            assert "kv_bytes" not in fields and "transfer_ms" not in fields, fields

    ttft_count = sum(cluster.metric("tessera_proxy_time_to_first_token_seconds_count").values())
    ttft_sum = sum(cluster.metric("tessera_proxy_time_to_first_token_seconds_sum").values())
    counts = cluster.metric(f"{TTFT_PARTS_NAME}_count")
    assert counts == {'{part="prefill"}': ttft_count, '{part="queue"}': ttft_count} and ttft_count == len(answers)
    parts_sum = sum(cluster.metric(f"{TTFT_PARTS_NAME}_sum").values())
    assert abs(parts_sum - ttft_sum) <= 0.05 * ttft_sum, (parts_sum, ttft_sum)
    handoffs = cluster.metric(f"{HANDOFF_PARTS_NAME}_count")
    assert set(handoffs.values()) == {len(LONG)}, handoffs
    assert sum(cluster.metric("tessera_proxy_kv_transfer_bytes_total").values()) > 0
