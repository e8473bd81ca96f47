"""Tokenizers the proxy gets from workers: a model directory it was never given serves at once.

A version whose tokenizer the proxy's registry does not hold, and which is not the proxy's own model, is served with
the tokenizer files of its workers' model directory (``ServedModels`` asks ``tokenizer`` with the version's workers):

    a worker's Register reports tokenizer_sha256
    -> the first request for the version finds no <cache root>/tokenizers/<sha256>/: FetchTokenizer to one worker
       of it; that request and the next ones get 503 + Retry-After ("being fetched from worker X")
    -> the worker's I/O thread answers TokenizerFiles (common/runtime/registration.py ``tokenizer_answer``)
    -> ``on_files``: the files hash to what was asked (else logged, counted as malformed and dropped), are written
       to a temporary directory renamed into place, and the next request loads the ``Tokenizer`` from there.

One fetch per hash at a time, never one per request. An answer that does not come within
``tokenizer_fetch_timeout_s`` is given up (logged), so the next request asks another worker of the version (each in
turn). The directory outlives the proxy: a restarted proxy, or another on the same host, reads it without a fetch;
its files are hashed again as they are loaded, so a damaged one is fetched anew.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from common.protocol.versions import sendable
from common.protocol.wire import FetchTokenizer, TokenizerFiles
from common.storage.model_store import default_cache_root
from common.text.tokenizer import Tokenizer
from common.text.tokenizer_files import read_tokenizer_files, tokenizer_sha256
from proxy.core.errors import ApiError
from proxy.core.workers import WorkerState

log = logging.getLogger("tessera.proxy")


@dataclass
class _Fetch:
    """The fetch of one hash: the worker asked last (None: none is waited for), until when, and every one asked."""
    worker_id: str | None = None
    deadline: float = 0.0
    asked: set[str] = field(default_factory=set)


class TokenizerFetcher:
    def __init__(self, config, send, metrics, peer_versions: dict[str, int], cache_root: Path | None = None,
                 clock=time.monotonic) -> None:
        """``send(worker_id, msg)``: the cluster's; ``peer_versions``: each worker's protocol version (one before
        FetchTokenizer's is never asked); ``cache_root``: the fetched files go under its ``tokenizers/`` (None: the
        default cache root's)."""
        self.config = config
        self.send = send
        self.metrics = metrics
        self.peer_versions = peer_versions
        self.root = (cache_root or default_cache_root()) / "tokenizers"
        self.clock = clock
        self._fetches: dict[str, _Fetch] = {}  # sha256 -> its fetch under way

    def tokenizer(self, model: str, digest: str, workers: list[WorkerState]) -> Tokenizer:
        """The tokenizer whose files hash to ``digest``, that ``workers`` (of version ``model``, name@version)
        reported; ApiError 503 while it is fetched from one of them."""
        cached = self._cached(digest)
        if cached is not None:
            return cached
        fetch = self._fetches.setdefault(digest, _Fetch())
        now = self.clock()
        if fetch.worker_id is not None and now > fetch.deadline:
            log.warning("worker %r did not send the tokenizer of %s within tokenizer_fetch_timeout_s=%gs; asking "
                        "another worker", fetch.worker_id, model, self.config.tokenizer_fetch_timeout_s)
            fetch.worker_id = None
        if fetch.worker_id is None:
            able = sorted(w.worker_id for w in workers
                          if sendable(FetchTokenizer, self.peer_versions.get(w.worker_id, 0)))
            if not able:
                raise ApiError(503, f"the proxy has no tokenizer for {model}, and none of its workers speaks the "
                               "protocol version that sends one: register that version in the proxy host's model "
                               "registry (tessera model register)", code="model_not_loaded", param="model",
                               retry_after_s=self.config.requests.retry_after_s)
            untried = [worker_id for worker_id in able if worker_id not in fetch.asked]
            if not untried:  # each was asked once: in turn again
                fetch.asked.clear()
                untried = able
            fetch.worker_id, fetch.deadline = untried[0], now + self.config.tokenizer_fetch_timeout_s
            fetch.asked.add(fetch.worker_id)
            self.send(fetch.worker_id, FetchTokenizer(fetch.worker_id, digest))
            log.info("asked worker %r for the tokenizer of %s (%s)", fetch.worker_id, model, digest)
        raise ApiError(503, f"the tokenizer of {model} is being fetched from worker {fetch.worker_id!r}; try again",
                       code="model_not_loaded", param="model", retry_after_s=self.config.requests.retry_after_s)

    def on_files(self, sender: str, msg: TokenizerFiles, now: float) -> None:
        """A worker's answer: kept under the cache root when its files are those asked for."""
        fetch = self._fetches.get(msg.sha256)
        if fetch is None or sender != msg.worker_id:
            log.debug("ignoring TokenizerFiles %s from %r: not asked for", msg.sha256, sender)
            return
        if fetch.worker_id == sender:
            fetch.worker_id = None  # answered: the next request asks again should this answer be no good
        digest = tokenizer_sha256(msg.files)
        if digest != msg.sha256:
            self.metrics.malformed_messages.inc()
            log.warning("dropped the tokenizer worker %r sent: its files hash to %s, not %s", sender, digest,
                        msg.sha256)
            return
        try:
            self._store(digest, msg.files)
        except OSError as error:
            log.error("the tokenizer %s from worker %r cannot be kept under %s: %s", digest, sender, self.root, error)
            return
        del self._fetches[digest]
        log.info("the tokenizer %s from worker %r is kept in %s", digest, sender, self.root / digest)

    def _cached(self, digest: str) -> Tokenizer | None:
        """The tokenizer kept under the cache root, when its files still hash to ``digest``."""
        path = self.root / digest
        if not path.is_dir():
            return None
        try:
            intact = tokenizer_sha256(read_tokenizer_files(path)) == digest
            if intact:
                return Tokenizer(path)
        except Exception as error:  # noqa: BLE001 - whatever a damaged file makes the tokenizer library raise
            log.warning("the tokenizer kept in %s cannot be loaded (%s); fetching it again", path, error)
        else:
            log.warning("the tokenizer files in %s no longer hash to their name; fetching them again", path)
        shutil.rmtree(path, ignore_errors=True)
        return None

    def _store(self, digest: str, files: dict[str, bytes]) -> None:
        """Write ``files`` to ``<root>/<digest>/`` at once: into a temporary directory, then renamed."""
        self.root.mkdir(parents=True, exist_ok=True)
        partial = self.root / f".{digest}.{uuid.uuid4().hex}.partial"
        partial.mkdir()
        try:
            for name, content in files.items():
                (partial / name).write_bytes(content)
            try:
                os.rename(partial, self.root / digest)
            except OSError:
                if not (self.root / digest).is_dir():
                    raise
                # another proxy on this host kept it first: its files hash the same
        finally:
            shutil.rmtree(partial, ignore_errors=True)
