"""The resume contexts a proxy keeps in the shared store (proxy/edge/shared_streams.py) across an outage of the store:
a context that expired while the store was unreachable is written again, whole, by the first flush that succeeds."""
from __future__ import annotations

import asyncio
import socket

import redis
import redis.asyncio as aioredis

from common.cli.local_cluster import free_port
from common.config.roles import ProxyConfig
from proxy.edge.shared_streams import SharedStreams
from tests.redis_server import redis_server  # noqa: F401 - fixture


def test_a_context_that_expired_during_an_outage_is_written_again(redis_server):  # noqa: F811
    config = ProxyConfig(shared_state={"redis_url": redis_server.url, "timeout_s": 0.5})
    store = redis.Redis.from_url(redis_server.url)
    key = config.shared_state.key_prefix + "stream:"

    async def run() -> None:
        live = aioredis.Redis.from_url(redis_server.url)
        down = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}")  # nothing listens there
        shared = SharedStreams(config, live)
        shared.keep("first", b"context-1")
        await shared.flush()
        assert store.get(key + "first") == b"context-1" and shared.up
        store.delete(key + "first")  # its key expires while the store cannot be reached
        shared._client = down
        shared.keep("second", b"context-2")
        await shared.flush()
        assert not shared.up
        shared._client = live
        await shared.flush()
        assert shared.up
        assert store.get(key + "first") == b"context-1" and store.get(key + "second") == b"context-2"
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
