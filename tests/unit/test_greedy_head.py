"""The greedy LM head (common/engine/greedy_head.py): the same token as the whole bfloat16 head's argmax, ties and
near-ties included, from the int8 copy and the exact logits of the tiles it cannot rule out."""
from __future__ import annotations

import types

import pytest
import torch

from common.config.base import CpuConfig, EngineConfig, SpecConfig
from common.engine import greedy_head as greedy_head_module
from common.engine.greedy_head import (APPROX_ROUNDING, DEFAULT_ROWS, FLUSHED, MAX_ROWS, MIN_HIDDEN, TILE, XQ_MAX,
                                       GreedyHead)
from common.engine.llm_engine import LLMEngine
from common.engine.models.llama import _linear_panels, onednn_beside_panels, onednn_rows, panels_of
from common.engine.native import linear_panels_tiles_kernel, panels_amx_rows
from common.protocol.sampling_params import SamplingParams, StructuredOutput

pytestmark = pytest.mark.skipif(linear_panels_tiles_kernel() is None,
                                reason="the greedy head reads a head in panels: a C compiler and AVX512-BF16")


def head(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) * k ** -0.5).to(torch.bfloat16)


def whole_head_argmax(panels: torch.Tensor, n: int, x: torch.Tensor) -> torch.Tensor:
    return _linear_panels(x, panels, n, None).float().argmax(dim=1)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 30])
def test_chosen_tiles_get_the_whole_calls_values_bit_for_bit(rows):
    n, k = 1088, 320  # 68 panels: two threads split the whole call inside tile 8, which is chosen
    panels = panels_of(head(n, k, seed=rows))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    whole = _linear_panels(x, panels, n, None)
    tiles = torch.tensor([0, 3, 8, 16], dtype=torch.int32)
    out = torch.empty((len(tiles), rows, TILE), dtype=torch.bfloat16)
    assert linear_panels_tiles_kernel()(x.data_ptr(), panels.data_ptr(), tiles.data_ptr(), len(tiles),
                                        out.data_ptr(), rows, n, k) == 0
    for i, t in enumerate(tiles.tolist()):
        assert torch.equal(out[i], whole[:, t * TILE:(t + 1) * TILE])


