"""The tests' fixture of a real Redis server (``common.cli.local_redis``) for several proxies sharing state. Tests
skip where ``redis-server`` is not installed (.ci/run installs it)."""
from __future__ import annotations

import pytest

from common.cli.local_redis import RedisServer, have_redis_server


@pytest.fixture
def redis_server():
    if not have_redis_server():
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run installs it)")
    server = RedisServer()
    yield server
    server.stop()
