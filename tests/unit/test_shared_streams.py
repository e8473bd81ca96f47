"""The resume contexts a proxy keeps in the shared store (proxy/edge/shared_streams.py): a new stream's is written at
once and its first event waits for it; a finished stream's stays until the stream leaves the proxy's resume buffer;
across an outage of the store, a context that expired while the store was unreachable is written again, whole, by the
first flush that succeeds."""
from __future__ import annotations

import asyncio
import socket

import redis
import redis.asyncio as aioredis

from common.cli.local_cluster import free_port
from common.config.roles import ProxyConfig
from proxy.core.metrics import ProxyMetrics
from proxy.edge.resumable import StreamStore
from proxy.edge.shared_streams import SharedStreams
from tests.redis_server import redis_server  # noqa: F401 - fixture


def test_a_context_that_expired_during_an_outage_is_written_again(redis_server):  # noqa: F811
    config = ProxyConfig(shared_state={"redis_url": redis_server.url, "timeout_s": 0.5})
    store = redis.Redis.from_url(redis_server.url)
    key = config.shared_state.key_prefix + "stream-context:"

    async def run() -> None:
        live = aioredis.Redis.from_url(redis_server.url)
        down = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}")  # nothing listens there
        shared = SharedStreams(config, live)
        shared.keep("first", b"context-1")
        await shared.flush()
        assert store.hget(key + "first", "context") == b"context-1" and shared.up
        store.delete(key + "first")  # its key expires while the store cannot be reached
        shared._client = down
        shared.keep("second", b"context-2")
        await shared.flush()
        assert not shared.up
        shared._client = live
        await shared.flush()
        assert shared.up
        assert store.hget(key + "first", "context") == b"context-1"
        assert store.hget(key + "second", "context") == b"context-2"
        await live.aclose()
        await down.aclose()

    asyncio.run(run())


def test_a_store_that_never_answers_is_given_up_on_naming_the_setting(caplog):
    """A Redis that takes the connection and says nothing: each read gives up after shared_state.timeout_s, and the
    warning names it."""
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody reads or answers
    config = ProxyConfig(shared_state={"redis_url": "redis://unused", "timeout_s": 0.3})

    async def run() -> None:
        client = aioredis.Redis(host="127.0.0.1", port=silent.getsockname()[1])
        shared = SharedStreams(config, client)
        assert await shared.peek("r1") is None and await shared.claim("r1") is None
        shared.keep("r1", b"context")
        await shared.flush()
        assert not shared.up
        await client.aclose()

    with caplog.at_level("WARNING", logger="tessera.proxy.shared"):
        asyncio.run(asyncio.wait_for(run(), 30))  # a bound against a hang, not a timing
    silent.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "tessera.proxy.shared"]
    assert len(warnings) == 3 and all("no answer within shared_state.timeout_s (0.3s)" in w for w in warnings), warnings


def test_a_new_streams_context_is_stored_before_its_first_event_and_not_waited_for_while_the_store_is_away(
        redis_server):  # noqa: F811
    """``stored`` returns once a flush wrote the context (the flusher woken by ``keep``, not at its interval, which
    is set far longer than the test's bound); with the store away, once a flush failed, and at once after."""
    config = ProxyConfig(shared_state={"redis_url": redis_server.url, "interval_s": 10, "timeout_s": 0.5})
    store = redis.Redis.from_url(redis_server.url)
    key = config.shared_state.key_prefix + "stream-context:"

    async def run() -> None:
        live = aioredis.Redis.from_url(redis_server.url)
        shared = SharedStreams(config, live)
        flusher = asyncio.create_task(shared.run())
        await asyncio.sleep(0)  # the flusher waits for its wakeup
        shared.keep("r1", b"context-1")
        await shared.stored("r1")
        assert store.hget(key + "r1", "context") == b"context-1"
        down = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}")  # nothing listens there
        shared._client = down
        shared.keep("r2", b"context-2")
        await shared.stored("r2")  # the flush that tried it failed
        assert not shared.up and store.hget(key + "r2", "context") is None
        shared.keep("r3", b"context-3")
        await shared.stored("r3")  # the store is away: no wait
        flusher.cancel()
        for client in (live, down):
            await client.aclose()

    asyncio.run(asyncio.wait_for(run(), 30))  # a bound against a hang, not a timing


