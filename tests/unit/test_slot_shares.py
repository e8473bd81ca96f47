"""Each tenant's share of the decode slots (proxy/tenancy/slot_shares.py, through proxy/tenancy/admission.py): a tenant
at its share yields a free slot, under a latency cap a choice admitted to prefill holds its decode slot, the slot
forecast, and a newcomer beside a burst another tenant started alone."""
from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from common.config.roles import ProxyConfig
from proxy.control.limits import SlotForecast
from proxy.core.requests import Stage
from proxy.tenancy.admission import AdmissionController
from proxy.tenancy.tenants import TenantRegistry
from tests.fixed_limits import FixedLimits


def decoding_admission(policy: str, slots: int, weights: dict[str, float] | None = None,
                       lanes: dict[str, str] | None = None):
    """An AdmissionController with tenants a and b, and limits of ``slots`` decode slots; each choice prefills
    locally."""
    tenants = [{"name": t, "api_key_sha256": [hashlib.sha256(t.encode()).hexdigest()],
                "weight": (weights or {}).get(t, 1.0), "priority": (lanes or {}).get(t, "p1")} for t in ("a", "b")]
    cfg = ProxyConfig(tenancy={"fairness_policy": policy, "auth_enabled": True, "tenants": tenants})
    registry = TenantRegistry(cfg)
    return AdmissionController(cfg, registry), registry, FixedLimits(slots=slots)


def start(admission, registry, limits, tenant: str, key: str) -> Stage:
    """Enqueue ``key`` for ``tenant``, prefill it and ask for its decode slot; the stage it reached."""
    admission.enqueue(key, registry.tenants[tenant], 10, key)
    admit = admission.next_admission(limits)
    assert admit is not None and admit.key == key and admit.stage is Stage.PREFILLING
    admission.ready_for_decode(key)
    admit = admission.next_admission(limits)
    return admit.stage if admit is not None else Stage.READY


def test_a_tenant_at_its_share_of_the_slots_yields_to_one_below_it():
    for policy, first in (("vtc", "b"), ("fcfs", "a")):
        admission, registry, limits = decoding_admission(policy, slots=6)
        for i in range(5):
            assert start(admission, registry, limits, "a", f"a{i}") is Stage.DECODING
        assert start(admission, registry, limits, "b", "b0") is Stage.DECODING
        # every slot held (a 5, b 1); a's next choice is ready before b's, and one of a's ends
        assert start(admission, registry, limits, "a", "a5") is Stage.READY
        assert start(admission, registry, limits, "b", "b1") is Stage.READY
        admission.leave("a0", Stage.DECODING)
        admit = admission.next_admission(limits)
        assert admit is not None and admit.key == f"{first}{1 if first == 'b' else 5}", policy


def test_the_share_is_weighted_and_a_higher_lane_does_not_yield():
    admission, registry, limits = decoding_admission("vtc", slots=4, weights={"a": 3.0})
    for key, tenant in (("a0", "a"), ("a1", "a"), ("b0", "b"), ("b1", "b")):
        assert start(admission, registry, limits, tenant, key) is Stage.DECODING
    assert start(admission, registry, limits, "b", "b2") is Stage.READY
    assert start(admission, registry, limits, "a", "a2") is Stage.READY
    admission.leave("b0", Stage.DECODING)
    assert admission.next_admission(limits).key == "a2"  # a's share is 3 of 4 slots, b's 1: a is below, b is not
    admission, registry, limits = decoding_admission("vtc", slots=2, lanes={"a": "p0"})
    for key, tenant in (("a0", "a"), ("b0", "b")):
        assert start(admission, registry, limits, tenant, key) is Stage.DECODING
    assert start(admission, registry, limits, "a", "a1") is Stage.READY
    assert start(admission, registry, limits, "a", "a2") is Stage.READY  # a holds its share and more of it waits
    assert start(admission, registry, limits, "b", "b1") is Stage.READY
    admission.leave("b0", Stage.DECODING)
    assert admission.next_admission(limits).key == "a1"  # lane p0 first, whatever the shares


