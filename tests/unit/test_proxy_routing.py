"""Proxy routing policy and worker registry: pure logic, no sockets. What a worker holds reaches the policy's
index as its KV events would (``hold``)."""
from __future__ import annotations

from collections import defaultdict

import pytest

from common.protocol.wire import (Goodbye, Heartbeat, KVEvents, KVLayoutInfo, KVSnapshot, Register, StepCostModel,
                                  cache_salt_of, prefix_block_hashes)
from proxy.core.workers import WorkerRegistry
from proxy.core.routing import PrefixAwareRouting, near

LAYOUT = KVLayoutInfo(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")


def register_msg(worker_id: str, role: str, epoch: int = 1, model: str = "m", version: str = "v1",
                 layout: KVLayoutInfo = LAYOUT, num_blocks: int = 100, max_model_len: int = 2048) -> Register:
    return Register(worker_id, role, epoch, model, version, layout, num_blocks, max_model_len, "fake", b"meta")


def heartbeat(worker_id: str, epoch: int = 1, free: int = 100, running: int = 0, prefill_tokens: int = 0,
              draining: bool = False) -> Heartbeat:
    return Heartbeat(worker_id, epoch, free, running, 0, prefill_tokens, draining)


@pytest.fixture
def registry() -> WorkerRegistry:
    return WorkerRegistry(heartbeat_timeout_s=5.0)


def add(registry: WorkerRegistry, *roles: tuple[str, str]):
    for worker_id, role in roles:
        assert registry.register(register_msg(worker_id, role), now=0.0).ack.accepted
    return list(registry.workers.values())


def prompt(length: int, start: int = 0) -> list[int]:
    return list(range(start, start + length))


_published: dict[tuple[int, str, int], int] = defaultdict(int)  # (policy, worker, epoch) -> KVEvents sent


def hold(policy: PrefixAwareRouting, worker, tokens: list[int], cache_salt: int = 0) -> None:
    """``worker``'s KV events say its prefix cache stored ``tokens``' full blocks (under ``cache_salt``)."""
    key = (id(policy), worker.worker_id, worker.epoch)
    if policy.index.track(worker.worker_id, worker.epoch, 0.0) is not None:
        assert policy.index.apply_snapshot(KVSnapshot(worker.worker_id, worker.epoch, 0, []), 0.0)[0] == "applied"
        _published[key] = 0
    _published[key] += 1
    events = KVEvents(worker.worker_id, worker.epoch, _published[key],
                      stored=prefix_block_hashes(tokens, worker.block_size, cache_salt))
    assert policy.index.apply(events, 0.0) == ("applied", None)


# -- registry -----------------------------------------------------------------------------------


def test_workers_of_other_models_and_versions_join_and_each_version_keeps_one_kv_layout(registry, caplog):
    assert registry.register(register_msg("a", "prefill"), 0.0).ack.accepted
    assert registry.register(register_msg("b", "decode", model="other"), 0.0).ack.accepted
    other = KVLayoutInfo(30, 32, 3, 64, "float32")
    assert registry.register(register_msg("c", "decode", version="v2", layout=other), 0.0).ack.accepted
    refused = registry.register(register_msg("d", "decode", version="v2"), 0.0)  # v2's layout is c's
    assert not refused.ack.accepted and "m@v2" in refused.ack.reason and "m@v2" in caplog.text
    assert not registry.register(register_msg("e", "decode", model="bad@name"), 0.0).ack.accepted
    assert set(registry.workers) == {"a", "b", "c"}


def test_a_different_kv_layout_is_refused(registry):
    add(registry, ("a", "prefill"))
    other = KVLayoutInfo(30, 32, 3, 64, "float32")
    outcome = registry.register(register_msg("b", "decode", layout=other), 0.0)
    assert not outcome.ack.accepted and "KV layout" in outcome.ack.reason and "block_size=32" in outcome.ack.reason


def test_unknown_role_is_refused(registry):
    outcome = registry.register(register_msg("a", "router"), 0.0)
    assert not outcome.ack.accepted and "unknown role" in outcome.ack.reason


def test_the_identity_resets_once_every_worker_is_gone(registry):
    add(registry, ("a", "both"))
    registry.goodbye(Goodbye("a", 1))
    assert registry.register(register_msg("b", "both", version="v2"), 0.0).ack.accepted


def test_newer_epoch_replaces_the_entry_older_is_refused_same_is_a_retry(registry):
    add(registry, ("a", "prefill"))
    registry.heartbeat(heartbeat("a", free=42), now=1.0)
    retry = registry.register(register_msg("a", "prefill", epoch=1), 2.0)
    assert retry.ack.accepted and retry.replaced is None and registry.workers["a"].free_blocks == 42
    newer = registry.register(register_msg("a", "prefill", epoch=2), 3.0)
    assert newer.ack.accepted and newer.replaced.epoch == 1 and registry.workers["a"].epoch == 2
    assert newer.prefill_set_changed
    stale = registry.register(register_msg("a", "prefill", epoch=1), 4.0)
    assert not stale.ack.accepted and "stale epoch" in stale.ack.reason


def test_the_only_worker_may_come_back_with_a_new_model_version(registry):
    add(registry, ("a", "both"))
    assert registry.register(register_msg("a", "both", epoch=2, version="v2"), 1.0).ack.accepted


def test_heartbeat_timeout_removes_silent_workers(registry):
    add(registry, ("a", "prefill"), ("b", "decode"))
    registry.heartbeat(heartbeat("b"), now=4.0)
    assert registry.expire(now=4.9) == []
    dead = registry.expire(now=6.0)
    assert [w.worker_id for w in dead] == ["a"] and set(registry.workers) == {"b"}


def test_heartbeat_of_a_wrong_epoch_or_unknown_worker_is_ignored(registry):
    add(registry, ("a", "prefill"))
    assert registry.heartbeat(heartbeat("a", epoch=7, free=1), 1.0) is None
    assert registry.heartbeat(heartbeat("zz"), 1.0) is None
    assert registry.workers["a"].free_blocks == 100


def test_readiness_needs_prefill_and_decode_capable_workers(registry):
    assert not registry.readiness()[0]
    add(registry, ("p", "prefill"))
    ready, reason = registry.readiness()
    assert not ready and "decode-capable" in reason
    add(registry, ("d", "decode"))
    assert registry.readiness()[0]
    registry.heartbeat(heartbeat("d", draining=True), 1.0)
    assert not registry.readiness()[0]


def test_a_both_worker_alone_is_ready(registry):
    add(registry, ("x", "both"))
    assert registry.readiness()[0]
    assert registry.peers().peers == []  # a both worker never serves PrefillRequests


def test_peers_list_the_prefill_side(registry):
    add(registry, ("p1", "prefill"), ("p2", "prefill"), ("d", "decode"))
    assert sorted(p.worker_id for p in registry.peers().peers) == ["p1", "p2"]
    assert registry.max_model_len == 2048


# -- routing ------------------------------------------------------------------------------------


def test_prefill_prefers_the_worker_holding_the_prompt_prefix():
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("p1", "prefill"), ("p2", "prefill"), ("d", "decode"))
    policy = PrefixAwareRouting()
    shared = prompt(64)
    first = policy.route(shared + [1000], workers)
    assert not first.local
    policy.prefill_sent(first.worker, shared + [1000])
    hold(policy, first.worker, shared + [1000])
    # While r1 runs, the prefix holder is busier than the cache saves: spill over.
    assert policy.route(shared + [2000, 2001], workers).worker is not first.worker
    policy.prefill_ended(first.worker.worker_id, len(shared) + 1)
    # Idle again: the 64 cached tokens win.
    again = policy.route(shared + [2000, 2001], workers)
    assert again.worker is first.worker
    # An unrelated prompt goes to the less loaded one.
    other = policy.route(prompt(64, start=5000), workers)
    assert other.worker is not first.worker


