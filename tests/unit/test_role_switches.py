"""Role switches, the proxy's side: the order sent, its end when the worker registers in its new role, its timeout
(naming the setting), and the orders refused (unknown worker, old protocol, the last worker of a needed role)."""
from __future__ import annotations

import asyncio

import pytest

from common.config.roles import ProxyConfig
from common.protocol.versions import MESSAGE_SINCE
from common.protocol.wire import PROTOCOL_VERSION, KVLayoutInfo, Register, SwitchRole
from proxy.cluster.role_switches import RoleSwitches
from proxy.core.errors import ApiError
from proxy.core.metrics import ProxyMetrics
from proxy.core.workers import WorkerRegistry

LAYOUT = KVLayoutInfo(2, 16, 2, 8, "float32")
TIMEOUT_S = 30.0


def register(worker_id: str, role: str, epoch: int = 1, version: str = "v1") -> Register:
    return Register(worker_id, role, epoch, "tiny", version, LAYOUT, 64, 512, "zmq", b"", max_num_seqs=8)


class Switches:
    """RoleSwitches over a real WorkerRegistry, with a clock of its own and what it sends kept."""

    def __init__(self, *workers: Register) -> None:
        self.now = 100.0
        config = ProxyConfig(planner={"role_switch_timeout_s": TIMEOUT_S})
        self.registry = WorkerRegistry(config.heartbeat_timeout_s)
        self.metrics = ProxyMetrics()
        self.versions: dict[str, int] = {}
        self.sent: list[tuple[str, object]] = []
        self.switches = RoleSwitches(config, self.registry, lambda w, m: self.sent.append((w, m)), self.metrics,
                                     self.versions, lambda: self.now)
        for msg in workers:
            self.join(msg)

    def join(self, msg: Register, protocol: int = PROTOCOL_VERSION) -> None:
        outcome = self.registry.register(msg, self.now)
        assert outcome.ack.accepted
        self.versions[msg.worker_id] = protocol
        self.switches.registered(outcome.worker)

    def leave(self, worker_id: str) -> None:
        del self.registry.workers[worker_id]

    def refused(self, worker_id: str, role: str, force: bool = False) -> ApiError:
        with pytest.raises(ApiError) as raised:
            self.switches.order(worker_id, role, force)
        return raised.value

    def outcomes(self) -> dict[str, float]:
        return {outcome: self.metrics.role_switches.labels(outcome)._value.get()
                for outcome in ("switched", "refused", "timed_out", "failed")}


def run(test) -> None:
    asyncio.run(test())


def test_an_order_is_sent_and_ends_when_the_worker_registers_in_its_new_role_under_a_new_epoch():
    async def test():
        s = Switches(register("p0", "prefill"), register("d0", "decode"), register("d1", "decode"))
        done = s.switches.order("d1", "prefill")
        assert s.sent == [("d1", SwitchRole("d1", "prefill"))]
        assert s.registry.workers["d1"].draining and s.switches.switching("d1")
        assert s.switches.order("d1", "prefill") is done  # the same order again: the same wait
        assert s.refused("d1", "both").status == 409  # another role while one switch is under way
        s.leave("d1")  # its Goodbye
        s.join(register("d1", "decode", epoch=1))  # a late retry of its old Register ends nothing
        assert not done.done()
        s.join(register("d1", "prefill", epoch=2))
        worker = await done
        assert (worker.worker_id, worker.role.value, worker.epoch) == ("d1", "prefill", 2)
        assert not s.switches.switching("d1")
        assert s.outcomes() == {"switched": 1, "refused": 1, "timed_out": 0, "failed": 0}
    run(test)


def test_an_order_for_the_role_a_worker_has_ends_at_once_without_a_message():
    async def test():
        s = Switches(register("p0", "prefill"), register("d0", "decode"))
        worker = await s.switches.order("d0", "decode")
        assert worker.epoch == 1 and s.sent == []
    run(test)


def test_an_order_not_done_within_the_timeout_fails_naming_the_setting():
    async def test():
        s = Switches(register("p0", "prefill"), register("d0", "decode"), register("d1", "decode"))
        done = s.switches.order("d0", "prefill")
        s.now += TIMEOUT_S
        s.switches.expire(s.now)
        assert not done.done()
        s.now += 0.1
        s.switches.expire(s.now)
        with pytest.raises(ApiError) as raised:
            await done
        assert raised.value.status == 504 and "planner.role_switch_timeout_s=30.0s" in raised.value.message
        assert not s.switches.switching("d0")
        assert s.outcomes()["timed_out"] == 1
    run(test)


def test_a_worker_lost_or_registered_in_another_role_fails_its_order():
    async def test():
        s = Switches(register("p0", "prefill"), register("d0", "decode"), register("d1", "decode"),
                     register("d2", "decode"))
        lost, other = s.switches.order("d0", "prefill"), s.switches.order("d1", "both")
        s.switches.lost("d0")
        s.join(register("d1", "decode", epoch=2))
        for done, words in ((lost, "connection closed"), (other, "registered again as decode, not as both")):
            with pytest.raises(ApiError) as raised:
                await done
            assert raised.value.status == 503 and words in raised.value.message
        assert s.outcomes()["failed"] == 2
    run(test)


def test_an_unknown_worker_and_an_unknown_role_are_refused():
    async def test():
        s = Switches(register("p0", "prefill"), register("d0", "decode"))
        assert s.refused("nobody", "prefill").status == 404
        error = s.refused("d0", "embed")
        assert (error.status, error.param) == (400, "role")
        assert s.sent == []
    run(test)


def test_a_worker_of_the_protocol_before_switch_role_is_refused_with_the_reason():
    async def test():
        s = Switches(register("p0", "prefill"), register("d0", "decode"))
        before = MESSAGE_SINCE["SwitchRole"] - 1
        s.join(register("d1", "decode"), protocol=before)
        error = s.refused("d1", "prefill")
        assert error.status == 409 and error.code == "protocol_too_old"
        assert f"wire protocol {before}" in error.message and s.sent == []
    run(test)


def test_the_last_worker_of_a_needed_role_stays_unless_forced():
    async def test():
        s = Switches(register("p0", "prefill"), register("d0", "decode"), register("d1", "decode", version="v2"))
        error = s.refused("d0", "prefill")  # d1 serves another version: d0 is tiny@v1's last decode worker
        assert error.status == 409 and "last decode-capable worker" in error.message and "force" in error.message
        assert "last prefill worker" in s.refused("p0", "decode").message
        s.join(register("d2", "decode"))
        s.registry.workers["d2"].draining = True  # a draining worker takes no requests: it does not count
        assert s.refused("d0", "prefill").code == "last_worker_of_role"
        assert s.sent == []
        s.switches.order("d0", "prefill", force=True)
        assert s.sent == [("d0", SwitchRole("d0", "prefill"))]

        aggregated = Switches(register("p0", "prefill"), register("d0", "decode"))
        aggregated.switches.order("d0", "both")  # still decode-capable: no role is left without a worker
        assert aggregated.sent == [("d0", SwitchRole("d0", "both"))]
    run(test)