def capped_admission(slots: int, policy: str = "vtc"):
    """``decoding_admission`` with the decode slots a latency capacity (the TPOT target applies); the limits'
    ``freeing``: choices decoding predicted to end within one prefill."""
    tenants = [{"name": t, "api_key_sha256": [hashlib.sha256(t.encode()).hexdigest()]} for t in ("a", "b")]
    cfg = ProxyConfig(tenancy={"fairness_policy": policy, "auth_enabled": True, "tenants": tenants})
    registry = TenantRegistry(cfg)
    return AdmissionController(cfg, registry), registry, FixedLimits(slots=slots, capped=True)


def drain(admission, limits) -> list[tuple[str, Stage]]:
    admitted = []
    while (admit := admission.next_admission(limits)) is not None:
        admitted.append((admit.key, admit.stage))
    return admitted


def test_under_a_latency_cap_a_choice_admitted_to_prefill_holds_its_decode_slot():
    """So the excess waits before its prefill (at the proxy, in the policy's order), not between its first and
    second token; a prompt starts ahead of its slot only when a slot is predicted to free within one prefill."""
    admission, registry, limits = capped_admission(4)
    for i in range(8):
        admission.enqueue(f"a{i}", registry.tenants["a"], 10, f"a{i}")
    assert [key for key, _ in drain(admission, limits)] == ["a0", "a1", "a2", "a3"]
    for i in range(4):
        admission.ready_for_decode(f"a{i}")
    assert [key for key, stage in drain(admission, limits)] == ["a0", "a1", "a2", "a3"]
    assert admission.count[Stage.QUEUED]["a"] == 4  # not prefilled to wait for a slot
    for i in range(3):
        admission.enqueue(f"b{i}", registry.tenants["b"], 10, f"b{i}")
    assert drain(admission, limits) == []
    limits.freeing = 1  # one of a's is about to end: b, below its share, starts its prompt now
    assert drain(admission, limits) == [("b0", Stage.PREFILLING)]
    admission.ready_for_decode("b0")
    admission.leave("a0", Stage.DECODING)
    limits.freeing = 0
    assert drain(admission, limits) == [("b0", Stage.DECODING)]  # the slot was free when b0's prompt was done
    admission.leave("a1", Stage.DECODING)
    assert drain(admission, limits) == [("b1", Stage.PREFILLING)]  # b (1 of 4 slots) is below its share, a (2) is not
    admission.ready_for_decode("b1")
    assert drain(admission, limits) == [("b1", Stage.DECODING)]
    admission.leave("a2", Stage.DECODING)
    assert drain(admission, limits) == [("a4", Stage.PREFILLING)]  # now a (1 slot) is below its share and b (2) is not


def test_the_slot_forecast_counts_choices_ending_within_one_prefill():
    forecast = SlotForecast()

    def sub(key: str, stage: Stage, done: int, max_tokens: int = 32, local: bool = False):
        return SimpleNamespace(request_id=key, stage=stage, done=False, output_ids=[0] * done,
                               params=SimpleNamespace(max_tokens=max_tokens), first_token_at=0.0,
                               last_token_at=0.03 * (done - 1), admitted_at=-0.2,
                               route=SimpleNamespace(local=local))

    first = sub("p", Stage.READY, 1)
    forecast.update(first, first_tokens=True, now=0.0)  # 200 ms from admission to its first token
    assert forecast.prefill_s == pytest.approx(0.2)
    for key, done in (("a", 30), ("b", 26), ("c", 10)):  # 30 ms a token: 2, 6 and 22 tokens left
        forecast.update(sub(key, Stage.DECODING, done), first_tokens=False, now=0.0)
    assert forecast.freeing() == 2  # 60 ms and 180 ms are within 200 ms; 660 ms is not
    forecast.update(sub("a", Stage.FINISHED, 32), first_tokens=False, now=0.0)
    assert forecast.freeing() == 1
    local = sub("l", Stage.READY, 1, local=True)
    local.admitted_at = -5.0
    forecast.update(local, first_tokens=True, now=0.0)  # prefilled on its decode worker, in its slot: not counted
    assert forecast.prefill_s == pytest.approx(0.2)


