"""The admission-queue policies and the service counters, one rule at a time."""
from __future__ import annotations

import pytest

from proxy.tenancy.fairness import BacklogLift, FcfsQueue, PriorityQueue, VtcQueue, Waiting, make_queue
from proxy.tenancy.service_counters import ServiceCounters


def counters(weights: dict[str, float] | None = None) -> ServiceCounters:
    return ServiceCounters(1.0, 2.0, weights or {})


def drain(queue) -> list[str]:
    out = []
    while (item := queue.pop_next()) is not None:
        out.append(item.key)
    return out


def item(key: str, tenant: str, order: int, lane: int = 1) -> Waiting:
    return Waiting(tenant, lane, order, key=key)


def test_counters_weigh_input_output_and_tenant_weight():
    c = counters({"gold": 4.0})
    assert c.charge("gold", input_tokens=100, output_tokens=10) == pytest.approx((100 + 2 * 10) / 4)
    assert c.charge("free", output_tokens=3) == 6.0
    c.lift("free", 2.0)
    assert c["free"] == 6.0  # lifting never lowers
    c.lift("free", 9.0)
    assert c["free"] == 9.0


def test_fcfs_is_arrival_order_whatever_the_lane_or_push_order():
    queue = FcfsQueue(counters())
    for it in (item("c", "x", 3, lane=0), item("a", "y", 1, lane=2), item("b", "x", 2)):
        queue.push(it)
    assert drain(queue) == ["a", "b", "c"]


def test_priority_serves_lower_lane_numbers_first_then_arrival():
    queue = PriorityQueue(counters())
    for it in (item("p2-old", "x", 1, lane=2), item("p1", "y", 2, lane=1), item("p0-new", "z", 5, lane=0),
               item("p0-old", "z", 4, lane=0)):
        queue.push(it)
    assert drain(queue) == ["p0-old", "p0-new", "p1", "p2-old"]


def test_vtc_picks_the_smallest_counter_and_its_oldest_request():
    c = counters()
    queue = VtcQueue(c)
    queue.push(item("a1", "a", 1))
    queue.push(item("a2", "a", 2))
    queue.push(item("b1", "b", 3))
    c.charge("a", input_tokens=50)
    assert queue.pop_next().key == "b1"
    assert drain(queue) == ["a1", "a2"]


def test_lift_to_the_smallest_backlogged_counter_of_the_lane():
    c = counters()
    lift = BacklogLift(c)
    c.charge("busy", input_tokens=1000)
    c.charge("other", input_tokens=400)
    c.charge("premium", input_tokens=50)
    lift.became_backlogged("premium", lane=0)  # another lane: not compared
    lift.became_backlogged("other", lane=1)
    lift.became_backlogged("busy", lane=1)
    assert c["busy"] == 1000  # already above: unchanged
    lift.became_backlogged("idle", lane=1)
    assert c["idle"] == 400  # no banked credit from its idle time


def test_lift_to_the_last_tenant_to_stop_when_nobody_is_backlogged():
    c = counters()
    lift = BacklogLift(c)
    lift.became_backlogged("a", lane=1)
    c.charge("a", input_tokens=300)
    lift.stopped_being_backlogged("a", lane=1)
    lift.became_backlogged("b", lane=1)
    assert c["b"] == 300


def test_vtc_queue_itself_never_changes_counters():
    c = counters()
    c.charge("a", input_tokens=300)
    queue = VtcQueue(c)
    queue.push(item("a", "a", 1))
    queue.push(item("b", "b", 2))
    assert c["b"] == 0
    assert queue.pop_next().key == "b"


def test_vtc_lanes_come_before_counters():
    c = counters()
    c.charge("premium", input_tokens=10_000)
    queue = VtcQueue(c)
    queue.push(item("cheap", "free", 1, lane=1))
    queue.push(item("rich", "premium", 2, lane=0))
    assert drain(queue) == ["rich", "cheap"]


@pytest.mark.parametrize("policy", ["fcfs", "priority", "vtc"])
def test_remove_and_eligibility_filter(policy):
    queue = make_queue(policy, counters())
    first, second, third = item("1", "a", 1), item("2", "b", 2), item("3", "a", 3)
    for it in (first, second, third):
        queue.push(it)
    queue.remove(first)
    assert len(queue) == 2
    assert queue.pop_next(lambda tenant: tenant != "b").key == "3"
    assert queue.pop_next(lambda tenant: tenant != "b") is None
    assert drain(queue) == ["2"]


def test_unknown_policy_names_the_field():
    with pytest.raises(ValueError, match="fairness_policy"):
        make_queue("lottery", counters())