def test_a_prefix_predicts_hits_only_for_requests_of_its_cache_salt():
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("p1", "prefill"), ("p2", "prefill"), ("d", "decode"))
    p1 = registry.workers["p1"]
    policy = PrefixAwareRouting()
    alpha, beta = cache_salt_of("tenant:alpha"), cache_salt_of("tenant:beta")
    shared = prompt(64)
    policy.prefill_sent(p1, shared)
    hold(policy, p1, shared, alpha)
    policy.prefill_ended("p1", len(shared))  # both idle; without a hit the rotation picks p2
    assert policy.route(shared + [7], workers, alpha).worker is p1  # alpha's blocks are there
    assert policy.route(shared + [7], workers, beta).worker is not p1  # beta's are not: the worker would miss
    assert policy.route(shared + [7], workers).worker is not p1  # nor does an unsalted request hit them


def test_local_prefill_predicts_hits_only_for_requests_of_its_cache_salt():
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("x1", "both"), ("x2", "both"))
    policy = PrefixAwareRouting()
    shared = prompt(48)
    route = policy.route(shared, workers, 5)
    policy.decode_sent(route.worker, shared)
    hold(policy, route.worker, shared, 5)
    policy.heartbeat(route.worker)
    registry.heartbeat(heartbeat(route.worker.worker_id, free=80), 1.0)  # fuller by 20 blocks
    assert policy.route(shared + [9] * 20, workers, 5).worker is route.worker  # holds salt 5's prefix
    assert policy.route(shared + [9] * 20, workers, 6).worker is not route.worker  # the emptier one, for salt 6


