"""The KV transfer backends a test can run here: NIXL where it loads, ZeroMQ always."""
from __future__ import annotations

import pytest

try:
    import nixl._api  # noqa: F401

    NIXL_MISSING = ""
except ImportError as exc:
    NIXL_MISSING = f"NIXL is not installed or does not load: {exc}"

BACKENDS = [
    pytest.param("nixl", marks=pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING or "-")),
    "zmq",
]
# What the side that only pulls runs with: NIXL then needs no progress thread.
PULLER_OPTIONS = {"nixl": {"progress_thread": False}, "zmq": {}}
