"""A request's first-token deadline (``SubRequest.check_deadline``, ``Cluster.check_deadline``):
``requests.first_token_timeout_s`` bounds the wait in which the worker computing its prompt finishes no prompt, so a
burst on a slow model waits its turn while the worker's queue moves, and a request on a worker that finishes none
gets its 504 naming the setting."""
from __future__ import annotations

from types import SimpleNamespace

from common.config.roles import ProxyConfig
from common.protocol.sampling_params import SamplingParams
from common.protocol.wire import KVLayoutInfo, PrefillDone, Register, TokenDelta, TokenDeltas
from common.runtime.tracing import NoTracing
from proxy.cluster.cluster import Cluster
from proxy.cluster.request_group import EventSink
from proxy.core.metrics import ProxyMetrics
from proxy.core.requests import Stage, SubRequest
from proxy.core.routing import PrefixAwareRouting

TIMEOUT_S = 120.0
CONFIG = ProxyConfig(requests={"first_token_timeout_s": TIMEOUT_S, "token_timeout_s": 60.0})
P0, D0 = (SimpleNamespace(worker_id=w, epoch=1) for w in ("p0", "d0"))


def request(sink: EventSink | None = None) -> SubRequest:
    return SubRequest("cmpl-1-0", 0, list(range(40)), SamplingParams(max_tokens=8), 1, CONFIG, ProxyMetrics(),
                      NoTracing(), sink or EventSink(), now=0.0)


def failure(sink: EventSink) -> str:
    (event,) = sink.take()
    return event.error.message


def test_a_prompt_queued_behind_others_waits_while_its_prefill_worker_finishes_them():
    sink = EventSink()
    sub = request(sink)
    sub.start_prefill(P0, 0.0, now=0.0)
    assert sub.check_deadline(TIMEOUT_S + 1, prompt_done_at=100.0) == []  # p0 finished another 21 s ago
    assert sub.stage is Stage.PREFILLING and sub.deadline == 100.0 + TIMEOUT_S
    assert sub.check_deadline(219.0, prompt_done_at=100.0) == []  # before the moved deadline: nothing to do
    sends = sub.check_deadline(221.0, prompt_done_at=100.0)  # then 120 s in which p0 finished none
    assert sub.stage is Stage.FAILED and sends  # the Abort to p0
    assert "first_token_timeout_s=120.0s in which its worker finished no prompt" in failure(sink)


def test_a_prefill_worker_that_finishes_no_prompt_times_the_request_out_at_its_deadline():
    sink = EventSink()
    sub = request(sink)
    sub.start_prefill(P0, 0.0, now=0.0)
    sub.check_deadline(TIMEOUT_S, prompt_done_at=None)
    assert sub.stage is Stage.FAILED and "first_token_timeout_s" in failure(sink)


def test_a_local_prompt_waits_on_its_decode_workers_prompts_and_tokens_keep_their_own_timeout():
    sub = request()
    sub.start_decode(D0, 0.0, now=0.0)  # no prefill worker: it prefills on d0
    assert sub.computing_prompt_on() == "d0"
    assert sub.check_deadline(TIMEOUT_S + 5, prompt_done_at=TIMEOUT_S) == [] and sub.stage is Stage.DECODING
    sub.on_token_delta(TokenDelta(sub.wire_id, [7], "a"), "d0", now=TIMEOUT_S + 10)
    assert sub.computing_prompt_on() is None  # its first token came: token_timeout_s from here, whatever d0 does
    sub.check_deadline(TIMEOUT_S + 71, prompt_done_at=TIMEOUT_S + 70)
    assert sub.stage is Stage.FAILED


def test_the_cluster_marks_a_workers_finished_prompts_from_prefill_done_and_local_first_tokens():
    cluster = Cluster(CONFIG, PrefixAwareRouting(), ProxyMetrics())
    layout = KVLayoutInfo(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")
    for worker_id, role in (("p0", "prefill"), ("d0", "decode")):
        assert cluster.registry.register(Register(worker_id, role, 1, "m", "v", layout, 1000, 4096, "fake", b"", 128),
                                         0.0).ack.accepted
    sent = []
    cluster.send = lambda worker_id, msg: sent.append((worker_id, msg))
    cluster._on_prefill_done("p0", PrefillDone("gone-0", "p0", 1, 7, "a", [3], 0), now=50.0)  # a stray's: still done
    assert cluster.registry.workers["p0"].prompt_done_at == 50.0 and sent  # its pages released
    sub = request()
    cluster.inflight[sub.request_id] = sub
    sub.start_decode(cluster.registry.workers["d0"], 0.0, now=0.0)
    cluster._on_token_deltas("d0", TokenDeltas([TokenDelta(sub.wire_id, [7], "a")]), now=60.0)
    assert cluster.registry.workers["d0"].prompt_done_at == 60.0