def test_prefill_without_prefix_hits_takes_the_least_outstanding_tokens():
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("p1", "prefill"), ("p2", "prefill"), ("d", "decode"))
    p1, p2 = registry.workers["p1"], registry.workers["p2"]
    policy = PrefixAwareRouting(0)  # never local: a 10-token prompt would prefill on the decode worker
    policy.prefill_sent(p1, prompt(10))
    assert policy.route(prompt(10, 900), workers).worker is p2
    registry.heartbeat(heartbeat("p2", prefill_tokens=50), 1.0)  # the worker's own count adds to the proxy's
    assert policy.route(prompt(10, 900), workers).worker is p1
    policy.prefill_ended("p1", 10)
    assert policy.outstanding_prefill_tokens("p1") == 0


def test_longer_prefix_beats_shorter():
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("p1", "prefill"), ("p2", "prefill"), ("d", "decode"))
    p1, p2 = registry.workers["p1"], registry.workers["p2"]
    policy = PrefixAwareRouting()
    base = prompt(96)
    hold(policy, p1, base[:32])
    hold(policy, p2, base)
    assert policy.route(base + [7], workers).worker is p2


def test_decode_takes_most_free_blocks_then_fewest_running():
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("d1", "decode"), ("d2", "decode"), ("d3", "both"))
    registry.heartbeat(heartbeat("d1", free=50, running=1), 1.0)
    registry.heartbeat(heartbeat("d2", free=80, running=9), 1.0)
    registry.heartbeat(heartbeat("d3", free=80, running=3), 1.0)
    policy = PrefixAwareRouting()
    assert policy.pick_decode(prompt(8), workers).worker_id == "d3"


def test_requests_sent_since_the_last_heartbeat_count_against_a_decode_worker():
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("d1", "decode"), ("d2", "decode"))
    policy = PrefixAwareRouting()
    chosen = policy.pick_decode(prompt(160), workers)
    policy.decode_sent(chosen, prompt(160))  # 10 blocks
    assert policy.pick_decode(prompt(160), workers) is not chosen
    policy.heartbeat(chosen)
    assert policy.pick_decode(prompt(160), workers) is chosen  # equal again: the first in order


