"""Structured output on the worker: compiled grammars, one matcher per constrained sequence, the step's token mask.

A request's ``SamplingParams.structured`` (a JSON schema, any JSON object, a regex, a choice or an EBNF grammar)
compiles with xgrammar against this model's tokenizer (chosen by measurement: ``bench/grammar_engines.py``);
compiled grammars are cached per constraint. Each constrained sequence holds a matcher (``Sequence.grammar``)
that has accepted its output so far. A sequence that arrives with output (handed off by a prefill worker, resumed
elsewhere, continued) replays it, so the matcher is where plain generation would have left it.

Each step, before sampling, ``mask`` fills one allowed-token bitmask row per logits row of a constrained
sequence, xgrammar's batch call filling the rows in C++, and ``kernels/token_mask.c`` sets every disallowed logit
to -inf in place: the sampler, the greedy fast path, logprobs and draft verification all see the masked logits.
A sequence verifying k drafts has k + 1 rows: row i's mask is the grammar's state after drafts 1..i, found by
accepting them one at a time and rolling the matcher back afterwards. A draft the grammar forbids ends that walk
(the rows after it are never used): its logit is -inf in the row that scores it, so verification rejects it like
any other mismatch. After the step, ``advance`` feeds each matcher the tokens its sequence kept.

Without a C compiler the mask is applied by torch (unpacking the bits); without xgrammar a constrained request is
refused (400) naming the missing package.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import json
import logging
import re
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

from common.engine.native import kernel_function
from common.engine.sequence import FinishReason, Sequence
from common.protocol.sampling_params import StructuredOutput
from common.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Compiled grammars kept for reuse (xgrammar evicts the least recently used past this).
COMPILED_CACHE_BYTES = 256 << 20
# xgrammar's errors start with "[time] /path/file.cc:line: "; the client gets what follows.
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class GrammarError(ValueError):
    """A constraint that does not compile, or output it does not accept: the client's 400."""


@functools.cache
def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # an install without it serves everything else
        raise GrammarError(f"structured output needs the xgrammar package on the worker ({exc})") from None
    return xgrammar


def _mask_kernel():
    return kernel_function("token_mask", "tessera_apply_token_mask",
                           (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p) + (ctypes.c_int,) * 3
                           + (ctypes.c_int64,))


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf each logit of ``logits[rows[i]]`` whose bit in ``bitmask[i]`` is 0 (and those past the mask)."""
    if not rows:
        return
    kernel = _mask_kernel() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if kernel is not None and logits.stride(1) == 1 and bitmask.is_contiguous():
        index = torch.tensor(rows, dtype=torch.int64)
        if kernel(logits.data_ptr(), bitmask.data_ptr(), index.data_ptr(), len(rows), logits.shape[1],
                  bitmask.shape[1], logits.stride(0)) == 0:
            return
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[: len(rows), :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool().to(logits.device)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def tokenizer_info(xgr, model_dir: Path, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the model's tokenizer (``TokenizerInfo``), read from its tokenizer.json with the tokenizers
    library as xgrammar's ``from_huggingface`` reads a fast tokenizer: the vocabulary with its added tokens, each at
    its id, and the vocabulary type and prefix-space rule that the tokenizer's JSON implies. Without transformers'
    ``AutoTokenizer``, whose imports and load cost a worker's first constrained request 2-4 CPU-s on 2 cores. Where
    there is no tokenizer.json, where the JSON's vocabulary type and the vocabulary's own disagree (xgrammar then
    probes the tokenizer's encoding, which needs transformers) or where this xgrammar lacks the helpers, through
    ``from_huggingface`` itself (tests/unit/test_structured_output.py holds the two equal)."""
    if (Path(model_dir) / "tokenizer.json").is_file():
        backend = Tokenizer(model_dir).backend  # the process's parse of the file, shared
        vocab = backend.get_vocab(with_added_tokens=True)
        try:
            metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
            own_type = xgr.TokenizerInfo._detect_vocab_type_from_vocab(vocab)
        except (AttributeError, TypeError, ValueError):  # an xgrammar other than the one pinned (Makefile)
            metadata, own_type = None, None
        if (isinstance(metadata, dict) and {"vocab_type", "add_prefix_space"} <= metadata.keys()
                and own_type in (None, metadata["vocab_type"])):
            encoded = [""] * vocab_size
            for token, index in vocab.items():
                if index < vocab_size:
                    encoded[index] = token
            return xgr.TokenizerInfo(encoded, vocab_type=metadata["vocab_type"], vocab_size=vocab_size,
                                     stop_token_ids=stop_token_ids, add_prefix_space=metadata["add_prefix_space"])
    from transformers import AutoTokenizer  # the worker has it; only this path needs it

    return xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir), vocab_size=vocab_size,
                                              stop_token_ids=stop_token_ids)