def test_the_tiles_kernel_refuses_a_tile_outside_the_head():
    n, k = 128, 64
    panels = panels_of(head(n, k, seed=1))
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    out = torch.empty((1, 1, TILE), dtype=torch.bfloat16)
    for tile in (-1, n // TILE):
        tiles = torch.tensor([tile], dtype=torch.int32)
        assert linear_panels_tiles_kernel()(x.data_ptr(), panels.data_ptr(), tiles.data_ptr(), 1, out.data_ptr(), 1,
                                            n, k) == -1


@pytest.mark.parametrize("rows", list(range(1, MAX_ROWS + 1)))
def test_random_rows_get_the_whole_heads_argmax(rows):
    n, k = 8192, 512
    panels = panels_of(head(n, k, seed=rows))
    greedy = GreedyHead(panels, n, k)
    gen = torch.Generator().manual_seed(100 + rows)
    for scale in (1e-3, 1.0, 30.0):
        for _ in range(5):
            x = (torch.randn(rows, k, generator=gen) * scale).to(torch.bfloat16)
            tokens = greedy.argmax(x)
            assert tokens is not None
            assert torch.equal(tokens, whole_head_argmax(panels, n, x))


def test_ties_and_near_ties_go_as_the_whole_heads():
    """Tokens whose weights are equal (an exact tie: the first index wins) or one bfloat16 step apart in a
    coordinate, spread over different tiles, with rows that single them out."""
    n, k = 4096, 256
    w = head(n, k, seed=7)
    gen = torch.Generator().manual_seed(8)
    twins = [(5, 3000), (70, 71), (1000, 4095)]
    for a, b in twins:
        w[b] = w[a]
    nudged = w[200].clone()  # one bfloat16 step up in its first input: a different token, logits a hair apart
    nudged[0] = (nudged[0:1].view(torch.int16) + (1 if nudged[0] > 0 else -1)).view(torch.bfloat16)[0]
    w[2500] = nudged
    assert not torch.equal(w[2500], w[200])
    panels = panels_of(w)
    greedy = GreedyHead(panels, n, k)
    picked = []
    for a in [a for a, _ in twins] + [200]:
        for _ in range(3):
            x = (w[a].float() * 20 + torch.randn(k, generator=gen) * 0.05).to(torch.bfloat16)[None]
            tokens = greedy.argmax(x)
            assert tokens is not None
            assert torch.equal(tokens, whole_head_argmax(panels, n, x))
            picked.append(int(tokens))
    assert {5, 70, 1000} <= set(picked)  # the twins' first index, never the second
    assert not {3000, 71, 4095} & set(picked)
    assert {200, 2500} & set(picked)


def test_the_bound_holds_where_the_int8_copy_is_exact_and_the_row_rounds_worst():
    """Head rows on the int8 grid (the copy's only error is then the row's int16 rounding) and a row with one spike
    and every other input half a step, signed as the token's weights: each token's approximation is within its
    margin of the exact logit, and the rounding term is what covers the target token."""
    n, k = 1024, 512
    gen = torch.Generator().manual_seed(21)
    q = torch.randint(-127, 128, (n, k), generator=gen)
    q[:, 0] = 127  # every row's scale is 2^-10 exactly: the copy recovers each weight exactly
    w = (q.double() * 2.0**-10).to(torch.bfloat16)
    greedy = GreedyHead(panels_of(w), n, k)
    for target in (3, 500, 1023):
        half = torch.sign(w[target].double()) * (0.5 / XQ_MAX)
        half[0] = 1.0  # the spike: the row's range, whose steps are 1 / XQ_MAX
        x = half.to(torch.bfloat16)[None]
        approx, norm, step = greedy.margins(x.float())
        margin = greedy.weight_error * norm + greedy.step_error * step + APPROX_ROUNDING * approx.abs() + FLUSHED
        exact = (x.double() @ w.double().T)[0]
        error = (approx[0].double() - exact).abs()
        assert (error <= margin[0].double()).all()
        without_rounding = (margin[0] - greedy.step_error * step)[target]  # the margin less the int16 rounding's term
        assert error[target] > without_rounding
        tokens = greedy.argmax(x)
        assert tokens is None or torch.equal(tokens, whole_head_argmax(greedy.panels, n, x))


def test_what_it_cannot_settle_goes_to_the_whole_head():
    n, k = 1024, 128
    panels = panels_of(head(n, k, seed=3))
    greedy = GreedyHead(panels, n, k)
    x = torch.randn(MAX_ROWS + 1, k).to(torch.bfloat16)
    assert greedy.argmax(x) is None  # more rows than it takes
    x = x[:1].clone()
    x[0, 5] = float("nan")
    assert greedy.argmax(x) is None
    flat = panels_of(torch.full((n, k), 0.01, dtype=torch.bfloat16))  # every token ties: all are candidates
    assert GreedyHead(flat, n, k).argmax(torch.ones(1, k, dtype=torch.bfloat16)) is None


def test_a_head_not_in_whole_tiles_is_refused():
    with pytest.raises(ValueError, match="whole tiles"):
        GreedyHead(panels_of(head(TILE + 16, 32, seed=1)), TILE + 16, 32)


def generate(model_dir, max_rows: int, params: SamplingParams,
             decode_kernel_rows: int = 8) -> tuple[list[list[int]], LLMEngine]:
    """Three greedy sequences through an engine whose decode steps take ``decode_kernel_rows`` fixed: left to its
    timing at load (the default, -1), two engines under a loaded machine chose differently, and the torch path's
    bfloat16 hidden states differ from the kernel's (a greedy token of the embedded model flipped between them)."""
    # 4 KB pages (engine.cpu.huge_pages): the same bytes, loaded in a fraction of the CPU where 2 MB pages fault in
    # slowly (common/cli/local_cluster.py TEST_WORKER_OVERRIDES)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
                                    cpu=CpuConfig(greedy_head_max_rows=max_rows, huge_pages=False,
                                                  decode_kernel_max_batch=decode_kernel_rows)))
    gen = torch.Generator().manual_seed(11)
    for i in range(3):
        engine.add_request(f"r{i}", torch.randint(100, 40000, (20 + 9 * i,), generator=gen).tolist(), params)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return [outputs[f"r{i}"] for i in range(3)], engine


@pytest.mark.parametrize("decode_kernel_rows", [8, 0], ids=["decode-kernel", "torch-path"])
def test_an_engine_generates_the_same_tokens_with_and_without_it(embedded_model_dir_bf16, monkeypatch,
                                                                  decode_kernel_rows):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    calls = []
    argmax = GreedyHead.argmax

    def recorded(self, hidden):
        tokens = argmax(self, hidden)
        calls.append((len(hidden), tokens is not None))
        return tokens
    monkeypatch.setattr(GreedyHead, "argmax", recorded)
    with_it, engine = generate(embedded_model_dir_bf16, MAX_ROWS, params, decode_kernel_rows)  # set: default 0 here
    assert engine.runner.greedy_head is not None
    assert max(rows for rows, _ in calls) == 3 and sum(decided for _, decided in calls) > len(calls) // 2
    without, engine = generate(embedded_model_dir_bf16, 0, params, decode_kernel_rows)
    assert engine.runner.greedy_head is None
    assert with_it == without


