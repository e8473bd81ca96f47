"""A stream a proxy took over and gave back (``Cluster.give_back``: it could not take the whole response over) is
its worker's again, and the same proxy may take it over at the client's next try. The worker's side is the real
``Owners`` (common/runtime/proxy_links.py) and the proxy's the real ``Cluster``; each message is handed from one to
the other by the test, in the order the two sockets may deliver them."""
from __future__ import annotations

import asyncio

from common.config.roles import ProxyConfig
from common.protocol import wire
from common.protocol.sampling_params import SamplingParams
from common.runtime.proxy_links import Owners
from proxy.cluster.cluster import Cluster
from proxy.core.metrics import ProxyMetrics
from proxy.core.resume_context import ResumeInfo, encode
from proxy.core.routing import PrefixAwareRouting
from tests.unit.test_cold_start import register

RESPONSE = "cmpl-1"
CHOICE = RESPONSE + "-3"
LOST, TAKER = 0, 1  # the worker's links: the lost proxy's, the one taking the stream over


def choice_of_a_lost_proxy(owners: Owners) -> None:
    context = encode(ResumeInfo(RESPONSE, 30.0, b"\x80", [], 3, 1, 4), "default", SamplingParams(max_tokens=40), 7,
                     [1, 2, 3], None)
    owners.took(wire.DecodeRequest(CHOICE, [1, 2, 3], SamplingParams(max_tokens=40), 7, resume_key=RESPONSE,
                                   resume_window_s=30.0, resume_context=context), LOST)
    owners.route(step(1))
    owners.forget(LOST)


def step(token: int) -> wire.TokenDeltas:
    return wire.TokenDeltas([wire.TokenDelta(CHOICE, [token], f"t{token}")])


def test_a_step_the_worker_sent_before_the_stream_came_back_does_not_end_it_when_taken_again():
    cluster = Cluster(ProxyConfig(), PrefixAwareRouting(), ProxyMetrics())
    sent: list = []  # (worker, message), as the proxy's link sends them, in order
    cluster.attach(lambda worker_id, msg, version: sent.append((worker_id, msg)))
    assert cluster.registry.register(register("d1", "decode"), 0.0).ack.accepted
    owners = Owners()
    choice_of_a_lost_proxy(owners)
    ended: list[str] = []  # what the worker's engine was told to abort

    def to_worker() -> list[wire.StreamFound]:
        """What the proxy sent the worker, read by it in order; its answers."""
        answers = []
        for _, msg in sent:
            if isinstance(msg, wire.FindStream):
                answers += owners.take_over(msg, TAKER, "d1")
            elif isinstance(msg, wire.LeaveStream):
                owners.leave(msg.request_id, TAKER)
            elif owners.took(msg, TAKER) and isinstance(msg, wire.Abort):
                ended.append(msg.request_id)
        sent.clear()
        return answers

    def to_proxy(msg) -> None:
        cluster.on_frames(b"d1", wire.encode(msg))

    async def run() -> None:
        search = asyncio.create_task(cluster.takeovers.find_stream(RESPONSE, None))
        await asyncio.sleep(0)
        for answer in to_worker():
            to_proxy(answer)
        _, subs, _ = await search
        cluster.give_back(subs, "a plain event number: the choices' order is unknown")
        [(_, late)] = owners.route(step(2))  # the worker's step before it reads the LeaveStream
        search = asyncio.create_task(cluster.takeovers.find_stream(RESPONSE, None))  # the client's next try
        await asyncio.sleep(0)
        to_proxy(late)  # that step reaches the proxy after its FindStream left
        for answer in to_worker():
            to_proxy(answer)
        _, subs, _ = await search
        assert [sub.stage.name for sub in subs] == ["DECODING"]
        to_worker()
        assert ended == []
        assert [link for link, _ in owners.route(step(3))] == [TAKER], "the stream goes on to the proxy that took it"

    asyncio.run(asyncio.wait_for(run(), 30))  # a bound against a hang, not a timing


def test_a_draining_proxy_hands_over_only_the_streams_whose_clients_hold_their_response_ids():
    """``Cluster.hand_over_streams``: a resumable stream whose client has no response id yet (its edge stream not
    started) could not be found through another proxy, so it stays and drains here; one the edge streams is left to
    its worker (``LeaveStream``)."""
    cluster = Cluster(ProxyConfig(), PrefixAwareRouting(), ProxyMetrics())
    sent: list = []
    cluster.attach(lambda worker_id, msg, version: sent.append((worker_id, msg)))
    assert cluster.registry.register(register("d1", "decode"), 0.0).ack.accepted
    owners = Owners()
    choice_of_a_lost_proxy(owners)

    async def run() -> None:
        search = asyncio.create_task(cluster.takeovers.find_stream(RESPONSE, None))
        await asyncio.sleep(0)
        for _, msg in sent:
            for answer in owners.take_over(msg, TAKER, "d1") if isinstance(msg, wire.FindStream) else []:
                cluster.on_frames(b"d1", wire.encode(answer))
        _, subs, _ = await search
        sent.clear()
        assert cluster.hand_over_streams({"cmpl-other"}) == set()
        assert [sub.stage.name for sub in subs] == ["DECODING"] and not sent
        assert cluster.hand_over_streams({RESPONSE, "cmpl-other"}) == {RESPONSE}
        assert [type(msg).__name__ for _, msg in sent] == ["LeaveStream"] and not cluster.inflight

    asyncio.run(asyncio.wait_for(run(), 30))  # a bound against a hang, not a timing