def test_a_heartbeat_counts_only_the_requests_its_worker_took():
    """A heartbeat measured before the worker's compute loop took a request (it was in a step) must not erase that
    request from the load: two requests sent into that window still go to two idle workers."""
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("d1", "decode"), ("d2", "decode"))
    policy = PrefixAwareRouting()
    first = policy.pick_decode(prompt(8), workers)
    policy.decode_sent(first, prompt(8), request_id="r1")
    registry.heartbeat(Heartbeat(first.worker_id, 1, 100, 0, 0, 0, last_decode_taken=""), 1.0)  # taken: none yet
    policy.heartbeat(first)
    second = policy.pick_decode(prompt(8), workers)
    assert second is not first
    policy.decode_sent(second, prompt(8), request_id="r2")
    policy.decode_sent(first, prompt(8), request_id="r3")
    # first took r1 and holds it (waiting for a slot: blocks not yet taken); r3 is still on the way
    registry.heartbeat(Heartbeat(first.worker_id, 1, 100, 0, 1, 0, last_decode_taken="r1"), 1.0)
    policy.heartbeat(first)
    assert policy._decode_load(first) == (False, -99, 2)  # r1 waits there, r3 (1 block) pending
    policy.decode_ended(first.worker_id, "r3")  # refused, say, before its worker took it
    assert policy._decode_load(first) == (False, -100, 1)
    registry.heartbeat(Heartbeat(first.worker_id, 1, 100, 0, 0, 0, last_decode_taken="r0"), 1.0)  # one it does
    policy.heartbeat(first)                                                                   # not know: kept
    assert policy._decode_load(second)[2] == 1
    registry.heartbeat(heartbeat(second.worker_id), 1.0)  # an older worker (no last_decode_taken): counts all
    policy.heartbeat(second)
    assert policy._decode_load(second) == (False, -100, 0)


def test_draining_workers_get_nothing_new():
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode"))
    registry.heartbeat(heartbeat("p1", draining=True), 1.0)
    registry.heartbeat(heartbeat("d1", draining=True, free=1000), 1.0)
    policy = PrefixAwareRouting()
    for start in range(0, 400, 40):
        assert policy.route(prompt(40, start), workers).worker.worker_id == "p2"
    assert policy.pick_decode(prompt(40), workers).worker_id == "d2"
    registry.heartbeat(heartbeat("d2", draining=True), 1.0)
    assert policy.route(prompt(40), workers) is None and policy.pick_decode(prompt(40), workers) is None


def test_short_prompts_prefill_locally():
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("p", "prefill"), ("d", "decode"))
    policy = PrefixAwareRouting(local_prefill_threshold=32)
    short = policy.route(prompt(31), workers)
    assert short.local and short.worker.worker_id == "d"
    long = policy.route(prompt(32), workers)
    assert not long.local and long.worker.worker_id == "p"


def test_without_a_prefill_worker_everything_prefills_locally():
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("x1", "both"), ("x2", "both"))
    policy = PrefixAwareRouting()
    route = policy.route(prompt(500), workers)
    assert route.local and route.worker.role.value == "both"
    registry.heartbeat(heartbeat("x1", draining=True), 1.0)
    registry.heartbeat(heartbeat("x2", draining=True), 1.0)
    assert policy.route(prompt(500), workers) is None


def test_a_prefill_only_cluster_cannot_route():
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("p", "prefill"))
    assert PrefixAwareRouting().route(prompt(100), workers) is None


def test_local_prefill_prefers_the_decode_worker_with_the_prefix():
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("x1", "both"), ("x2", "both"))
    policy = PrefixAwareRouting()
    shared = prompt(48)
    route = policy.route(shared, workers)
    policy.decode_sent(route.worker, shared)
    hold(policy, route.worker, shared)
    policy.heartbeat(route.worker)
    registry.heartbeat(heartbeat(route.worker.worker_id, free=80), 1.0)  # fuller by 20 blocks, but holds the prefix
    assert policy.route(shared + [9] * 20, workers).worker is route.worker


