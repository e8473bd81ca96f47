"""A new cluster's admission while its capacity model is still learning (issue 47, fair from the first second):
``WorkerRegistry.learning`` (proxy/core/workers.py) and the latency cap it holds in ``CapacityLimits``
(proxy/control/limits.py), through the cluster's own admission, limits and registry."""
from __future__ import annotations

import hashlib
from collections import Counter

from common.config.roles import ProxyConfig
from common.protocol.wire import Heartbeat, KVLayoutInfo, Register, StepCostModel
from proxy.cluster.cluster import Cluster
from proxy.core.capacity import START_CAPACITY
from proxy.core.metrics import ProxyMetrics
from proxy.core.requests import Stage
from proxy.core.routing import PrefixAwareRouting

LAYOUT = KVLayoutInfo(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")
COST = StepCostModel(small_max_rows=8, small=[9.0, 0.8, 3.0, 0.0, 0.0], large=[6.0, 1.5, 4.0, 0.3, 0.02])


def new_cluster(scope: str = "shared") -> Cluster:
    """A proxy's cluster with tenants a and b of weight 1 (vtc, the shipped policy), a prefill and a decode worker
    just registered: no step model yet."""
    tenants = [{"name": t, "api_key_sha256": [hashlib.sha256(t.encode()).hexdigest()]} for t in ("a", "b")]
    config = ProxyConfig(tenancy={"auth_enabled": True, "tenants": tenants}, slo={"tpot_slo_scope": scope})
    cluster = Cluster(config, PrefixAwareRouting(), ProxyMetrics())
    for worker_id, role in (("p0", "prefill"), ("d0", "decode")):
        assert cluster.registry.register(register(worker_id, role), 0.0).ack.accepted
    return cluster


def register(worker_id: str, role: str) -> Register:
    return Register(worker_id, role, 1, "m", "v", LAYOUT, 1000, 4096, "fake", b"", 128)


def heartbeat(worker_id: str, cost: StepCostModel | None, draining: bool = False) -> Heartbeat:
    return Heartbeat(worker_id, 1, 900, 0, 0, 0, draining, 0, cost)


def arrive(cluster: Cluster, tenant: str, count: int) -> None:
    for i in range(count):
        key = f"{tenant}{len(cluster.admission._items)}-{i}"
        cluster.admission.enqueue(key, cluster.tenants.tenants[tenant], 64, key)


def admit_all(cluster: Cluster) -> list[str]:
    """The tenants of what admission starts now, in turn, until it starts nothing more; each prompt charged as
    the cluster charges it when it sends it."""
    started = []
    while (admit := cluster.admission.next_admission(cluster.limits)) is not None:
        assert admit.stage is Stage.PREFILLING
        cluster.admission.prefill_started(admit.key)
        started.append(cluster.admission._items[admit.key].tenant)
    return started


def test_a_decode_worker_is_learning_until_its_heartbeat_carries_a_step_model():
    cluster = new_cluster()
    registry = cluster.registry
    assert registry.learning()
    registry.heartbeat(heartbeat("d0", None), 0.5)
    assert registry.learning()  # alive, but no model fitted yet
    registry.heartbeat(heartbeat("d0", COST), 1.0)
    assert registry.workers["d0"].latency_capacity and not registry.learning()
    assert registry.register(register("d1", "decode"), 1.5).ack.accepted
    assert registry.learning()  # a worker that joins a known cluster is learning too
    registry.heartbeat(heartbeat("d1", None, draining=True), 2.0)
    assert not registry.learning()  # a draining worker takes no new work: its guess gives nothing out


def test_a_worker_of_one_slot_is_not_learning():
    """One sequence at a time: no step model is ever fitted (one row count only), and none is needed."""
    cluster = new_cluster()
    registry = cluster.registry
    registry.heartbeat(heartbeat("d0", COST), 1.0)
    one_slot = Register("d1", "decode", 1, "m", "v", LAYOUT, 1000, 4096, "fake", b"", 1)
    assert registry.register(one_slot, 1.5).ack.accepted
    registry.heartbeat(heartbeat("d1", None), 2.0)
    assert not registry.learning() and registry.workers["d1"].tpot_capacity == 1


def test_a_cluster_without_decode_workers_is_not_learning():
    cluster = new_cluster()
    cluster.registry.disconnected("d0")
    assert not cluster.registry.learning()


def test_a_lone_tenants_first_burst_takes_only_the_start_capacity_while_the_model_is_unknown():
    """Tenant a's 48 streams reach a new cluster an instant before b's 12: a alone gets START_CAPACITY prompts
    started, not every slot; b's wait for the next slot to free (the cap is met exactly) and then take each one
    until b holds its share, before any more of a's. Without the cap a started all 48, b's waited behind them
    at the prefill worker, and the lift of b's counter to a's charged a's burst to b."""
    cluster = new_cluster()
    arrive(cluster, "a", 48)
    assert cluster.limits.latency_capped()  # one tenant, but the capacity is a guess
    assert cluster.limits.decode_slots() == START_CAPACITY
    assert admit_all(cluster) == ["a"] * START_CAPACITY
    arrive(cluster, "b", 12)
    assert admit_all(cluster) == []
    first_burst = [key for key, item in cluster.admission._items.items()
                   if item.tenant == "a"][:START_CAPACITY]
    started = []
    for key in first_burst:
        cluster.admission.leave(key, Stage.PREFILLING)
        started += admit_all(cluster)
    assert started == ["b"] * (START_CAPACITY // 2) + ["a"] * (START_CAPACITY // 2)


def test_once_the_capacity_is_known_a_lone_tenant_gets_every_slot_again():
    """The cap while learning is tpot_slo_scope shared's only change: with the model known, a lone tenant is not
    capped (its burst is the scope's choice), and scope never is never capped, learning or not."""
    cluster = new_cluster()
    cluster.registry.heartbeat(heartbeat("d0", COST), 1.0)
    arrive(cluster, "a", 48)
    assert not cluster.limits.latency_capped()
    assert admit_all(cluster) == ["a"] * 48
    cluster = new_cluster(scope="never")
    arrive(cluster, "a", 48)
    assert not cluster.limits.latency_capped()
    assert admit_all(cluster) == ["a"] * 48


def test_two_tenants_arriving_together_on_a_new_cluster_split_the_start_capacity():
    cluster = new_cluster()
    arrive(cluster, "a", 1)
    arrive(cluster, "b", 1)
    arrive(cluster, "a", 47)
    arrive(cluster, "b", 11)
    assert Counter(admit_all(cluster)) == {"a": START_CAPACITY // 2, "b": START_CAPACITY // 2}
