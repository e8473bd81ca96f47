"""A pipelined choice in the proxy (``SubRequest``): what it sends and relays, and that every way out frees what its
decode worker reserved, while the TTFT and hand-off parts still add up."""
from __future__ import annotations

from types import SimpleNamespace

from common.config.roles import ProxyConfig
from common.protocol.sampling_params import SamplingParams
from common.protocol.wire import (Abort, DecodeRequest, KVProgress, KVPulled, PrefillDone, PrefillRequest, ReleaseKV,
                                  TokenDelta)
from common.runtime.tracing import NoTracing
from proxy.cluster.request_group import EventSink
from proxy.core.metrics import ProxyMetrics
from proxy.core.requests import Stage, SubRequest

CONFIG = ProxyConfig(max_migrations=2, kv_pipeline={"min_tokens": 8, "layer_groups": 3})
P0, D0, D1 = (SimpleNamespace(worker_id=w, epoch=5) for w in ("p0", "d0", "d1"))


def pipelined() -> tuple[SubRequest, list]:
    sub = SubRequest("cmpl-1-0", 0, list(range(40)), SamplingParams(max_tokens=8), 1, CONFIG, ProxyMetrics(),
                     NoTracing(), EventSink(), now=0.0)
    return sub, sub.start_prefill(P0, 0.0, now=0.5, pipeline_to=D0)


def progress(sub: SubRequest) -> KVProgress:
    return KVProgress(sub.wire_id, "p0", 5, 0, 0, [3, 4], 0, 10)


def done(sub: SubRequest, finish_reason: str | None = None) -> PrefillDone:
    return PrefillDone(sub.wire_id, "p0", 5, 7, "a", [3, 4, 9], 0, finish_reason=finish_reason)


def test_the_decode_worker_gets_its_request_with_the_prompt_and_the_layer_groups_after():
    sub, sends = pipelined()
    (to_decode, early), (to_prefill, prefill) = sends
    assert (to_decode, to_prefill) == ("d0", "p0")
    assert isinstance(early, DecodeRequest) and early.kv_pipelined and early.first_token is None
    assert (early.source_worker_id, early.source_epoch) == ("p0", 5)
    assert isinstance(prefill, PrefillRequest) and prefill.kv_pipeline_layer_groups == 3
    assert sub.on_kv_progress(progress(sub), "p0") == [("d0", progress(sub))]
    assert sub.on_kv_progress(progress(sub), "p1") is None  # not its prefill worker's: a stray
    assert sub.on_prefill_done(done(sub), "p0", now=2.0) == []
    assert sub.on_kv_progress(progress(sub), "p0") is None  # prefilled: nothing more to relay
    (to, final), = sub.start_decode(D0, 0.0, now=2.25)
    assert to == "d0" and final.first_token == 7 and not final.kv_pipelined and final.source_block_ids == [3, 4, 9]
    assert sub.pipelined_to is None and sub.stage is Stage.DECODING
    pulled = KVPulled(sub.wire_id, "p0", True, 4096, 0.01)
    assert sub.on_kv_pulled(pulled, "d0", now=2.5) == [("p0", ReleaseKV(sub.wire_id))]
    sub.on_token_delta(TokenDelta(sub.wire_id, [8], "b"), "d0", now=3.0)
    assert sub.parts.handoff() == {"decode_wait": 0.25, "transfer": 0.25, "first_decode": 0.5}
    assert sub.parts.ttft() == {"queue": 0.5, "prefill": 1.5}


def test_another_decode_worker_after_prefill_done_frees_the_first_ones_blocks():
    sub, _ = pipelined()
    sub.on_prefill_done(done(sub), "p0", now=2.0)
    sends = sub.start_decode(D1, 0.0, now=2.25)  # d0 began draining
    assert sends[0] == ("d0", Abort(sub.wire_id)) and sends[1][0] == "d1"


def test_the_pipelined_decode_worker_lost_while_prefilling_leaves_the_prefill_running():
    sub, _ = pipelined()
    assert sub.involves("d0")
    assert sub.on_worker_lost("d0", "its connection closed", now=1.0) == []
    assert sub.stage is Stage.PREFILLING and sub.pipelined_to is None and not sub.involves("d0")
    sub.on_prefill_done(done(sub), "p0", now=2.0)
    (to, final), = sub.start_decode(D1, 0.0, now=2.25)
    assert to == "d1" and final.source_block_ids == [3, 4, 9]


def test_the_prefill_worker_lost_aborts_the_pipelined_hand_off_and_resumes():
    sub, _ = pipelined()
    assert sub.on_worker_lost("p0", "killed", now=1.0) == [("d0", Abort("cmpl-1-0"))]
    assert sub.stage is Stage.QUEUED and sub.pipelined_to is None


def test_a_first_token_that_ends_the_request_frees_the_reservation():
    sub, _ = pipelined()
    sends = sub.on_prefill_done(done(sub, finish_reason="stop"), "p0", now=2.0)
    assert ("d0", Abort(sub.wire_id)) in sends and ("p0", ReleaseKV(sub.wire_id)) in sends
    assert sub.stage is Stage.FINISHED


def test_a_cancel_while_waiting_for_a_decode_slot_frees_both_workers():
    sub, _ = pipelined()
    sub.on_prefill_done(done(sub), "p0", now=2.0)
    sends = sub.cancel("the client left")
    assert ("d0", Abort(sub.wire_id)) in sends and ("p0", ReleaseKV(sub.wire_id)) in sends