class StructuredOutputs:
    """One engine's grammar compiler, its constrained sequences, and the step's token mask."""

    def __init__(self, model_dir: Path, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.threads = torch.get_num_threads()  # the model's threads: masks are filled between its passes
        self.live: set[Sequence] = set()  # constrained sequences not yet seen finished
        self._compiler = None
        self._batch = None
        self._lock = threading.Lock()
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)

    def _compiler_for(self):
        """The compiler over this model's tokenizer, built at the first constrained request (about a second)."""
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = tokenizer_info(xgr, self.model_dir, self.vocab_size, self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=True,
                                                     cache_limit_bytes=COMPILED_CACHE_BYTES)
                self._batch = xgr.BatchGrammarMatcher(max_threads=self.threads)
                words = xgr.get_bitmask_shape(1, self.vocab_size)[1]
                self._bitmask = torch.empty(0, words, dtype=torch.int32)
                stop = np.zeros(words, dtype=np.uint32)  # bit (token % 32) of word (token // 32)
                for token in self.stop_token_ids:
                    stop[token // 32] |= np.uint32(1 << (token % 32))
                self._stop_row = torch.from_numpy(stop.view(np.int32))
            return self._compiler

    def compile(self, constraint: StructuredOutput):
        """The compiled grammar of ``constraint`` (cached by the compiler); GrammarError names what is wrong."""
        compiler = self._compiler_for()
        kind = constraint.kind
        try:
            if kind == "json_schema":
                # Compact JSON (no free whitespace): a model cannot stall in a run of blanks or newlines.
                return compiler.compile_json_schema(constraint.spec, any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object", "additionalProperties": true}',
                                                    any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(constraint.spec)
            if kind == "choice":
                alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in constraint.choices)
                return compiler.compile_grammar(f"root ::= {alternatives}")
            return compiler.compile_grammar(constraint.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            what = {"json_schema": "JSON schema", "grammar": "grammar"}.get(kind, kind)
            raise GrammarError(f"the {what} of the request's structured output does not compile: "
                               f"{_SOURCE_PREFIX.sub('', str(exc)).strip()}") from None

    def attach(self, seq: Sequence) -> None:
        """Give ``seq`` a matcher of its request's constraint that has accepted its output so far."""
        matcher = _xgrammar().GrammarMatcher(self.compile(seq.params.structured))
        for position, token in enumerate(seq.output_token_ids):
            if not matcher.accept_token(token):
                raise GrammarError(f"output token {position} (id {token}) is outside the request's structured "
                                   "output constraint")
        seq.grammar = matcher
        self.live.add(seq)

    def _bitmask_rows(self, rows: int) -> torch.Tensor:
        if self._bitmask.shape[0] < rows:
            self._bitmask = torch.empty(max(rows, 2 * self._bitmask.shape[0]), self._bitmask.shape[1],
                                        dtype=torch.int32)
        return self._bitmask

    def mask(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]) -> None:
        """Mask ``logits`` (a step's rows: one per sequence, plus one per draft of a verifying one) in place."""
        bitmask, rows = self.fill(seqs, drafts)
        apply_token_mask(logits, bitmask, rows)

    def fill(self, seqs: list[Sequence], drafts: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """The step's mask: bitmask row i is for logits row ``rows[i]``.

        A row whose grammar has ended (its stop token accepted, by the sequence or by a draft before the row) or
        allows nothing (a constraint no text satisfies) allows the stop tokens only: never an unconstrained token.
        """
        counts = [len(d) + 1 for d in drafts]
        starts = [total - count for total, count in zip(itertools.accumulate(counts), counts)]
        active = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        rows: list[int] = []
        if not active:
            return self._bitmask, rows
        bitmask = self._bitmask_rows(sum(counts[i] for i in active))
        walked = dict.fromkeys(active, 0)  # drafts each matcher accepted while the masks were filled
        depth = 0
        try:
            while active:
                ended, going = [], []
                for i in active:
                    (ended if seqs[i].grammar.is_terminated() else going).append(i)
                if going:
                    self._batch.batch_fill_next_token_bitmask(
                        [seqs[i].grammar for i in going], bitmask, indices=list(range(len(rows), len(rows) + len(going))))
                rows.extend(starts[i] + depth for i in going)
                # An ended grammar's rows, this one and those of the drafts after it, allow the stop tokens alone.
                stops = [starts[i] + row for i in ended for row in range(depth, counts[i])]
                bitmask[len(rows):len(rows) + len(stops)] = self._stop_row
                rows.extend(stops)
                going = [i for i in going if len(drafts[i]) > depth]
                if not going:
                    break
                accepted = self._batch.batch_accept_token([seqs[i].grammar for i in going],
                                                          [drafts[i][depth] for i in going])
                active = [i for i, ok in zip(going, accepted) if ok]
                for i in active:
                    walked[i] += 1
                depth += 1
        finally:
            back = [(seqs[i].grammar, n) for i, n in walked.items() if n]
            if back:
                self._batch.batch_rollback([m for m, _ in back], [n for _, n in back])
        empty = ~bitmask[: len(rows)].any(dim=1)
        if empty.any():  # nothing allowed: end the output rather than sample from -inf everywhere
            bitmask[: len(rows)][empty] = self._stop_row
        return bitmask, rows

    def advance(self, seqs: list[Sequence], before: dict[int, int],
                finish: Callable[[Sequence, FinishReason], None]) -> None:
        """Feed each constrained sequence's matcher the tokens the step appended (``before``: seq id -> its token
        count before the step). A sequence whose grammar has ended while it runs on (``ignore_eos``, or a stop
        token the grammar does not know) stops there."""
        new = {seq: seq.token_ids[before[seq.seq_id]:] for seq in seqs if seq.grammar is not None}
        depth = 0
        while True:
            going = [seq for seq, tokens in new.items() if len(tokens) > depth]
            if not going:
                break
            open_ = [seq for seq in going if not seq.grammar.is_terminated()]
            accepted = dict(zip(open_, self._batch.batch_accept_token([seq.grammar for seq in open_],
                                                                      [new[seq][depth] for seq in open_])))
            for seq in going:
                if not accepted.get(seq, False):  # past the grammar's end (a stop token the mask allowed there)
                    if not seq.is_finished:
                        finish(seq, FinishReason.STOP)
                    new[seq] = new[seq][:depth]
            depth += 1
        for seq in new:
            if seq.grammar.is_terminated() and (not seq.is_finished or seq.finish_reason is FinishReason.HANDOFF):
                finish(seq, FinishReason.STOP)  # a handed-off one too: its decode worker could only emit stops
        self.live = {seq for seq in self.live if not seq.is_finished}
