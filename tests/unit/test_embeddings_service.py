"""The proxy's embedding requests in flight: worker choice, retries, timeouts and the in-flight budget."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from common.config.roles import ProxyConfig
from common.protocol.versions import MESSAGE_SINCE
from common.protocol.wire import PROTOCOL_VERSION, Abort, EmbedRequest, EmbedResult, RequestFailed, Role
from proxy.cluster.embeddings import MAX_ATTEMPTS, Embeddings
from proxy.core.errors import ApiError


def config(requests=None):
    return ProxyConfig(requests={"embedding_timeout_s": 5.0, "embedding_max_inflight_tokens": 100,
                                 "retry_after_s": 1, **(requests or {})})


MODEL = ("m", "v1")


def worker(worker_id: str, role: Role, draining: bool = False, model: tuple[str, str] = MODEL):
    return SimpleNamespace(worker_id=worker_id, role=role, draining=draining, model=model[0], model_version=model[1])


class Harness:
    def __init__(self, *workers, **overrides) -> None:
        self.sent: list[tuple[str, object]] = []
        registry = SimpleNamespace(workers={w.worker_id: w for w in workers})
        self.versions: dict[str, int] = {}
        self.service = Embeddings(config(**overrides), registry, lambda wid, msg: self.sent.append((wid, msg)),
                                  self.versions)

    def answer(self, index: int = -1, dim: int = 4) -> None:
        wid, msg = self.sent[index]
        values = np.arange(len(msg.inputs) * dim, dtype="<f4")
        self.service.on_result(wid, EmbedResult(msg.request_id, wid, dim, values.tobytes(), 3), 0.0)


async def settle():
    for _ in range(3):
        await asyncio.sleep(0)


def test_a_prefill_worker_is_preferred_and_its_answer_is_the_vectors():
    async def run():
        h = Harness(worker("both-0", Role.BOTH), worker("decode-0", Role.DECODE), worker("prefill-0", Role.PREFILL),
                    worker("prefill-v2", Role.PREFILL, model=("m", "v2")))
        task = asyncio.create_task(h.service.embed([[1, 2], [3]], MODEL))
        await settle()
        assert [(wid, type(msg)) for wid, msg in h.sent] == [("prefill-0", EmbedRequest)]
        h.answer()
        vectors = await task
        assert vectors.shape == (2, 4) and vectors[1, 0] == 4
        assert not h.service.pending
    asyncio.run(run())


def test_the_less_loaded_worker_gets_the_next_request():
    async def run():
        h = Harness(worker("p0", Role.PREFILL), worker("p1", Role.PREFILL))
        first = asyncio.create_task(h.service.embed([[1] * 30], MODEL))
        await settle()
        second = asyncio.create_task(h.service.embed([[1] * 5], MODEL))
        await settle()
        assert [wid for wid, _ in h.sent] == ["p0", "p1"]
        h.answer(0)
        h.answer(1)
        await asyncio.gather(first, second)
    asyncio.run(run())


def test_retryable_failures_and_lost_workers_move_it_until_the_attempts_run_out():
    async def run():
        h = Harness(*(worker(f"p{i}", Role.PREFILL) for i in range(MAX_ATTEMPTS + 1)))
        task = asyncio.create_task(h.service.embed([[1, 2]], MODEL))
        await settle()
        wid, msg = h.sent[-1]
        h.service.on_failed(wid, RequestFailed(msg.request_id, wid, "worker is draining", retryable=True))
        h.service.worker_gone(h.sent[-1][0])
        wid, msg = h.sent[-1]
        h.service.on_failed(wid, RequestFailed(msg.request_id, wid, "worker is draining", retryable=True))
        assert len({w for w, _ in h.sent}) == MAX_ATTEMPTS
        with pytest.raises(ApiError) as raised:
            await task
        assert raised.value.status == 503 and "draining" in raised.value.message
    asyncio.run(run())


def test_an_invalid_input_is_the_clients_400_and_a_stray_answer_is_ignored():
    async def run():
        h = Harness(worker("p0", Role.PREFILL))
        task = asyncio.create_task(h.service.embed([[1, 2]], MODEL))
        await settle()
        wid, msg = h.sent[-1]
        h.service.on_result("someone-else", EmbedResult(msg.request_id, "someone-else", 4, b"\0" * 16, 2), 0.0)
        h.service.on_failed(wid, RequestFailed(msg.request_id, wid, "input[0] has 9000 tokens", False, True))
        with pytest.raises(ApiError) as raised:
            await task
        assert (raised.value.status, raised.value.param) == (400, "input")
    asyncio.run(run())


def test_a_timeout_is_a_504_naming_the_setting_and_aborts_the_work():
    async def run():
        h = Harness(worker("p0", Role.PREFILL), requests={"embedding_timeout_s": 0.05})
        with pytest.raises(ApiError) as raised:
            await h.service.embed([[1, 2]], MODEL)
        assert raised.value.status == 504 and "embedding_timeout_s" in raised.value.message
        assert isinstance(h.sent[-1][1], Abort) and not h.service.pending
    asyncio.run(run())


def test_no_worker_or_too_many_tokens_in_flight_is_a_503():
    async def run():
        h = Harness(worker("d0", Role.DECODE), worker("p0", Role.PREFILL, draining=True))
        with pytest.raises(ApiError) as raised:
            await h.service.embed([[1]], MODEL)
        assert raised.value.status == 503
        h = Harness(worker("p0", Role.PREFILL))
        first = asyncio.create_task(h.service.embed([[1] * 80], MODEL))
        await settle()
        with pytest.raises(ApiError) as raised:
            await h.service.embed([[1] * 30], MODEL)
        assert raised.value.status == 503 and "embedding_max_inflight_tokens" in raised.value.message
        h.answer()
        await first
    asyncio.run(run())


def test_a_worker_speaking_the_protocol_before_embeddings_is_never_sent_one():
    async def run():
        h = Harness(worker("old", Role.PREFILL), worker("new", Role.BOTH))
        h.versions["old"] = MESSAGE_SINCE["EmbedRequest"] - 1
        task = asyncio.create_task(h.service.embed([[1, 2]], MODEL))
        await settle()
        assert [wid for wid, _ in h.sent] == ["new"]
        h.answer()
        await task
    asyncio.run(run())
