"""What a worker announces when it registers with the proxy: who it is, what it serves, and what it can hold.

Built once at start and again under each new epoch (``worker_runtime`` ``WorkerIO`` sends it): the worker's id,
role and epoch; the model name and version requests are routed by (``common.storage.model_store``
``model_identity``); its KV layout and pool (the proxy pairs only workers of one version, which must agree on the
layout); the KV transfer agent's metadata; its decode slots, speculation and the cores it time-shares; its host and NVLink fabric (``topology``); the other
models it may load (``model_swap``); where it publishes its KV events (``kv_events``);
the hash of its tokenizer files, which it sends a proxy that has no tokenizer
of its model (``tokenizer_answer``, on the I/O thread). ``await_acknowledgement`` waits for the proxy's answer at
start; ``rejoin`` registers again when the proxy lost the worker (its Reregister).
"""
from __future__ import annotations

import logging
from pathlib import Path

from common.protocol import wire
from common.protocol.versions import sendable
from common.runtime.core_share import core_group
from common.runtime.topology import interconnect_domain
from common.text.tokenizer_files import read_tokenizer_files, tokenizer_sha256

log = logging.getLogger(__name__)


def registration(worker) -> wire.Register:
    """``worker``: a role handler (``worker_runtime.WorkerBase``) with its engine loaded."""
    config, engine = worker.config, worker.engine
    layout = engine.runner.layout
    return wire.Register(
        worker_id=config.worker_id, role=worker.role, epoch=worker.epoch, model=worker.model_name,
        model_version=worker.model_version,
        kv_layout=wire.KVLayoutInfo(layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim,
                                    layout.dtype),
        num_blocks=engine.block_manager.num_blocks, max_model_len=engine.max_model_len,
        transfer_backend=worker.transfer_name, transfer_metadata=worker.transfer_metadata,
        max_num_seqs=config.engine.max_num_seqs, core_group=core_group(config.core_share),
        standby=list(worker.standby), load_s=worker.load_s, tokenizer_sha256=worker.tokenizer_sha256,
        tensor_parallel_size=config.engine.tensor_parallel_size, kv_events_endpoint=worker.kv_events_endpoint,
        kv_events_public_key=worker.kv_events_public_key, host=config.host_name,
        interconnect_domain=interconnect_domain(engine.runner.device),
        **({} if config.engine.spec.method == "off" else {
            "spec_num_tokens": config.engine.spec.num_tokens,
            "spec_max_batch_size": config.engine.spec.max_batch_size}),
    )


def tokenizer_digest(files: dict[str, bytes]) -> str:
    """The hash of a model directory's tokenizer files (``Register.tokenizer_sha256``); "" when they are more than
    one TokenizerFiles carries, so that no proxy asks for them."""
    return tokenizer_sha256(files) if sum(map(len, files.values())) <= wire.TOKENIZER_MAX_BYTES else ""


def tokenizer_answer(model_dir: Path, msg: wire.FetchTokenizer, worker_id: str,
                     speaks: int) -> wire.TokenizerFiles | None:
    """The I/O thread's answer to a FetchTokenizer from a proxy speaking ``speaks``: the tokenizer files of
    ``model_dir`` (the model loaded last), when they are those asked for. None otherwise (logged): the proxy asks
    another worker once its ``tokenizer_fetch_timeout_s`` passed."""
    try:
        files = read_tokenizer_files(model_dir)
    except OSError as error:
        log.warning("the proxy asked for tokenizer %s; reading it failed: %s", msg.sha256, error)
        return None
    if not sendable(wire.TokenizerFiles, speaks) or tokenizer_digest(files) != msg.sha256:
        log.warning("the proxy asked for tokenizer %s, which this worker's model (%s) does not hold", msg.sha256,
                    model_dir)
        return None
    return wire.TokenizerFiles(worker_id, msg.sha256, files)


def await_acknowledgement(config, registered, refused, curve: bool) -> None:
    """Wait until the proxy acknowledged the first Register (``registered``: a threading.Event the I/O thread sets),
    up to ``register_timeout_s``; raise when it did not, or refused it (``refused()``: why, or None)."""
    if not registered.wait(config.register_timeout_s):
        hint = (" or refused this worker's CURVE key (is its public key in the proxy's curve_authorized_keys_dir? "
                "the proxy logs refusals)" if curve else "")
        raise TimeoutError(f"the proxy at {config.proxy_address} did not acknowledge registration within "
                           f"{config.register_timeout_s}s (setting register_timeout_s){hint}")
    if (reason := refused()) is not None:
        raise RuntimeError(f"the proxy refused this worker: {reason}")


def rejoin(io, handler, msg: wire.Reregister) -> None:
    """The proxy lost this worker (``io``: its WorkerIO; ``handler``: its role handler): whoever asked for the running
    requests can no longer get their tokens; they are dropped, and the worker registers again under a new epoch."""
    log.warning("the proxy does not know this worker (%s): dropping its requests and registering again", msg.reason)
    if handler.engine is None:  # standing by (model_swap.py): its Standby messages tell the proxy
        return
    handler.metrics.status.registered = False
    handler.fail_all("the proxy that sent this request lost this worker")
    handler.new_epoch()  # whatever the proxy or a puller still has of the old one is stale
    io.registration = handler.registration()
    io.rejoin()