def test_worker_removed_forgets_its_state():
    registry = WorkerRegistry(5.0)
    add(registry, ("p", "prefill"))
    policy = PrefixAwareRouting()
    policy.prefill_sent(registry.workers["p"], prompt(32))
    policy.worker_removed("p")
    assert policy.outstanding_prefill_tokens("p") == 0
    policy.prefill_ended("p", 32)  # a late end is harmless
    assert policy.outstanding_prefill_tokens("p") == 0


def test_a_sessions_next_turn_prefills_on_the_decode_worker_holding_its_history(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("proxy.core.routing.time.monotonic", lambda: clock[0])
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("p", "prefill"), ("d1", "decode"), ("d2", "decode"))
    policy = PrefixAwareRouting(session_ttl_s=60.0)
    history = prompt(300)
    assert not policy.route(history, workers, session="chat").local  # first turn: disaggregated as any
    d2 = registry.workers["d2"]
    policy.decode_sent(d2, history, session="chat")
    policy.heartbeat(d2)
    turn = policy.route(history + prompt(40, 9000), workers, session="chat")
    assert turn.local and turn.worker is d2  # its history, replies included, is in d2's prefix cache
    assert not policy.route(history, workers, session="other").local
    registry.heartbeat(heartbeat("d2", running=d2.tpot_capacity), 1.0)  # at its TPOT capacity: routed as any
    assert not policy.route(history, workers, session="chat").local
    registry.heartbeat(heartbeat("d2"), 2.0)
    clock[0] += 61  # past session_ttl_s: its blocks may be gone, routed as any
    assert not policy.route(history, workers, session="chat").local
    policy.decode_sent(d2, history, session="chat")
    registry.heartbeat(heartbeat("d2", draining=True), 3.0)
    assert not policy.route(history, [w for w in workers if not w.draining], session="chat").local


# -- routing on the exact index ------------------------------------------------------------------------------


def test_a_restarted_workers_old_blocks_never_attract_a_request():
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("p1", "prefill"), ("p2", "prefill"), ("d", "decode"))
    policy = PrefixAwareRouting()
    shared = prompt(64)
    policy.prefill_sent(registry.workers["p2"], prompt(8))  # p2 busier: only p1's cache can draw the prompt
    hold(policy, registry.workers["p1"], shared)
    first = policy.route(shared + [1], workers)
    assert first.worker.worker_id == "p1" and first.cached_tokens == 64
    outcome = registry.register(register_msg("p1", "prefill", epoch=2), 1.0)  # p1 restarted
    assert policy.index.track("p1", 2, 1.0) is not None  # the cluster does this at the Register: old blocks gone
    workers = list(registry.workers.values())
    again = policy.route(shared + [1], workers)
    assert again.worker is outcome.worker and again.cached_tokens == 0  # least outstanding now, not for its cache
    late = KVEvents("p1", 1, 2, stored=prefix_block_hashes(shared, 16))  # the old epoch's, arriving late
    assert policy.index.apply(late, 1.0) == ("stale", None)
    assert policy.route(shared + [1], workers).cached_tokens == 0


def test_pick_decode_weighs_the_leading_blocks_held_against_room():
    """Without a prefill worker to pull from (local prefill), each block a worker lacks costs 16 free blocks."""
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("d1", "decode"), ("d2", "decode"), ("d3", "decode"))
    registry.heartbeat(heartbeat("d1", free=90), 1.0)
    registry.heartbeat(heartbeat("d2", free=40), 1.0)
    registry.heartbeat(heartbeat("d3", free=60), 1.0)
    policy = PrefixAwareRouting()
    history = prompt(96)
    hold(policy, registry.workers["d2"], history[:64])
    hold(policy, registry.workers["d3"], history[:32])
    assert policy.pick_decode(history + [5], workers).worker_id == "d2"  # 4 of 7 blocks, though the fullest
    assert policy.pick_decode(prompt(40, 7000), workers).worker_id == "d1"  # none held anywhere: most free
    assert policy.pick_decode(history + [5], workers, cache_salt=9).worker_id == "d1"  # another tenant's blocks
    registry.heartbeat(heartbeat("d2", running=registry.workers["d2"].tpot_capacity), 2.0)
    assert policy.pick_decode(history + [5], workers).worker_id == "d3"  # at its TPOT capacity: after the others


