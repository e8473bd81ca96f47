"""A decode worker's pipelined pull: one prompt's pages pulled a layer group at a time while its prefill worker
computes the prompt, and the rest once it is done.

Life cycle (``decode_worker/worker.py`` drives it; it alone owns the pulls and the blocks it names):
  DecodeRequest(kv_pipelined) -> the prompt's blocks reserved (``LLMEngine.reserve_prompt``: the leading ones this
  pool already holds are kept, ``transfer.delta_pull``) -> each KVProgress: one pull of those layers of those blocks,
  leaving out the blocks held here and any with a pull of the same layers still in flight -> the DecodeRequest
  after PrefillDone (``finish``: the sequence, every page's id, the lease) -> once no pull of a block is in flight,
  one pull of the whole of each block not yet complete under the prompt's last generation (the prefill worker's
  cached prefix, the last partial block, anything that failed or was pulled under an earlier generation) -> done:
  ``advance`` returns the outcome; the caller sends KVPulled and hands the sequence to the scheduler (kv_ready, or
  kv_failed: recompute the prompt here, as a failed pull does).
  ``cancel`` (abort, a lost peer, the proxy lost, the wait for PrefillDone past its bound) aborts every pull in
  flight; once it returns no byte lands in the blocks, and the caller frees them.

A pull of a layer range needs both pools at one tensor parallelism (the layers of a rank's slice are contiguous);
from a prefill worker of another, KVProgress is ignored and the whole prompt is pulled, staged, after PrefillDone.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from common.protocol import wire
from kv_transfer.base import TransferHandle, TransferStatus
from kv_transfer.segments import Layers

log = logging.getLogger(__name__)


def pull_bound(timeout_s: float, lease_left_s: float) -> tuple[float, str]:
    """A pull's deadline in seconds, ``kv_pull_timeout_s`` or what is left of the pages' lease if that ends sooner,
    and the setting it comes from (named when the pull fails for passing it)."""
    return (timeout_s, "kv_pull_timeout_s") if timeout_s <= lease_left_s else (
        lease_left_s, "the pages' lease: the proxy's kv_lease_s")


@dataclass
class Part:
    """One pull in flight: blocks (indexes into the prompt's blocks), from ``source_ids``, ``layers`` of them (None:
    whole), under ``generation``."""
    handle: TransferHandle
    blocks: list[int]
    source_ids: list[int]
    layers: Layers | None
    generation: int


@dataclass
class Outcome:
    ok: bool
    num_bytes: int  # every byte pulled, in layer groups and after PrefillDone
    error: str = ""


@dataclass
class PipelinedPull:
    request_id: str
    source: str
    epoch: int
    block_ids: list[int]  # the reserved blocks: the prompt's, in order
    held: int  # how many leading ones this pool already held (never pulled)
    num_layers: int
    staged: bool  # the source runs at another tensor parallelism: no layer pulls, the rest staged
    wait_ends: float  # time.monotonic() past which, with no PrefillDone, the reservation is given up
    generation: int = 0
    seq: object = None  # the engine's sequence, from ``finish`` on
    lease_ends: float = 0.0
    finished_at: float = 0.0  # time.monotonic() of ``finish``: the pull's time after PrefillDone counts from it
    final_ids: list[int] = field(default_factory=list)  # every page's id, from ``finish`` on
    parts: list[Part] = field(default_factory=list)
    done: dict[int, tuple[int, set[Layers]]] = field(default_factory=dict)  # block -> (source id, layers pulled)
    rest: set[int] = field(default_factory=set)  # blocks pulled whole after PrefillDone
    staging: list[int] = field(default_factory=list)
    bytes_during: int = 0  # pulled in layer groups, started while the prompt was computed
    bytes_after: int = 0  # pulled whole after PrefillDone
    failed: str = ""
    pulls: int = 0

    # ---- while the prompt is computed ------------------------------------------------------------------
    def on_progress(self, msg: wire.KVProgress, transfer, deadline_s: float) -> None:
        if self.seq is not None or msg.epoch != self.epoch or msg.generation < self.generation or self.staged:
            return
        if msg.generation > self.generation:  # computed again into other blocks: what was pulled is stale
            self.generation = msg.generation
            self.done.clear()
        layers = Layers(msg.layer_start, msg.layer_end)
        pairs = [(msg.first_block + i, source) for i, source in enumerate(msg.block_ids)
                 if self.held <= msg.first_block + i < len(self.block_ids)
                 and not self._in_flight(msg.first_block + i, layers)]
        if pairs:
            self._start([b for b, _ in pairs], [s for _, s in pairs], layers, transfer, deadline_s)

    def _in_flight(self, block: int, layers: Layers | None) -> bool:
        return any(block in part.blocks and (layers is None or part.layers is None or (
            part.layers.start < layers.end and layers.start < part.layers.end)) for part in self.parts)

    def _start(self, blocks: list[int], source_ids: list[int], layers: Layers | None, transfer,
               deadline_s: float, deadline_setting: str = "kv_pull_timeout_s") -> None:
        self.pulls += 1
        staging = None
        if layers is None and self.staged:
            staging = self.staging[:len(blocks)]
        try:
            handle = transfer.start_pull(f"{self.request_id}#{self.pulls}", self.source, source_ids,
                                         [self.block_ids[b] for b in blocks], deadline_s, staging, layers,
                                         deadline_setting=deadline_setting)
        except Exception as exc:  # a backend refusing a pull must not take the worker down
            log.warning("request %s: a pipelined pull failed to start: %s", self.request_id, exc)
            if layers is None:
                self.failed = f"pull failed to start: {exc}"
            return
        self.parts.append(Part(handle, blocks, source_ids, layers, self.generation))

    # ---- after PrefillDone -----------------------------------------------------------------------------
    def finish(self, seq, source_block_ids: list[int], lease_ends: float, staging: list[int]) -> None:
        """The prompt is computed: ``seq`` owns the blocks now; ``staging``: for a source of another tensor
        parallelism, as many blocks as the prompt's not held here."""
        self.seq, self.final_ids, self.lease_ends, self.staging = seq, list(source_block_ids), lease_ends, staging

    def whole(self, block: int) -> bool:
        source, layers = self.done.get(block, (-1, set()))
        return source == self.final_ids[block] and sum(r.end - r.start for r in layers) == self.num_layers

    def advance(self, transfer, now: float, deadline_s: float) -> Outcome | None:
        """Poll the pulls in flight; after ``finish``, start the rest and say how it ended (None: not yet)."""
        for part in [p for p in self.parts if transfer.poll(p.handle).terminal]:
            self.parts.remove(part)
            ok = part.handle.status is TransferStatus.DONE
            transfer.release(part.handle)
            if not ok:
                if part.layers is None:
                    self.failed = part.handle.error or "the transfer failed"
                continue
            if part.layers is not None:
                self.bytes_during += part.handle.num_bytes
            else:
                self.bytes_after += part.handle.num_bytes
            if part.generation == self.generation:
                for block, source in zip(part.blocks, part.source_ids):
                    if part.layers is None:
                        self.done[block] = (source, {Layers(0, self.num_layers)})
                        continue
                    pulled = self.done.setdefault(block, (source, set()))
                    if pulled[0] == source:
                        pulled[1].add(part.layers)
        if self.seq is None:
            return None
        todo = [b for b in range(self.held, len(self.block_ids))
                if b not in self.rest and not self.whole(b) and not self._in_flight(b, None)]
        if todo and not self.failed:
            if now >= self.lease_ends:
                self.failed = "the pages' lease (the proxy's kv_lease_s) ran out before the pull could start"
            else:
                self.rest.update(todo)
                self._start(todo, [self.final_ids[b] for b in todo], None, transfer,
                            *pull_bound(deadline_s, self.lease_ends - now))
                return None
        if self.parts:
            return None
        if not self.failed and now > self.lease_ends:
            self.failed = "the pull ended after the pages' lease (the proxy's kv_lease_s)"
        if not self.failed and not all(self.whole(b) for b in range(self.held, len(self.block_ids))):
            self.failed = "pages missing after the pull"
        return Outcome(not self.failed, self.bytes_during + self.bytes_after, self.failed)

    def cancel(self, transfer) -> None:
        """Abort every pull in flight; on return no byte lands in the blocks (nor in the staging ones)."""
        for part in self.parts:
            transfer.release(part.handle)  # aborts first
        self.parts.clear()
