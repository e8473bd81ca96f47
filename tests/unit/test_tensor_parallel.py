"""Tensor parallelism inside a worker: the sharded layers, the step sent to the ranks, TP 2 against TP 1, devices."""
from __future__ import annotations

import dataclasses
import json
import multiprocessing

import numpy as np
import pytest
import torch

from common.config.base import ConfigError, CpuConfig, EngineConfig, Int8Config
from common.engine.attention import EncodeContext, select_backend
from common.engine.embedder import Embedder, Pooling
from common.engine.kv_cache import KVCache, KVLayout
from common.engine.llm_engine import LLMEngine
from common.engine.model_runner import ModelRunner
from common.engine.models.llama import check_divisible
from common.engine.models.loader import load_hf_config, load_model
from common.engine.scheduler import StepPlan
from common.engine.quantization import quantize_activations, quantize_rows
from common.engine.sequence import Sequence
from common.engine.tensor_parallel import Parallel, join_group, pack_step, unpack_step
from common.protocol.sampling_params import SamplingParams, StructuredOutput
from tests.tiny_models import build_tiny_model
from tests.unit.test_structured_output import ENUM_SCHEMA


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory, embedded_model_dir):
    """A random model whose heads (4, 2 KV) and MLP split two ways; qwen2 has q/k/v biases."""
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), tokenizer_from=embedded_model_dir)