def test_a_prefill_workers_pages_go_to_a_decode_worker_of_its_host_when_it_has_room():
    """A block pulled across hosts costs 16 pulled on one (CROSS_HOST_PULL_COST), counted against free blocks."""
    registry = WorkerRegistry(5.0)
    for worker_id, role, host in (("p1", "prefill", "a"), ("d-a", "decode", "a"), ("d-b", "decode", "b"),
                                  ("d-unknown", "decode", "")):
        msg = register_msg(worker_id, role)
        msg.host = host
        assert registry.register(msg, now=0.0).ack.accepted
    source, decoders = registry.workers["p1"], [w for w in registry.workers.values() if w.worker_id != "p1"]
    registry.heartbeat(heartbeat("d-a", free=80), 1.0)  # the fullest: without the host it comes last
    registry.heartbeat(heartbeat("d-b", free=90), 1.0)
    registry.heartbeat(heartbeat("d-unknown", free=95), 1.0)
    policy = PrefixAwareRouting()
    tokens = prompt(160)
    assert policy.pick_decode(tokens, decoders, source=source).worker_id == "d-a"
    assert policy.pick_decode(tokens, decoders).worker_id == "d-unknown"  # no source: room decides
    hold(policy, registry.workers["d-b"], tokens[:80])  # half the pages held elsewhere: they still stay on host a
    assert policy.pick_decode(tokens, decoders, source=source).worker_id == "d-a"
    long = prompt(641, 3000)
    hold(policy, registry.workers["d-b"], long[:640])  # 40 of 41 blocks: 1 crosses, against 41 on the host
    assert policy.pick_decode(long, decoders, source=source).worker_id == "d-b"
    registry.heartbeat(heartbeat("d-a", running=registry.workers["d-a"].tpot_capacity), 2.0)
    other = policy.pick_decode(prompt(160, 5000), decoders, source=source).worker_id
    assert other == "d-unknown"  # the host's decode worker at its TPOT capacity: room decides among the rest


def test_one_nvlink_fabric_counts_as_one_host_and_the_pairing_says_which():
    """Workers on other hosts of the prefill worker's NVLink fabric (Register.interconnect_domain) take its pages as
    one of its host would; a fabric of another cluster, or none reported, is the network."""
    registry = WorkerRegistry(5.0)
    for worker_id, role, host, fabric in (("p1", "prefill", "a", "nvlink:aa:1"), ("d-fab", "decode", "b", "nvlink:aa:1"),
                                          ("d-other", "decode", "c", "nvlink:bb:1"), ("d-none", "decode", "d", "")):
        msg = register_msg(worker_id, role)
        msg.host, msg.interconnect_domain = host, fabric
        assert registry.register(msg, now=0.0).ack.accepted
    workers = registry.workers
    assert [near(workers["p1"], workers[w]) for w in ("d-fab", "d-other", "d-none")] == ["same_fabric", "", ""]
    assert near(workers["p1"], workers["p1"]) == "same_host" and near(None, workers["d-none"]) == "same_host"
    registry.heartbeat(heartbeat("d-fab", free=80), 1.0)  # the fullest: across the network it would come last
    registry.heartbeat(heartbeat("d-other", free=90), 1.0)
    registry.heartbeat(heartbeat("d-none", free=95), 1.0)
    decoders = [workers[w] for w in ("d-fab", "d-other", "d-none")]
    assert PrefixAwareRouting().pick_decode(prompt(160), decoders, source=workers["p1"]).worker_id == "d-fab"


