"""Building a KV transfer backend by name: the one place that imports the backends."""
from __future__ import annotations

from kv_transfer.base import BACKENDS, KVTransferBackend


def make_backend(name: str, **options) -> KVTransferBackend:
    """Build a backend by name (``nixl`` or ``zmq``); options go to its constructor."""
    if name == "nixl":
        from kv_transfer.nixl_backend import NixlBackend as backend
    elif name == "zmq":
        from kv_transfer.zmq_backend import ZmqBackend as backend
    else:
        raise ValueError(f"unknown KV transfer backend {name!r}: one of {BACKENDS}")
    return backend(**options)


def default_backend_name() -> str:
    """``nixl`` where its native library loads, else the ZeroMQ fallback."""
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return "zmq"
    return "nixl"


def backend_for(config) -> KVTransferBackend:
    """The backend a worker config asks for (``transfer_backend``; ``auto`` picks as above)."""
    from common.runtime.zmq_security import worker_curve

    name = config.transfer_backend
    if name == "auto":
        name = default_backend_name()
    options = {"host": config.transfer_host, "curve": worker_curve(config)} if name == "zmq" else {}
    return make_backend(name, **options)