def test_without_the_cap_every_tenant_runs_prefill_ahead_per_tenant():
    admission, registry, limits = decoding_admission("vtc", slots=2)
    for i in range(8):
        admission.enqueue(f"a{i}", registry.tenants["a"], 10, f"a{i}")
    admitted = drain(admission, limits)
    # two slots, and the tenant's prompts run ahead of them up to prefill_ahead_per_tenant (4) not yet decoding
    assert len(admitted) == ProxyConfig().tenancy.prefill_ahead_per_tenant > 2


def test_under_a_latency_cap_ready_choices_take_their_slots_in_arrival_order():
    """The slot was given at prefill admission, in the policy's order: decode admission does not choose again
    (with the shares of the decoding choices alone it would pass over a ready choice that already holds one)."""
    admission, registry, limits = capped_admission(2)
    admission.enqueue("a0", registry.tenants["a"], 10, "a0")
    admission.enqueue("b0", registry.tenants["b"], 10, "b0")
    assert [key for key, _ in drain(admission, limits)] == ["a0", "b0"]
    admission.ready_for_decode("a0")
    admission.ready_for_decode("b0")
    assert drain(admission, limits) == [("a0", Stage.DECODING), ("b0", Stage.DECODING)]
    admission.enqueue("a1", registry.tenants["a"], 10, "a1")
    admission.enqueue("b1", registry.tenants["b"], 10, "b1")
    limits.freeing = 2
    assert [key for key, _ in drain(admission, limits)] == ["a1", "b1"]
    admission.ready_for_decode("b1")
    admission.ready_for_decode("a1")
    admission.leave("b0", Stage.DECODING)
    admission.leave("a0", Stage.DECODING)
    limits.freeing = 0
    assert [key for key, _ in drain(admission, limits)] == ["a1", "b1"]  # a1 arrived first


def a_alone_started(count: int):
    """Tenants a and b; a, alone (every one of 128 slots its own), started ``count`` prompts. A test turns
    the latency cap on and sets the slots through the limits."""
    tenants = [{"name": t, "api_key_sha256": [hashlib.sha256(t.encode()).hexdigest()]} for t in ("a", "b")]
    cfg = ProxyConfig(tenancy={"auth_enabled": True, "tenants": tenants})
    registry = TenantRegistry(cfg)
    limits = FixedLimits(slots=128)
    admission = AdmissionController(cfg, registry)
    for i in range(count):
        admission.enqueue(f"a{i}", registry.tenants["a"], 10, f"a{i}")
    assert len(drain(admission, limits)) == count
    return admission, registry, limits


def test_a_newcomer_starts_beside_a_burst_a_lone_tenant_started_and_the_burst_only_shrinks():
    """A tenant alone gets every slot (``tpot_slo_scope: shared``). When a second comes, the cap applies and the
    first holds far more than it: the newcomer takes its share at once, past the cap, instead of waiting for
    the whole burst to end, and the burst gets nothing more until it is back within its share."""
    admission, registry, limits = a_alone_started(12)
    for i in range(12):
        admission.ready_for_decode(f"a{i}")
    assert len(drain(admission, limits)) == 12  # a alone: every one decodes
    limits.capped, limits.slots = True, 4  # b comes: the two share 4 slots within the TPOT target, 2 each
    for key in ("b0", "b1", "b2", "a12"):
        admission.enqueue(key, registry.tenants[key[0]], 10, key)
    # b's share, not b2, not a12
    assert drain(admission, limits) == [("b0", Stage.PREFILLING), ("b1", Stage.PREFILLING)]
    admission.ready_for_decode("b0")
    admission.ready_for_decode("b1")
    assert drain(admission, limits) == [("b0", Stage.DECODING), ("b1", Stage.DECODING)]  # beside a's 12
    for i in range(10):
        admission.leave(f"a{i}", Stage.DECODING)
        assert drain(admission, limits) == []  # a's burst shrinks: nothing of a's while it is past its share
    assert admission.count[Stage.DECODING] == {"a": 2, "b": 2}
    admission.leave("a10", Stage.DECODING)
    assert drain(admission, limits) == [("a12", Stage.PREFILLING)]  # within the cap again: a is below its share


