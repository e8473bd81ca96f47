"""engine.deterministic: a token's logits depend only on the model, the dtype and its sequence.

The property, checked bitwise on the chosen token's logprob and the top five alternatives at every generated
position (all of them functions of the whole logits row): one sequence alone, among 2 to 64 others, with its
prompt chunked by a small step budget, from the prefix cache, recomputed after a resume or a preemption, at
one or two threads. In bfloat16, int8 and float32, on tiny random models (llama; qwen3 with its q/k norms) and
on the embedded model. The same checks without the mode find differences, which is what makes them checks.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from common.config.base import ConfigError, EngineConfig
from common.engine import deterministic
from common.engine.attention import select_backend
from common.engine.llm_engine import LLMEngine
from common.engine.models.llama import LlamaForCausalLM, decode_forward_takes_panels
from common.engine.native import cpu_has, gemm_invariant_kernel
from common.protocol.sampling_params import SamplingParams
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(gemm_invariant_kernel() is None, reason="no C compiler for the engine's kernels")

NUMERICS = [("bfloat16", "none"), ("bfloat16", "int8"), ("float32", "none")]
WATCHED = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=5)


def gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kernel=None) -> torch.Tensor:
    y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype)
    kernel = kernel or gemm_invariant_kernel()
    assert kernel(x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
                  x.shape[0], w.shape[0], x.shape[1], int(x.dtype is torch.bfloat16)) == 0
    return y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(96, 576), (130, 77), (7, 33), (260, 1024)])
def test_a_row_of_the_invariant_matmul_is_the_same_in_every_batch_and_at_every_thread_count(dtype, n, k):
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(67, k, generator=gen).to(dtype)
    alone = torch.cat([gemm(x[r:r + 1].contiguous(), w, b) for r in range(67)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for start, rows in ((0, 67), (3, 1), (5, 3), (8, 4), (9, 13), (20, 47)):
                assert torch.equal(gemm(x[start:start + rows].contiguous(), w, b), alone[start:start + rows])
    finally:
        torch.set_num_threads(threads)
    exact = F.linear(x.double(), w.double(), b.double())  # and it is a matmul: float32 sums of exact products
    tolerance = 1e-2 * exact.abs().max() if dtype is torch.bfloat16 else 1e-5 * exact.abs().max()
    assert (alone.double() - exact).abs().max() <= tolerance


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_vector_paths_give_the_portable_loops_bits(dtype):
    """AVX2 and AVX-512 (float32, and bfloat16 without AVX512-BF16 dot products) do the portable loop's
    operations, so hosts of either instruction set agree: every tile shape, edge and tail, at 1 and 2 threads."""
    if dtype is torch.bfloat16 and cpu_has("avx512_bf16"):
        pytest.skip("bfloat16 with AVX512-BF16 sums pairs of products in one instruction: other bits by design")
    portable = gemm_invariant_kernel(("TESSERA_PORTABLE",))
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m, n, k in ((1, 7, 16), (2, 65, 33), (3, 130, 77), (5, 64, 15), (67, 131, 576), (8, 260, 1000)):
                gen = torch.Generator().manual_seed(m * n * k)
                w, x = torch.randn(n, k, generator=gen).to(dtype), torch.randn(m, k, generator=gen).to(dtype)
                b = torch.randn(n, generator=gen).to(dtype)
                assert torch.equal(gemm(x, w, b), gemm(x, w, b, portable)), (m, n, k)
                assert torch.equal(gemm(x, w, None), gemm(x, w, None, portable)), (m, n, k)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, embedded_model_dir):
    """Tiny random models by kind, built once: ``tiny_models(kind)``."""
    built = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = build_tiny_model(kind, tmp_path_factory.mktemp(kind), tokenizer_from=embedded_model_dir)
        return built[kind]
    return get


class Probe:
    """One watched request run in different company; ``seen`` is what its logprobs were at each position."""

    def __init__(self, model, dtype: str, quantization: str, deterministic: bool = True, **settings) -> None:
        # 4 KB pages (engine.cpu.huge_pages): the same bytes, loaded in a fraction of the CPU where 2 MB pages fault
        # in slowly (common/cli/local_cluster.py TEST_WORKER_OVERRIDES)
        settings["cpu"] = {"huge_pages": False, **settings.get("cpu", {})}
        self.settings = dict(model=str(model), dtype=dtype, quantization=quantization, deterministic=deterministic,
                             **settings)
        self.rng = random.Random(7)
        self.prompt = self.tokens(70)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, 49152) for _ in range(n)]

    def engine(self, **settings) -> LLMEngine:
        return LLMEngine(EngineConfig(**{**self.settings, "num_kv_blocks": 256, **settings}))

    def run(self, engine: LLMEngine, others=(), resumed=(), started_first: bool = False, other_tokens=(1, 30)):
        """The watched request's positions as (token, logprob, top 5), from ``len(resumed)`` on; ``others``
        (prompts) run beside it, and with ``started_first`` they are decoding before it arrives."""
        for i, prompt in enumerate(others):
            engine.add_request(f"other-{i}", prompt, SamplingParams(
                temperature=0.0, max_tokens=self.rng.randrange(*other_tokens), ignore_eos=True))
        while started_first and any(not s.output_token_ids for seqs in engine.requests.values() for s in seqs):
            engine.step()
        engine.add_request("watched", self.prompt, WATCHED, output_token_ids=resumed)
        final = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == "watched" and out.finished:
                    final = out.outputs[0]
        return [(t, lp, tuple(top)) for t, lp, top in
                zip(final.token_ids, final.logprobs, final.top_logprobs)][len(resumed):]

    def scenarios(self):
        """Every (name, positions) the property compares with the watched request alone."""
        alone = self.run(self.engine())
        yield "alone", alone
        for n in (2, 8, 64):
            yield f"among {n}", self.run(self.engine(), [self.tokens(self.rng.randrange(1, 90)) for _ in range(n)])
        # a budget of 16 tokens a step with 15 (9) others decoding: the prompt goes 1 (7) tokens a step
        for chunk in (1, 7):
            others = [self.tokens(self.rng.randrange(1, 12)) for _ in range(16 - chunk)]
            yield f"chunks of {chunk}", self.run(self.engine(max_num_batched_tokens=16), others,
                                                 started_first=True, other_tokens=(90, 100))
        yield "chunks of 64", self.run(self.engine(max_num_batched_tokens=64))
        cached = self.engine()
        self.run(cached)
        yield "prefix cache hit", self.run(cached)
        for j in (1, 9):
            yield f"resumed after {j} tokens", [None] * j + self.run(self.engine(), resumed=[t for t, *_ in alone[:j]])
        others = [self.tokens(self.rng.randrange(40, 90)) for _ in range(6)]
        yield "preempted", self.run(self.engine(num_kv_blocks=24, max_num_seqs=8), others)
        yield "one thread", self.run(self.engine(num_threads=1))

    def differences(self) -> list[str]:
        reference, differ = None, []
        for name, seen in self.scenarios():
            if reference is None:
                reference = seen
                continue
            if any(a is not None and a != b for a, b in zip(seen, reference)) or len(seen) != len(reference):
                differ.append(name)
        return differ


# every numerics on llama; qwen3 (its q/k norms) in bfloat16
@pytest.mark.parametrize("kind,dtype,quantization", [("llama", *n) for n in NUMERICS] + [("qwen3", *NUMERICS[0])])
def test_a_sequences_logits_do_not_depend_on_its_batch_its_chunks_the_cache_or_recomputation(tiny_models, kind,
                                                                                               dtype, quantization):
    probe = Probe(tiny_models(kind), dtype, quantization)
    fused = probe.engine().runner.model.fused_decode
    # the paths the mode takes by default: bfloat16 weights in panels (on a CPU with AVX512-BF16), every row of
    # every step through the one-call kernel; int8 and float32 weights layer by layer
    in_panels = dtype == "bfloat16" and quantization == "none" and decode_forward_takes_panels()
    assert (fused is not None and fused.every_row) == in_panels
    assert probe.differences() == []


@pytest.mark.parametrize("dtype,quantization", NUMERICS[1:])
def test_the_kernel_taking_every_row_holds_int8_and_float32_too(tiny_models, dtype, quantization):
    """decode_kernel_max_batch set: the one-call kernel takes every row of int8 and float32 steps as well."""
    probe = Probe(tiny_models("llama"), dtype, quantization, cpu={"decode_kernel_max_batch": 8})
    assert probe.engine().runner.model.fused_decode.every_row
    assert probe.differences() == []


@pytest.mark.parametrize("kind,path", [("llama", "layer by layer"), ("llama", "invariant matmul"),
                                       ("qwen3", "weights in rows")])
def test_the_mode_holds_on_its_other_bfloat16_paths(tiny_models, kind, path, monkeypatch):
    """Without the one-call kernel (decode_kernel_max_batch 0: every row layer by layer, the linear layers in
    panels, the attention through ``DeterministicCpuAttention``); where panels do not fit a layer (layer by layer,
    the linear layers through kernels/gemm_invariant.c); and there with the kernel asked for (a count): its sums
    of 1-4 rows of weights in rows then reduce by the tree its blocks of 5 and more rows use."""
    settings = {"cpu": {"decode_kernel_max_batch": {"layer by layer": 0, "invariant matmul": -1}.get(path, 32)}}
    if path != "layer by layer":
        monkeypatch.setattr(LlamaForCausalLM, "panels_fit", lambda model: False)
    probe = Probe(tiny_models(kind), "bfloat16", "none", **settings)
    model = probe.engine().runner.model
    assert (model.fused_decode is None) == (path != "weights in rows")
    assert (model.layers[0].mlp.down_proj.panels is None) == (path != "layer by layer" or
                                                              not decode_forward_takes_panels())
    assert probe.differences() == []


def test_without_the_mode_bfloat16_logits_do_depend_on_the_batch(tiny_models):
    """The control: the same probe finds differences on the default paths, so it can see one."""
    assert Probe(tiny_models("llama"), "bfloat16", "none", deterministic=False).differences() != []


def test_the_embedded_model_in_bfloat16_answers_alike_alone_batched_and_resumed(embedded_model_dir):
    probe = Probe(embedded_model_dir, "bfloat16", "none")
    probe.prompt = probe.engine().tokenizer.encode("Write a short story about a lighthouse keeper and a storm.")
    alone = probe.run(probe.engine())
    engine = probe.engine()
    among = probe.run(engine, [probe.tokens(probe.rng.randrange(5, 60)) for _ in range(12)])
    resumed = probe.run(probe.engine(), resumed=[t for t, *_ in alone[:7]])
    assert among == alone
    assert resumed == alone[7:]


def test_speculative_decoding_and_seeded_sampling_give_what_plain_decoding_gives(tiny_models):
    """n-gram drafts verified in a batch give the tokens plain decoding gives; a seeded sample is the same
    alone and among others."""
    probe = Probe(tiny_models("llama"), "bfloat16", "none")
    base = probe.tokens(12)
    probe.prompt = base * 5  # repeated: the n-gram lookup proposes drafts from the first step
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = probe.engine().generate([probe.prompt], greedy)[0].outputs[0].token_ids
    speculative = probe.engine(spec={"method": "ngram", "num_tokens": 3})
    assert speculative.generate([probe.prompt], greedy)[0].outputs[0].token_ids == plain
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=11, ignore_eos=True)
    alone = probe.engine().generate([probe.prompt], seeded)[0].outputs[0].token_ids
    crowd = [probe.prompt] + [probe.tokens(probe.rng.randrange(5, 50)) for _ in range(9)]
    batched = probe.engine().generate(crowd, [seeded] + [greedy] * 9)[0].outputs[0].token_ids
    assert batched == alone


def test_the_mode_runs_on_the_cpu_only():
    with pytest.raises(ConfigError, match="deterministic"):
        EngineConfig(model="embedded", deterministic=True, device="cuda")
    with pytest.raises(RuntimeError, match="engine.deterministic"):
        select_backend("torch", "cpu", 16, deterministic=True)


# ---- engine.deterministic: auto ---------------------------------------------------------------------------------

PANELS_HERE = cpu_has("avx512_bf16") and not cpu_has("amx_bf16") and decode_forward_takes_panels()


@pytest.mark.parametrize("settings, why", [
    (dict(dtype="float32"), "float32 weights"),
    (dict(dtype="bfloat16", quantization="int8"), "int8"),
    (dict(dtype="bfloat16", device="cuda"), "a GPU"),
    (dict(dtype="bfloat16", tensor_parallel_size=2), "tensor parallelism"),
    (dict(dtype="bfloat16", cpu={"decode_kernel_max_batch": 8}), "engine.cpu.decode_kernel_max_batch 8"),
    (dict(dtype="bfloat16", attention_backend="torch"), "attention_backend torch"),
])
def test_auto_is_off_where_the_mode_would_cost_more_and_says_why(tiny_models, caplog, settings, why):
    config = EngineConfig(model=str(tiny_models("llama")), **settings)
    with caplog.at_level("INFO", logger="common.engine.deterministic"):
        settled = deterministic.settle(config, config.model)
    assert settled.deterministic is False
    assert f"engine.deterministic auto: off ({why}" in caplog.text


@pytest.mark.parametrize("value", [True, False])
def test_true_and_false_are_kept_as_they_are(tiny_models, value):
    config = EngineConfig(model=str(tiny_models("llama")), dtype="float32", deterministic=value)
    assert deterministic.settle(config, config.model) is config


@pytest.mark.skipif(not PANELS_HERE, reason="auto is on only with AVX512-BF16 (panels), no AMX and a C compiler")
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_auto_is_on_for_bfloat16_weights_in_panels_and_the_engine_runs_the_mode(tiny_models, kind):
    """The engine settles auto before its runner loads the model: the runner, the engine and the attention all see
    the mode on, and the property holds in every scenario of the probe."""
    probe = Probe(tiny_models(kind), "bfloat16", "none", deterministic="auto")
    engine = probe.engine()
    assert engine.config.deterministic is True and engine.runner.config.deterministic is True
    assert engine.runner.attention.name == "cpu_paged_deterministic"
    assert engine.runner.model.fused_decode is not None and engine.runner.model.fused_decode.every_row
    assert probe.differences() == []


@pytest.mark.skipif(not PANELS_HERE, reason="the shapes are looked at only where auto could be on")
@pytest.mark.parametrize("change", [dict(intermediate_size=18944), dict(num_attention_heads=64, num_key_value_heads=1),
                                    dict(head_dim=320)])
def test_auto_is_off_for_a_model_the_one_call_kernel_does_not_take(tiny_models, monkeypatch, caplog, change):
    """Past decode_forward.c's limits (an intermediate size over 16,384, as Qwen2.5-7B's; more than 32 query heads
    a KV head; a head over 256) the mode would run layer by layer, at about half the throughput: auto stays off."""
    real = deterministic.load_hf_config
    monkeypatch.setattr(deterministic, "load_hf_config", lambda d: SimpleNamespace(**{**vars(real(d)), **change}))
    config = EngineConfig(model=str(tiny_models("llama")), dtype="bfloat16")
    with caplog.at_level("INFO", logger="common.engine.deterministic"):
        assert deterministic.settle(config, config.model).deterministic is False
    assert "the model's shapes do not fit" in caplog.text


@pytest.mark.parametrize("value", [1, 0, "yes", "true"])
def test_the_setting_takes_a_bool_or_auto_only(value):
    with pytest.raises(ConfigError, match="config field 'deterministic' = .* is invalid: one of 'auto', true, false"):
        EngineConfig(model="embedded", deterministic=value)