def test_rows_that_read_their_logits_do_not_take_it(embedded_model_dir_bf16, monkeypatch):
    calls = []
    monkeypatch.setattr(GreedyHead, "argmax", lambda self, hidden: calls.append(len(hidden)))
    for params in (SamplingParams(temperature=0.0, max_tokens=3, logprobs=2),
                   SamplingParams(temperature=0.0, max_tokens=3, presence_penalty=0.5),
                   SamplingParams(temperature=0.7, max_tokens=3, seed=1)):
        generate(embedded_model_dir_bf16, MAX_ROWS, params)
    assert calls == []


def test_masked_rows_and_drafts_do_not_take_it(embedded_model_dir_bf16, monkeypatch):
    """Structured output masks the logits; a sequence verifying n-gram drafts reads a row per draft."""
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar (the Makefile installs it)")
    calls = []
    argmax = GreedyHead.argmax
    monkeypatch.setattr(GreedyHead, "argmax", lambda self, hidden: calls.append(len(hidden)) or argmax(self, hidden))
    engine = LLMEngine(EngineConfig(model=str(embedded_model_dir_bf16), dtype="bfloat16",
                                    kv_cache_memory_bytes=64 << 20, cpu=CpuConfig(greedy_head_max_rows=MAX_ROWS, huge_pages=False),
                                    spec=SpecConfig(method="ngram", num_tokens=4)))
    masked = SamplingParams(temperature=0.0, max_tokens=8, structured=StructuredOutput(kind="regex", spec="(yes|no)"))
    engine.generate([[5, 6, 7, 8]], [masked])
    assert calls == []
    repeating = [40, 41, 42, 43] * 6  # n-gram drafts from the prompt from the first decode step on
    before = engine.runner.launch
    drafted = []

    def launch(plan, *args, **kwargs):
        drafted.append(any(plan.spec_token_ids))
        return before(plan, *args, **kwargs)
    engine.runner.launch = launch
    engine.generate([repeating], [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)])
    assert any(drafted) and len(calls) == drafted.count(False)  # the prompt's step took it, those with drafts not


def test_by_default_it_takes_the_hidden_sizes_it_was_measured_ahead_at(embedded_model_dir_bf16):
    """-1 (the default): up to DEFAULT_ROWS rows from MIN_HIDDEN inputs, and no copy at all below (the embedded
    model's 576)."""
    assert GreedyHead.default_rows(MIN_HIDDEN) == DEFAULT_ROWS and GreedyHead.default_rows(MIN_HIDDEN - 1) == 0
    _, engine = generate(embedded_model_dir_bf16, -1, SamplingParams(temperature=0.0, max_tokens=2))
    assert engine.runner.model.config.hidden_size < MIN_HIDDEN and engine.runner.greedy_head is None
    _, engine = generate(embedded_model_dir_bf16, 2, SamplingParams(temperature=0.0, max_tokens=2))
    assert engine.runner.greedy_head.max_rows == 2


def test_timing_stops_at_the_first_row_count_it_is_behind(monkeypatch):
    """The timing's clock is the test's: only the stand-in whole head moves it, so the greedy head's own calls take
    no time and which way is ahead does not hang on how the cores are shared while the suite runs."""
    clock = [0.0]
    monkeypatch.setattr(greedy_head_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    n, k = 1024, 128
    greedy = GreedyHead(panels_of(head(n, k, seed=5)), n, k)
    assert greedy.timed_max_rows(lambda rows: None, repeat=1) == 0  # a whole head that costs nothing
    assert greedy.max_rows == 0 and greedy.argmax(torch.ones(1, k, dtype=torch.bfloat16)) is None

    def slow(rows):
        clock[0] += 0.05 if len(rows) < 3 else 0.0
    assert greedy.timed_max_rows(slow, repeat=1) == 2


def test_on_amx_it_takes_fewer_rows_than_the_whole_head_takes_tiles_or_onednn_from(embedded_model_dir_bf16):
    """The copy's exact logits come from the panels' vdpbf16ps; where a whole head's call of more rows takes AMX
    tiles or oneDNN's copy, it rounds otherwise, so the greedy copy stops below those rows."""
    _, engine = generate(embedded_model_dir_bf16, MAX_ROWS, SamplingParams(temperature=0.0, max_tokens=2))
    limit = min(onednn_rows(), panels_amx_rows() or MAX_ROWS + 1) - 1 if onednn_beside_panels() else MAX_ROWS
    assert engine.runner.greedy_head.max_rows == min(MAX_ROWS, limit)
