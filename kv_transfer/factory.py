"""Building a KV transfer backend by name: the one place that imports the backends."""
from __future__ import annotations

import logging

from kv_transfer.base import BACKENDS, KVTransferBackend

log = logging.getLogger(__name__)


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
    """The backend a worker config asks for (``transfer_backend``; ``auto`` picks as above). NIXL comes with a
    ZeroMQ retry path (``kv_transfer/retry.py``): a failed NIXL read is read once more over ZeroMQ before the prompt
    is recomputed. Without it where CURVE is on but no peer keys are given: the ZeroMQ server could admit no peer.
    Peers on this host with GPU pools are pulled from over CUDA IPC where ``transfer.cuda_ipc`` is on (kv_transfer/
    cuda_ipc.py), whichever backend this is."""
    backend = _backend_for(config)
    backend.cuda_ipc = config.transfer.cuda_ipc
    return backend


def _backend_for(config) -> KVTransferBackend:
    from common.runtime.zmq_security import worker_curve

    name = config.transfer_backend
    if name == "auto":
        name = default_backend_name()
    curve = worker_curve(config)
    zmq_options = {"host": config.transfer_host, "curve": curve}
    if name == "zmq":
        return make_backend(name, **zmq_options)
    from kv_transfer.retry import RetryingBackend

    if curve is not None and curve.authorized_keys_dir is None:
        log.info("KV pulls over NIXL get no ZeroMQ retry: CURVE is on and security.curve_authorized_keys_dir is "
                 "empty")
        return RetryingBackend(make_backend(name), None)
    return RetryingBackend(make_backend(name), make_backend("zmq", **zmq_options))
