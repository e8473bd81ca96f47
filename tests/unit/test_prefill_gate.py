"""The prefill gate (proxy/control/prefill_gate.py), the adaptive controller's and the proxy's own: a prompt waits while
the sequences decoding on the cores its prefill worker shares could not absorb it within their TPOT target."""
from __future__ import annotations

from types import SimpleNamespace

from common.protocol.wire import Heartbeat, KVLayoutInfo, Register, StepCostModel, decode, encode
from common.runtime.core_share import core_group
from common.runtime.prometheus_text import total
from proxy.core.requests import Stage
from proxy.control.prefill_gate import PrefillGate, slack_ms
from proxy.core.workers import WorkerRegistry
from proxy.control.tac import MIN_OUTCOMES, THRESHOLD_START
from proxy.core.routing import DERIVED
from tests.fixed_limits import FixedLimits
from tests.unit.test_tac import controller, ended, tick

LAYOUT = KVLayoutInfo(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")
# a decode step: 9 ms + 1 ms a row; a prompt: 6 ms + 0.3 ms a token + 0.02 ms per thousand query x key pairs
COST = StepCostModel(small_max_rows=8, small=[9.0, 1.0, 0.0, 0.0, 0.0], large=[6.0, 1.0, 0.0, 0.3, 0.02])
TARGET_MS = 50.0


def registry(prefill_group: str = "h:/tmp/cores", decode_group: str = "h:/tmp/cores") -> WorkerRegistry:
    reg = WorkerRegistry(5.0, TARGET_MS)
    for worker_id, role, group in (("p0", "prefill", prefill_group), ("d0", "decode", decode_group)):
        assert reg.register(Register(worker_id, role, 1, "m", "v", LAYOUT, 1000, 4096, "fake", b"", 128,
                                     core_group=group), 0.0).ack.accepted
        reg.heartbeat(Heartbeat(worker_id, 1, 900, 1 if role == "decode" else 0, 0, 0, False, 0, COST), 0.0)
    return reg


def decoding(done: int, elapsed_s: float, now: float = 100.0, max_tokens: int = 64, worker: str = "d0"):
    """A choice decoding on ``worker``: ``done`` of its ``max_tokens`` tokens out, its first ``elapsed_s`` ago."""
    return SimpleNamespace(stage=Stage.DECODING, decode_worker=worker, params=SimpleNamespace(max_tokens=max_tokens),
                           output_ids=[0] * done, first_token_at=now - elapsed_s, tokens=[0] * 256)


def prefilling(prompt: int, max_tokens: int = 64, worker: str = "p0"):
    return SimpleNamespace(stage=Stage.PREFILLING, prefill_worker=worker, decode_worker=None, tokens=[0] * prompt,
                           params=SimpleNamespace(max_tokens=max_tokens), output_ids=[], first_token_at=None)


def waiting(prompt: int):
    return SimpleNamespace(stage=Stage.QUEUED, decode_worker=None, tokens=[0] * prompt, first_token_at=None)


def gate(reg: WorkerRegistry, inflight: list, outstanding: int = 0) -> PrefillGate:
    return PrefillGate(reg, lambda worker_id: outstanding, inflight, lambda sub: TARGET_MS)


def test_the_slack_is_the_target_over_the_remaining_gaps_less_what_the_tokens_took_and_will_take():
    reg = registry()
    # 63 gaps at 50 ms = 3,150 ms; 10 tokens took 0.5 s; 54 more at the 1-row step of 10 ms
    assert slack_ms(decoding(10, 0.5), reg.workers["d0"], TARGET_MS, 100.0) == 3150 - 500 - 54 * 10
    # one still prefilling has all of its gaps ahead: 3,150 - 64 x 10
    assert slack_ms(prefilling(2048), reg.workers["d0"], TARGET_MS, 100.0) == 3150 - 64 * 10


def test_a_long_prompt_waits_for_the_sequences_decoding_on_the_same_cores():
    reg = registry()
    fresh, late = decoding(10, 0.5), decoding(40, 2.6)  # slack 2,110 ms and 3,150 - 2,600 - 24 x 10 = 310 ms
    # a 2,048-token prompt: 6 + 614.4 + 0.02 x 2,097 = 662 ms of the shared cores; a 256-token one 84 ms
    assert gate(reg, [fresh, waiting(2048)]).room(100.0)
    assert not gate(reg, [fresh, late, waiting(2048)]).room(100.0)
    assert gate(reg, [fresh, late, waiting(256)]).room(100.0)
    # the prompts the prefill worker has not done yet run first: 1,024 tokens outstanding and 256 more
    assert not gate(reg, [fresh, late, waiting(256)], outstanding=1024).room(100.0)
    assert gate(reg, [late, waiting(2048)]).room(103.0) is False  # the slack shrinks as the tokens take longer
    assert gate(reg, [fresh, waiting(2048)], outstanding=0).room(100.0)


def test_a_prompt_in_flight_is_stalled_by_the_ones_sent_after_it():
    reg = registry()
    # its own 2,048 tokens delay its first token, not its TPOT: the next 2,048 (662 ms) fit its 2,510 ms
    assert gate(reg, [prefilling(2048), waiting(2048)], outstanding=2048).room(100.0)
    # 16 tokens to come: 50 x 15 - 16 x 10 = 590 ms, less than the next prompt
    assert not gate(reg, [prefilling(2048, max_tokens=16), waiting(2048)], outstanding=2048).room(100.0)
    assert gate(reg, [prefilling(2048, max_tokens=16), waiting(256)], outstanding=2048).room(100.0)
    # one on another prefill worker is not stalled by this one's prompts
    assert gate(reg, [prefilling(2048, max_tokens=16, worker="p1"), waiting(2048)], outstanding=2048).room(100.0)


def test_it_holds_nothing_with_nothing_waiting_or_decoding_and_never_across_hosts():
    reg = registry()
    late = decoding(40, 2.6)
    assert gate(reg, [late]).room(100.0)  # nothing waits
    assert gate(reg, [waiting(2048)]).room(100.0)  # nothing decodes: a prompt always goes
    assert gate(registry(decode_group="other:/tmp/cores"), [late, waiting(2048)]).room(100.0)
    assert gate(registry(prefill_group="", decode_group=""), [late, waiting(2048)]).room(100.0)


def gated_controller(**overrides):
    """The controller, its p0 and d0 sharing cores, a sequence decoding with no slack and a long prompt waiting:
    (the controller, its metrics, the choices in flight, its clock)."""
    tac, _, metrics, _ = controller(**overrides)
    clock = SimpleNamespace(now=0.0)
    tac._clock = lambda: clock.now
    reg = tac.registry
    reg.heartbeat(Heartbeat("p0", 1, 900, 0, 0, 0, False, 0, COST), 0.0)
    for worker_id in ("p0", "d0"):
        reg.workers[worker_id].core_group = "h:/tmp/cores"
    inflight = [decoding(40, 2.6, now=0.0), waiting(2048)]
    tac.gate._inflight = inflight
    return tac, metrics, inflight, clock


def test_the_controller_holds_prompts_through_the_gate_and_counts_them():
    tac, metrics, inflight, _ = gated_controller()
    assert not tac.prefill_room()
    assert total(metrics.render().decode(), "tessera_tac_prefill_held_total") == 1
    inflight.pop(0)  # the sequence ended
    assert tac.prefill_room()


def test_the_controllers_gate_holds_at_most_the_configured_stretch_too():
    """As the proxy's own gate: the controller starts from the fixed cap's setting
    (docs/history/benchmarks-rounds.md, ninth round)."""
    tac, _, _, clock = gated_controller(slo={"prefill_gate_max_hold_s": 2.0})
    assert not tac.prefill_room()
    clock.now = 1.5
    assert not tac.prefill_room()
    clock.now = 2.5
    assert tac.prefill_room()  # past 2 s at a stretch: one goes
    assert controller(slo={"prefill_gate_max_hold_s": 0.0})[0].gate.max_hold_s == float("inf")  # 0: without bound


def test_short_prompts_stay_off_a_decode_worker_that_shares_its_cores_with_the_prefill_worker():
    tac, policy, _, _ = controller()
    for worker_id in ("p0", "d0"):
        tac.registry.workers[worker_id].core_group = "h:/tmp/cores"
    for second in (2.0, 4.0):
        ended(tac, MIN_OUTCOMES, ttft_ms=3000, tpot_ms=20)
        tick(tac, second)
    assert policy.local_prefill_threshold == DERIVED  # the configured one, untouched
    tac.registry.workers["d0"].core_group = "other:/tmp/cores"  # its own cores: the prefill side is relieved
    ended(tac, MIN_OUTCOMES, ttft_ms=3000, tpot_ms=20)
    tick(tac, 6.0)
    assert policy.local_prefill_threshold == THRESHOLD_START


def test_a_worker_sharing_cores_says_which_in_its_registration():
    assert core_group("") == ""
    group = core_group("/tmp/tessera-cores-1")
    assert group.endswith(":/tmp/tessera-cores-1") and group != ":/tmp/tessera-cores-1"
    msg = Register("p0", "prefill", 1, "m", "v", LAYOUT, 1000, 4096, "fake", b"", 128, core_group=group)
    assert decode(encode(msg)).core_group == group
    old = Register("p0", "prefill", 1, "m", "v", LAYOUT, 1000, 4096, "fake", b"", 128)
    assert decode(encode(old)).core_group == ""  # a worker that says nothing shares nothing


def test_without_the_controller_the_gate_holds_at_most_its_longest_stretch_then_lets_one_go():
    """``prefill_gate_max_hold_s``: a stream of 2,000 tokens decoding at the edge of its target has no slack
    for its whole life; without a bound, every prompt beside it would wait for its end."""
    reg = registry()
    inflight = [decoding(40, 2.6), waiting(2048)]
    held = PrefillGate(reg, lambda worker_id: 0, inflight, lambda sub: TARGET_MS, max_hold_s=2.0)
    assert held.hold(100.0) and held.hold(101.0) and held.hold(102.0)
    assert not held.hold(102.5)  # past 2 s at a stretch: one goes
    assert held.hold(102.6)  # the next stretch starts
    inflight.pop(0)
    assert not held.hold(102.7)  # room: nothing held, and the stretch ends
    inflight.insert(0, decoding(40, 2.6, now=103.0))
    assert held.hold(103.0) and not held.hold(105.1)


def gated_cluster(max_hold_s: float, scope: str = "always"):
    """A cluster whose p0 and d0 share cores, the TPOT target applying as ``scope`` says; the gate as configured."""
    from common.config.roles import ProxyConfig
    from proxy.cluster.cluster import Cluster
    from proxy.core.metrics import ProxyMetrics
    from proxy.core.routing import PrefixAwareRouting
    config = ProxyConfig(slo={"tpot_slo_ms": TARGET_MS, "tpot_slo_scope": scope, "prefill_gate_max_hold_s": max_hold_s})
    cluster = Cluster(config, PrefixAwareRouting(), ProxyMetrics(), clock=lambda: 100.0)
    cluster.registry = cluster.slo.registry = cluster.limits.registry = registry()
    if cluster.slo.gate is not None:
        cluster.slo.gate.registry = cluster.registry
    return cluster


def test_the_cluster_asks_the_gate_only_while_the_tpot_target_applies_and_counts_what_it_held():
    for scope, held in (("always", True), ("never", False)):  # "never": no TPOT target, no gate
        cluster = gated_cluster(max_hold_s=5.0, scope=scope)
        cluster.inflight.update({"late": decoding(40, 2.6), "w": waiting(2048)})
        assert cluster.limits.prefill_room() is not held
        assert total(cluster.metrics.render().decode(), "tessera_proxy_prefill_held_total") == held
    assert gated_cluster(max_hold_s=0.0).slo.gate is None  # off


def test_a_prompt_the_gate_holds_goes_back_in_its_place():
    """Admission asks the gate only with a prompt to start and a slot for it, so the gate's stretch counts only
    the wait it causes; the prompt it holds keeps its place in the fairness order."""
    import hashlib
    from common.config.roles import ProxyConfig
    from proxy.tenancy.admission import AdmissionController
    from proxy.tenancy.tenants import TenantRegistry
    tenants = [{"name": t, "api_key_sha256": [hashlib.sha256(t.encode()).hexdigest()]} for t in ("a", "b")]
    config = ProxyConfig(tenancy={"auth_enabled": True, "tenants": tenants})
    registry_ = TenantRegistry(config)
    limits = FixedLimits(slots=0, room=False)
    admission = AdmissionController(config, registry_)
    assert admission.next_admission(limits) is None and limits.room_asked == 0  # nothing waits: not asked
    for key in ("a0", "b0", "a1"):
        admission.enqueue(key, registry_.tenants[key[0]], 10, key)
    limits.slots = 4
    assert admission.next_admission(limits) is None and limits.room_asked == 1
    limits.room = True
    assert [admission.next_admission(limits).key for _ in range(3)] == ["a0", "b0", "a1"]
