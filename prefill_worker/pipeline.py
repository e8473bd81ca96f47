"""A prefill worker's half of a pipelined hand-off: which pages each layer group of a prompt chunk makes final.

A prompt sent with ``kv_pipeline_layer_groups`` G has the model's layers split into G groups (``group_ends``). As
an engine step's forward finishes a group (the ``on_layers`` hook of ``LLMEngine.step``), each such prompt in the
step reports, in one KVProgress, the full blocks its chunk completed with that group's layers: from the block
holding the chunk's first token to the last block the chunk fills. A block is reported once per group, by the
chunk that fills it; the blocks the prompt found in this worker's prefix cache and its last, partial block are
never reported (the decode worker pulls them after PrefillDone). A prompt the scheduler preempted is computed
again into other blocks: right after the step that preempted it, a report with no blocks announces its new
generation (``after_step``), and the reports after carry it, so that the decode worker pulls again what it pulled
before.

The hook runs inside the step, on the compute loop: it only builds the messages, and ``send`` queues them for the
I/O thread, so the decode worker's pull of a group overlaps the forward of the groups after it.
"""
from __future__ import annotations

from collections.abc import Callable

from common.protocol import wire


def group_ends(num_layers: int, groups: int) -> list[int]:
    """The layer after each group's last: ``groups`` groups (at most one a layer), the first ones one layer longer
    where they do not divide evenly."""
    groups = max(1, min(groups, num_layers))
    size, longer = divmod(num_layers, groups)
    ends, end = [], 0
    for group in range(groups):
        end += size + (group < longer)
        ends.append(end)
    return ends


class LayerProgress:
    """The pipelined prompts a prefill worker computes, and the KVProgress their layer groups make."""

    def __init__(self, num_layers: int, block_size: int, worker_id: str, send: Callable[[object], None]) -> None:
        self.num_layers = num_layers
        self.block_size = block_size
        self.worker_id = worker_id
        self.send = send
        self.prompts: dict[str, list[int]] = {}  # request id -> its groups' ends
        self.generations: dict[str, int] = {}  # request id -> the generation its last report carried

    def add(self, request_id: str, groups: int) -> None:
        self.prompts[request_id] = group_ends(self.num_layers, groups)
        self.generations[request_id] = 0

    def discard(self, request_id: str) -> None:
        self.prompts.pop(request_id, None)
        self.generations.pop(request_id, None)

    def hook(self, epoch: int):
        """``LLMEngine.step``'s ``on_layers``, or None while no pipelined prompt is computed."""
        if not self.prompts:
            return None
        return lambda plan: self._for_step(plan, epoch)

    def _for_step(self, plan, epoch: int):
        """The layer counts after which ``plan``'s step reports, with the report (``ModelRunner.execute``'s
        ``on_layers``): the group ends of the pipelined prompts whose chunk fills a block; None when none does (the
        step runs as any other: on a GPU, each report waits for the device)."""
        bs, at = self.block_size, set()
        for seq, count in zip(plan.seqs, plan.num_new_tokens):
            ends = self.prompts.get(seq.request_id)
            if ends is not None and (seq.num_computed_tokens + count) // bs > seq.num_computed_tokens // bs:
                at.update(ends)
        if not at:
            return None
        return frozenset(at), lambda layers_done: self._on_layers(plan, layers_done, epoch)

    def _on_layers(self, plan, layers_done: int, epoch: int) -> None:
        bs = self.block_size
        for seq, count in zip(plan.seqs, plan.num_new_tokens):
            ends = self.prompts.get(seq.request_id)
            if ends is None or layers_done not in ends:
                continue
            group = ends.index(layers_done)
            first, end = seq.num_computed_tokens // bs, (seq.num_computed_tokens + count) // bs
            if end > first:
                self.send(wire.KVProgress(seq.request_id, self.worker_id, epoch, seq.num_preemptions, first,
                                          list(seq.block_table[first:end]), ends[group - 1] if group else 0,
                                          layers_done))

    def after_step(self, computing: dict, epoch: int) -> None:
        """After each step, before its PrefillDone: a pipelined prompt the step preempted announces its new
        generation (``computing``: request id -> (sequence, lease))."""
        for request_id, generation in self.generations.items():
            seq = computing[request_id][0] if request_id in computing else None
            if seq is not None and seq.num_preemptions != generation:
                self.generations[request_id] = seq.num_preemptions
                self.send(wire.KVProgress(request_id, self.worker_id, epoch, seq.num_preemptions, 0, [], 0, 0))