def test_a_finished_streams_context_stays_until_it_leaves_the_resume_buffer(redis_server):  # noqa: F811
    """Its client may not have read its last events when its proxy dies, and its worker forgot it: the context is
    what lets another proxy compute it again. It goes when the stream leaves the buffer; a stream handed over keeps
    its key for the proxy taking it."""
    config = ProxyConfig(shared_state={"redis_url": redis_server.url})
    store = redis.Redis.from_url(redis_server.url)
    key = config.shared_state.key_prefix + "stream-context:"

    async def produce(stream):
        yield "data: {}\n\n", (1,)

    async def run() -> None:
        live = aioredis.Redis.from_url(redis_server.url)
        streams = StreamStore(config, ProxyMetrics())
        streams.shared = SharedStreams(config, live)
        for response_id in ("ended", "handed"):
            streams.share(response_id, b"context-" + response_id.encode())
            await streams.shared.flush()
            stream = streams.feed(response_id, "default", produce, lambda why: None)
            await stream.producer
            assert stream.finished
        await streams.shared.flush()
        assert store.hget(key + "ended", "context") == b"context-ended"
        assert store.hget(key + "handed", "context") == b"context-handed"
        streams.drop(streams.streams["ended"])
        streams.sever({"handed"})
        await streams.shared.flush()
        assert store.hget(key + "ended", "context") is None
        assert store.hget(key + "handed", "context") == b"context-handed"
        await live.aclose()

    asyncio.run(asyncio.wait_for(run(), 30))


def test_a_proxy_leaves_alone_a_context_another_proxy_took_over(redis_server):  # noqa: F811
    """Proxy A still holds a stream when proxy B takes it over (claims its context and keeps it as its own): A's
    renewal, its rewrite after an outage and its delete when the stream leaves its buffer do not touch B's key."""
    config = ProxyConfig(shared_state={"redis_url": redis_server.url})
    store = redis.Redis.from_url(redis_server.url)
    key = config.shared_state.key_prefix + "stream-context:r1"

    async def run() -> None:
        live = aioredis.Redis.from_url(redis_server.url)
        a, b = SharedStreams(config, live), SharedStreams(config, live)
        a.keep("r1", b"context-a")
        await a.flush()
        assert store.hgetall(key) == {b"owner": a.owner.encode(), b"context": b"context-a"}
        assert await b.claim("r1") == b"context-a" and not store.exists(key)
        b.keep("r1", b"context-b")
        await b.flush()
        a._refreshed = -1e9  # A's next flush renews its keys
        a._new.add("r1")  # and writes again what it keeps, as after an outage
        await a.flush()
        assert store.hgetall(key) == {b"owner": b.owner.encode(), b"context": b"context-b"}
        ttl = store.pttl(key)
        a.forget("r1")
        await a.flush()
        assert store.hget(key, "context") == b"context-b" and store.pttl(key) <= ttl
        b.forget("r1")  # its owner deletes it
        await b.flush()
        assert not store.exists(key)
        await live.aclose()

    asyncio.run(asyncio.wait_for(run(), 30))


def test_a_proxy_that_took_a_stream_over_from_its_worker_replaces_the_lost_proxys_key(redis_server):  # noqa: F811
    """Taken over from the workers (no ``claim``: they held every choice), the stream's key is still the lost
    proxy's: the taker's write replaces it, and from then on it renews and deletes it; a plain write is refused
    and says so."""
    config = ProxyConfig(shared_state={"redis_url": redis_server.url})
    store = redis.Redis.from_url(redis_server.url)
    key = config.shared_state.key_prefix + "stream-context:r1"

    async def run() -> None:
        live = aioredis.Redis.from_url(redis_server.url)
        lost, plain, taker = (SharedStreams(config, live) for _ in range(3))
        lost.keep("r1", b"context-lost")
        await lost.flush()
        plain.keep("r1", b"context-plain")
        await plain.flush()
        assert store.hget(key, "owner") == lost.owner.encode()
        taker.keep("r1", b"context-taker", taken=True)
        await taker.flush()
        assert store.hgetall(key) == {b"owner": taker.owner.encode(), b"context": b"context-taker"}
        taker._new.add("r1")  # written again, as after an outage: still its own
        await taker.flush()
        assert store.hget(key, "owner") == taker.owner.encode()
        taker.forget("r1")
        await taker.flush()
        assert not store.exists(key)
        await live.aclose()

    asyncio.run(asyncio.wait_for(run(), 30))


def test_a_store_that_lost_the_script_gets_it_again_in_the_same_flush(redis_server):  # noqa: F811
    """A Redis that restarted (its script cache empty) is no outage: the flush loads the script again and writes."""
    config = ProxyConfig(shared_state={"redis_url": redis_server.url})
    store = redis.Redis.from_url(redis_server.url)

    async def run() -> None:
        live = aioredis.Redis.from_url(redis_server.url)
        shared = SharedStreams(config, live)
        shared.keep("r1", b"context-1")
        await shared.flush()
        store.script_flush()
        shared.keep("r2", b"context-2")
        await shared.flush()
        assert shared.up and store.hget(config.shared_state.key_prefix + "stream-context:r2", "context") == b"context-2"
        await live.aclose()

    asyncio.run(asyncio.wait_for(run(), 30))