def test_the_local_prefill_threshold_is_on_the_uncached_suffix():
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("p", "prefill"), ("d", "decode"))
    policy = PrefixAwareRouting(local_prefill_threshold=32)
    history = prompt(320)
    assert not policy.route(history + [1], workers).local  # nothing held: 321 tokens to compute
    hold(policy, registry.workers["d"], history)
    turn = policy.route(history + [1, 2, 3], workers)
    assert turn.local and turn.worker.worker_id == "d" and turn.cached_tokens == 320
    assert not policy.route(history[:160] + prompt(40, 5000), workers).local  # 40 uncached tokens
    assert PrefixAwareRouting(0).route(history + [1], workers) is not None
    assert not PrefixAwareRouting(0).route(history + [1], workers).local  # 0: never local


def test_the_predicted_cached_tokens_stop_short_of_the_last_token_as_the_engine_does():
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("x", "both"))
    policy = PrefixAwareRouting()
    hold(policy, registry.workers["x"], prompt(64))
    assert policy.route(prompt(64), workers).cached_tokens == 48  # the engine computes the last token
    assert policy.route(prompt(65), workers).cached_tokens == 64


def step_cost(per_prompt_token_ms: float) -> StepCostModel:
    return StepCostModel(0, [], [1.0, 0.1, 0.0, 0.0, 0.0], mixed=[2.0, 0.1, 0.0, per_prompt_token_ms, 0.0])


def test_the_derived_threshold_weighs_a_local_prompt_step_against_queue_prompt_step_and_pull():
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("p", "prefill"), ("d", "decode"))
    p, d = registry.workers["p"], registry.workers["d"]
    policy = PrefixAwareRouting()  # -1: derived
    history = prompt(320)
    hold(policy, d, history)
    # Unmeasured: only a suffix shorter than one block stays on the decode worker.
    assert policy.route(history + prompt(15, 9000), workers).local
    assert not policy.route(history + prompt(16, 9000), workers).local
    p.step_cost = d.step_cost = step_cost(1.0)  # 1 ms a prompt token on either
    # The prefill worker would compute all 340 tokens, the decode worker 20: local.
    assert policy.route(history + prompt(20, 9000), workers).local
    hold(policy, p, history)  # now it holds them too: 20 tokens either side, and the pull tips it local
    policy.kv_pulled("d", 1 << 20, 1.0)  # 1 MiB/s: the 2 blocks d lacks take longer than nothing
    assert policy.route(history + prompt(20, 9000), workers).local
    d.step_cost = step_cost(100.0)  # a slow decode worker: 2 s locally against 20 ms plus the pull
    assert not policy.route(history + prompt(20, 9000), workers).local
    policy.prefill_sent(p, prompt(4000))  # unless the prefill worker is 4,000 tokens behind
    assert policy.route(history + prompt(20, 9000), workers).local
    d.step_cost = step_cost(1.0)
    policy.prefill_ended("p", 4000)
    registry.heartbeat(heartbeat("d", running=3), 1.0)  # 22 ms locally stalls 3 sequences as well: 88 ms,
    policy.kv_pulled("d", 1 << 40, 1.0)  # against p's 22 ms and a pull of next to no time: disaggregated
    assert not policy.route(history + prompt(20, 9000), workers).local
    other = prompt(320, 20000)  # a prefix only d holds: p would compute 338 tokens, d 18 (80 ms with the stall)
    hold(policy, d, other)
    assert policy.route(other + prompt(18, 9000), workers).local


def test_the_derived_threshold_never_takes_a_prompt_step_longer_than_the_decode_workers_tpot_target():
    registry = WorkerRegistry(5.0)
    workers = add(registry, ("p", "prefill"), ("d", "decode"))
    p, d = registry.workers["p"], registry.workers["d"]
    policy = PrefixAwareRouting()
    p.step_cost = d.step_cost = step_cost(1.0)  # 1 ms a prompt token on either, both idle
    assert policy.route(prompt(300), workers).local  # no cheaper elsewhere and no stream to stall
    d.tpot_target_ms = 100.0
    assert not policy.route(prompt(300, 5000), workers).local  # 300 ms in one step: past the target
    assert policy.route(prompt(60, 9000), workers).local