def test_each_rank_loads_its_slice_and_the_slices_make_the_whole(tiny):
    backend = select_backend("auto", "cpu", 16)
    whole = load_model(tiny, torch.float32, "cpu", backend)
    ranks = [load_model(tiny, torch.float32, "cpu", backend, Parallel(r, 2)) for r in range(2)]
    attn = whole.layers[0].self_attn
    q, kv = attn.q_size, attn.kv_size
    for i, layer in enumerate(whole.layers):
        parts = [r.layers[i] for r in ranks]
        qkv = [p.self_attn.qkv_proj.weight for p in parts]
        half_q, half_kv = q // 2, kv // 2
        for name, start, width, half in (("q", 0, q, half_q), ("k", q, kv, half_kv), ("v", q + kv, kv, half_kv)):
            local_start = {"q": 0, "k": half_q, "v": half_q + half_kv}[name]
            got = torch.cat([w[local_start:local_start + half] for w in qkv])
            assert torch.equal(got, layer.self_attn.qkv_proj.weight[start:start + width]), name
        assert torch.equal(torch.cat([p.self_attn.o_proj.weight for p in parts], 1), layer.self_attn.o_proj.weight)
        assert torch.equal(torch.cat([p.mlp.down_proj.weight for p in parts], 1), layer.mlp.down_proj.weight)
        inter = layer.mlp.intermediate
        gate = torch.cat([p.mlp.gate_up_proj.weight[:inter // 2] for p in parts])
        up = torch.cat([p.mlp.gate_up_proj.weight[inter // 2:] for p in parts])
        assert torch.equal(torch.cat([gate, up]), layer.mlp.gate_up_proj.weight)
        assert torch.equal(parts[1].input_layernorm.weight, layer.input_layernorm.weight)  # norms whole
        if layer.self_attn.qkv_proj.bias is not None:
            assert parts[0].self_attn.qkv_proj.bias.shape[0] == (q + 2 * kv) // 2
    vocab = whole.config.vocab_size
    assert torch.equal(torch.cat([r.embed_tokens.weight for r in ranks])[:vocab], whole.embed_tokens.weight)


def test_an_odd_vocabulary_pads_the_last_rank_with_zero_rows(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.tiny_models import COMMON

    hf = AutoModelForCausalLM.from_config(LlamaConfig(**{**COMMON, "vocab_size": 321}, tie_word_embeddings=False))
    hf.save_pretrained(tmp_path)
    backend = select_backend("auto", "cpu", 16)
    first, last = (load_model(tmp_path, torch.float32, "cpu", backend, Parallel(r, 2)) for r in range(2))
    assert last.embed_tokens.weight.shape[0] == last.lm_head.weight.shape[0] == 161
    assert last.embed_tokens.weight[160:].abs().sum() == 0 and last.lm_head.weight[160:].abs().sum() == 0
    whole = hf.model.embed_tokens.weight
    assert torch.equal(torch.cat([first.embed_tokens.weight, last.embed_tokens.weight[:160]]), whole)


def test_a_split_the_model_does_not_divide_names_the_setting_and_the_splits(tiny):
    with pytest.raises(ValueError, match=r"engine.tensor_parallel_size 3 does not divide.*splits into \[1, 2\]"):
        check_divisible(load_hf_config(tiny), 3)


def test_a_packed_step_unpacks_to_the_same_inputs_over_the_ranks_own_pool(tiny):
    engine = LLMEngine(EngineConfig(model=str(tiny), num_kv_blocks=32))
    seqs = [Sequence(f"s{i}", list(range(5 + 7 * i, 40 + 7 * i)), SamplingParams(), seed=0) for i in range(2)]
    seqs[0].block_table, seqs[1].block_table = [3, 4, 5], [7, 1, 2]
    seqs[1].num_computed_tokens = 34  # a decode row beside a prompt chunk
    prepared = engine.runner.prepare(StepPlan(seqs, [35, 1]))
    other = KVCache(engine.runner.layout, engine.runner.num_blocks)
    ctx, ids, positions, rows = unpack_step(
        pack_step(prepared.context, prepared.input_ids, prepared.positions, prepared.sample_rows), other,
        torch.device("cpu"))
    assert ctx.kv_cache is other
    assert torch.equal(ids, prepared.input_ids) and torch.equal(positions, prepared.positions)
    assert torch.equal(rows, prepared.sample_rows)
    for name in ("slot_blocks", "slot_offsets", "decode_rows", "decode_block_tables", "decode_context_lens"):
        assert torch.equal(getattr(ctx, name), getattr(prepared.context, name)), name
    assert [(c.token_start, c.token_end, c.num_computed, c.block_table.tolist()) for c in ctx.chunks] == [
        (c.token_start, c.token_end, c.num_computed, c.block_table.tolist()) for c in prepared.context.chunks]
    encode = EncodeContext(torch.arange(4), torch.ones(1, 1, 4, 4, dtype=torch.bool), 1, 4)
    ctx, _, _, rows = unpack_step(pack_step(encode, ids[:4], positions[:4], None), other, torch.device("cpu"))
    assert isinstance(ctx, EncodeContext) and torch.equal(ctx.mask, encode.mask) and rows is None


def _prompt_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    seq = Sequence("prompt", ids, SamplingParams(), seed=0)
    seq.block_table = list(range(-(-len(ids) // runner.config.block_size)))
    prepared = runner.prepare(StepPlan([seq], [len(ids)]))
    return runner.run(prepared.context, prepared.input_ids, prepared.positions, torch.arange(len(ids))).float()


def _embeddings(runner: ModelRunner, inputs: list[list[int]]) -> np.ndarray:
    return Embedder(runner.embedding_model, runner.device, Pooling(), 64, 0.5).embed(inputs)


def test_tp2_agrees_with_tp1_on_logits_and_greedy_tokens(tiny):
    """Two rank processes over gloo against one process: a 64-token prompt's logits within 1e-4 relative, the
    same greedy continuation, and the same embeddings (inputs of three lengths, in two padded batches)."""
    config = EngineConfig(model=str(tiny), num_kv_blocks=64, num_threads=1)
    ids = [(i * 37 + 11) % 49152 for i in range(64)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    one = LLMEngine(config)
    want_logits = _prompt_logits(one.runner, ids)
    want = [o.outputs[0].token_ids for o in one.generate([ids, ids[:17]], greedy)]
    inputs = [ids[:9], ids[:40], ids[5:20]]
    want_embeddings = _embeddings(one.runner, inputs)
    two = LLMEngine(dataclasses.replace(config, tensor_parallel_size=2))
    try:
        assert two.runner.kv_cache.pool.shape[0] == 2 and two.runner.model.layers[0].self_attn.num_kv_heads == 1
        got_logits = _prompt_logits(two.runner, ids)
        got = [o.outputs[0].token_ids for o in two.generate([ids, ids[:17]], greedy)]
        got_embeddings = _embeddings(two.runner, inputs)
    finally:
        two.runner.close()
    assert (got_logits - want_logits).abs().max() <= 1e-4 * want_logits.abs().max()
    assert got == want
    assert np.abs(got_embeddings - want_embeddings).max() <= 1e-5


def test_rank_devices_are_checked_and_named():
    assert EngineConfig(model="m", tensor_parallel_size=3).devices == ["cpu"] * 3
    assert EngineConfig(model="m", tensor_parallel_size=2, device="cuda:4").devices == ["cuda:4", "cuda:5"]
    assert EngineConfig(model="m", tensor_parallel_size=2, ranks={"devices": ["cuda:1", "cuda:3"]}).devices == [
        "cuda:1", "cuda:3"]
    for bad, words in (({"device": "gpu0"}, "'device'"),
                       ({"tensor_parallel_size": 2, "ranks": {"devices": ["cuda:0"]}}, "ranks.devices"),
                       ({"tensor_parallel_size": 2, "ranks": {"devices": ["cuda:1", "cuda:1"]}}, "one GPU"),
                       ({"tensor_parallel_size": 2, "ranks": {"devices": ["cpu", "cuda:1"]}}, "mixes"),
                       ({"tensor_parallel_size": 0}, "tensor_parallel_size")):
        with pytest.raises(ConfigError, match=words):
            EngineConfig(model="m", **bad)


def test_a_rank_that_cannot_start_fails_the_worker_with_its_error(tmp_path):
    """A model whose heads do not split: each rank refuses it, and rank 0 says why."""
    tiny = build_tiny_model("llama", tmp_path / "m")
    with pytest.raises(ValueError, match="does not divide"):
        ModelRunner(EngineConfig(model=str(tiny), num_kv_blocks=8, tensor_parallel_size=3), tiny)


def _rank(rank: int, rendezvous: str, link) -> None:
    """A rank of a group of 2 whose steps' collectives wait 1 s: rank 0 all-reduces, rank 1 never does (a silent
    rank)."""
    config = EngineConfig(model="m", tensor_parallel_size=2, ranks={"timeout_s": 30.0, "step_timeout_s": 1.0})
    try:
        join_group(config, rank, rendezvous)
        tp = Parallel(rank, 2, config.ranks.timeout_s)
        tp.serve_steps(config.ranks.step_timeout_s)  # as each rank does once loaded
        if rank == 0:
            tp.all_reduce(torch.ones(4))
            link.send("no error")
        else:
            link.recv()  # until the test is done
    except Exception as exc:
        link.send(str(exc))


def test_a_collective_a_rank_never_joins_fails_naming_the_setting(tmp_path):
    """Rank 0's all-reduce with a rank that stays silent fails once engine.ranks.step_timeout_s passes (not the
    start's longer engine.ranks.timeout_s), and says so."""
    context = multiprocessing.get_context("fork")
    rendezvous = str(tmp_path / "rendezvous")
    links = [context.Pipe() for _ in range(2)]
    ranks = [context.Process(target=_rank, args=(r, rendezvous, links[r][1]), daemon=True) for r in range(2)]
    for proc in ranks:
        proc.start()
    try:
        assert links[0][0].poll(60), "rank 0 never answered"
        error = links[0][0].recv()
        assert "all-reduce" in error and "engine.ranks.step_timeout_s = 1.0s" in error, error
    finally:
        links[1][0].send("done")
        for proc in ranks:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def test_the_schedulers_features_at_tp2_answer_as_at_tp1(tiny):
    """One engine at TP 2 with a pool small enough to preempt, prefix caching and the host tier (a prompt sent
    again comes back from it), n-gram speculation, and structured output (a JSON schema masks the logits rank 0
    gathered): the same greedy tokens as the same engine at TP 1, and every page free after."""
    config = EngineConfig(model=str(tiny), num_kv_blocks=20, num_threads=1, max_num_seqs=4,
                          kv_tiers={"host_memory_bytes": 8 << 20}, spec={"method": "ngram", "num_tokens": 3})
    base = [(i * 53 + 7) % 49152 for i in range(60)]
    # each ends inside a repeated run, so the n-gram lookup proposes drafts from the first decode step
    prompts = [base + [(i * 11 + j % 4) % 49152 for j in range(40)] for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    json_greedy = SamplingParams(temperature=0.0, max_tokens=48, structured=StructuredOutput(
        kind="json_schema", spec=json.dumps(ENUM_SCHEMA)))
    results = {}
    for tp in (1, 2):
        engine = LLMEngine(dataclasses.replace(config, tensor_parallel_size=tp))
        try:
            first = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]
            flood = [[(i * 97 + j) % 49152 for j in range(150)] for i in range(3)]  # evicts the cached prefix
            engine.generate(flood, SamplingParams(temperature=0.0, max_tokens=1))
            again = [o.outputs[0].token_ids for o in engine.generate(prompts[:1], greedy)]
            shaped = [o.outputs[0] for o in engine.generate(prompts[1:3], json_greedy)]
            assert all(o.finish_reason == "stop" and json.loads(o.text)["color"] in ("red", "green", "blue")
                       for o in shaped), [o.text for o in shaped]
            assert engine.block_manager.num_used_blocks == 0 and not engine.structured.live
            stats, host = engine.stats, engine.block_manager.host
            results[tp] = (first, again, [o.token_ids for o in shaped], stats.num_preemptions > 0,
                           stats.num_spec_drafts > 0, host.copies_in > 0)
        finally:
            engine.runner.close()
    assert results[2][3:] == (True, True, True), "the pool preempted, speculation ran, the host tier reloaded"
    assert results[2] == results[1]


class _Halves:
    """The all-reduce of two ranks, each holding half of every row, done by hand: what ``Parallel`` gives each."""

    def __init__(self, rank: int, mine: list, other: list) -> None:
        self.rank, self.mine, self.other = rank, iter(mine), iter(other)

    def all_reduce_max(self, x):
        assert torch.equal(x, next(self.mine))
        return torch.maximum(x, next(self.other))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_split_in_two_quantizes_as_the_whole_row_with_the_max_over_the_halves(dtype):
    """W8A8 at TP 2 on a row-parallel layer's input and weight rows: each half of every row, quantized with the
    max of both halves' ranges, is the whole row's int8 values and scale."""
    x = (torch.randn(37, 96, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.1, 8, 96)).to(dtype)
    x[5] = 0  # a row of zeros keeps the minimum scale
    weight = torch.randn(8, 96, generator=torch.Generator().manual_seed(4))
    for whole, quantize in ((x, quantize_activations), (weight, quantize_rows)):
        want_q, want_scale = quantize(whole)
        halves = [whole[:, :48].contiguous(), whole[:, 48:].contiguous()]
        ranges = [h.abs().amax(dim=1).float() for h in halves]
        parts = [quantize(h, _Halves(i, [ranges[i]], [ranges[1 - i]])) for i, h in enumerate(halves)]
        assert torch.equal(torch.cat([q for q, _ in parts], dim=1), want_q)
        assert all(torch.equal(scale, want_scale) for _, scale in parts)


def test_int8_at_tp2_gives_tp1s_logits_bit_for_bit(tiny):
    """int8 weights at TP 2 against TP 1, both through the layer-by-layer path (TP 1's one-call decode kernel off),
    with SmoothQuant (the default) and without: the calibration measures the same ranges at either size, the
    row-parallel layers quantize with whole rows' scales and sum exact int32 products over the ranks, so the
    prompt's logits and the greedy tokens are TP 1's exactly (each rank's own scales and float sums gave logits
    1.2e-2 apart here, and the third prompt's first token differed)."""
    config = EngineConfig(model=str(tiny), num_kv_blocks=64, num_threads=1, quantization="int8",
                          cpu=CpuConfig(decode_kernel_max_batch=0))
    ids = [(i * 37 + 11) % 49152 for i in range(64)]
    prompts = [ids, ids[:17], [(i * 53 + 7) % 49152 for i in range(40)]]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = {}
    for smoothing, tp in ((config.int8.smoothing, 1), (config.int8.smoothing, 2), (0.0, 1), (0.0, 2)):
        engine = LLMEngine(dataclasses.replace(config, tensor_parallel_size=tp,
                                               int8=Int8Config(smoothing=smoothing)))
        try:
            results[smoothing, tp] = (_prompt_logits(engine.runner, ids),
                                      [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)])
        finally:
            engine.runner.close()
    for smoothing in (config.int8.smoothing, 0.0):
        (want_logits, want), (got_logits, got) = results[smoothing, 1], results[smoothing, 2]
        assert torch.equal(got_logits, want_logits) and got == want, smoothing


def test_row_parallel_biases_are_added_once_in_float_and_int8(tmp_path):
    """A Llama with attention and MLP biases: every rank holds the output and down projections' biases whole;
    the float path adds them on rank 0 before the all-reduce, int8's on every rank after its int32 all-reduce."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.tiny_models import COMMON

    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    ids = [(i * 37 + 11) % 320 for i in range(40)]
    logits = {}
    for quantization in ("none", "int8"):
        config = EngineConfig(model=str(tmp_path), num_kv_blocks=16, num_threads=1, quantization=quantization,
                              int8=Int8Config(smoothing=0.0), cpu=CpuConfig(decode_kernel_max_batch=0))
        for tp in (1, 2):
            runner = ModelRunner(dataclasses.replace(config, tensor_parallel_size=tp), tmp_path)
            try:
                logits[quantization, tp] = _prompt_logits(runner, ids)
            finally:
                runner.close()
    want = logits["none", 1]
    assert (logits["none", 2] - want).abs().max() <= 1e-4 * want.abs().max()
    assert torch.equal(logits["int8", 2], logits["int8", 1])
    assert (logits["int8", 1] - want).abs().max() <= 0.1 * want.abs().max()  # int8, not garbage


def test_an_int8_kv_pool_at_tp2_gives_tp1s_tokens(tiny):
    """An int8 KV pool split by KV heads over two ranks (each rank's rows in its slice of the shared pool) against
    one process: each (token, KV head) row is quantized alike wherever its head lives, so the prompt's logits agree
    within float32 summation order and the greedy tokens are the same."""
    config = EngineConfig(model=str(tiny), num_kv_blocks=64, num_threads=1,
                          cpu=CpuConfig(kv_cache_dtype="int8", decode_kernel_max_batch=0))
    ids = [(i * 37 + 11) % 49152 for i in range(64)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = {}
    for tp in (1, 2):
        engine = LLMEngine(dataclasses.replace(config, tensor_parallel_size=tp))
        try:
            assert engine.runner.kv_cache.pool.dtype is torch.int8 and engine.runner.kv_cache.pool.shape[0] == tp
            results[tp] = (_prompt_logits(engine.runner, ids),
                           [o.outputs[0].token_ids for o in engine.generate([ids, ids[:17]], greedy)])
        finally:
            engine.runner.close()
    (want_logits, want), (got_logits, got) = results[1], results[2]
    assert (got_logits - want_logits).abs().max() <= 1e-4 * want_logits.abs().max()
    assert got == want