def test_at_the_cap_exactly_a_newcomer_waits_for_the_next_slot():
    admission, registry, limits = capped_admission(3)
    for i in range(4):
        admission.enqueue(f"a{i}", registry.tenants["a"], 10, f"a{i}")
    assert len(drain(admission, limits)) == 3
    for i in range(3):
        admission.ready_for_decode(f"a{i}")
    assert len(drain(admission, limits)) == 3
    admission.enqueue("b0", registry.tenants["b"], 10, "b0")
    assert drain(admission, limits) == []  # 3 of 3 in use: no burst past the cap, b waits for one of a's to end
    admission.leave("a0", Stage.DECODING)
    assert drain(admission, limits) == [("b0", Stage.PREFILLING)]


def test_under_the_cap_a_burst_started_alone_takes_decode_slots_after_the_others_ready_choices():
    """The choices a tenant started while alone held no slot; when the cap comes on they are ready before a
    newcomer's, and by arrival alone its ready choice would wait for every one of them."""
    admission, registry, limits = a_alone_started(12)  # a alone: every prompt starts
    limits.capped, limits.slots = True, 4  # b comes: the two share 4 slots within the TPOT target, 2 each
    admission.enqueue("b0", registry.tenants["b"], 10, "b0")
    assert drain(admission, limits) == [("b0", Stage.PREFILLING)]  # past the cap, within a's surplus
    for i in range(12):
        admission.ready_for_decode(f"a{i}")
    assert [key for key, _ in drain(admission, limits)] == ["a0", "a1", "a2", "a3"]
    admission.ready_for_decode("b0")
    assert drain(admission, limits) == []  # 4 of 4 decoding: b0 waits for the next slot
    admission.leave("a0", Stage.DECODING)
    assert drain(admission, limits) == [("b0", Stage.DECODING)]  # before a4-a11, ready since long before it


def test_when_the_cap_shrinks_under_both_tenants_the_one_holding_fewer_goes_first():
    """Both tenants over their share: b's 4 prompts started while the capacity was 8 slots, a's 12 while it was
    alone, and then the capacity fell to 1 slot. By arrival b's would wait for all of a's (30 s in a
    light-tenant run); the one holding the fewest slots for its weight goes first."""
    admission, registry, limits = a_alone_started(12)
    limits.capped, limits.slots = True, 8
    for i in range(4):
        admission.enqueue(f"b{i}", registry.tenants["b"], 10, f"b{i}")
    assert len(drain(admission, limits)) == 4  # past the cap, within a's surplus
    limits.slots = 1
    for key in [f"a{i}" for i in range(12)] + [f"b{i}" for i in range(4)]:
        admission.ready_for_decode(key)
    assert drain(admission, limits) == [("b0", Stage.DECODING)]  # b holds 4, a 12: both over a share of half a slot
    admission.leave("b0", Stage.DECODING)
    assert drain(admission, limits) == [("b1", Stage.DECODING)]  # b now holds 3
    admission.leave("b1", Stage.DECODING)
    admission.leave("b2", Stage.READY)
    admission.leave("b3", Stage.READY)
    assert drain(admission, limits) == [("a0", Stage.DECODING)]  # b's are gone: a's, by arrival
