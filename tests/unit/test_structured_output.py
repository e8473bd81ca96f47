"""Structured output: the mask kernel, the engine's matchers (replay, speculation, ends), and the request forms.

Engines run a tiny random model on the embedded tokenizer, whose unconstrained output is noise: whatever the
constraint allows is what comes out, so validity is the constraint's doing. The 50-schema check on the real model
through the cluster is ``tests/e2e/test_structured_outputs.py``.
"""
from __future__ import annotations

import json
import re

import msgspec
import pytest
import torch

from common.config.base import EngineConfig
from common.engine import structured_output
from common.engine.llm_engine import LLMEngine, RequestError
from common.engine.structured_output import apply_token_mask
from common.protocol import wire
from common.protocol.sampling_params import SamplingParams, StructuredOutput
from common.protocol.versions import STRUCTURED_SINCE, older_body
from proxy.core.errors import ApiError
from proxy.edge.protocol import ChatCompletionRequest, CompletionRequest
from tests.unit.test_spec_decode import prompts

ENUM_SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                "size": {"enum": ["S", "M", "L"]}, "ok": {"type": "boolean"}},
               "required": ["color", "size", "ok"], "additionalProperties": False}
WORDS = r"[a-z]{1,6}( [a-z]{1,6}){0,2}\."
CONSTRAINTS = [StructuredOutput(kind="json_schema", spec=json.dumps(ENUM_SCHEMA)),
               StructuredOutput(kind="regex", spec=WORDS),
               StructuredOutput(kind="choice", choices=["alpha", "beta", "gamma delta"])]


def valid(constraint: StructuredOutput, text: str) -> bool:
    if constraint.kind == "json_schema":
        doc = json.loads(text)
        return doc["color"] in ("red", "green", "blue") and doc["size"] in "SML" and isinstance(doc["ok"], bool)
    if constraint.kind == "regex":
        return re.fullmatch(WORDS, text) is not None
    return text in constraint.choices


def engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=256, **kw))


def run(eng: LLMEngine, params: list[SamplingParams], count: int):
    outs = eng.generate(prompts(count), params)
    assert eng.block_manager.num_used_blocks == 0, "KV blocks leaked"
    assert not eng.structured.live, "matchers outlived their sequences"
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("vocab", [64, 100, 49_152, 49_160])
def test_the_mask_kernel_equals_the_torch_path(vocab, monkeypatch):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=generator)
    words = -(-min(vocab, 49_152) // 32)  # a padded vocabulary: logits past the mask's words are masked too
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=generator, dtype=torch.int32)
    bitmask[0] = -1  # every token allowed
    bitmask[1, ::2] = 0
    rows = [4, 1, 2]
    by_kernel = logits.clone()
    apply_token_mask(by_kernel, bitmask, rows)
    monkeypatch.setattr(structured_output, "_mask_kernel", lambda: None)
    by_torch = logits.clone()
    apply_token_mask(by_torch, bitmask, rows)
    assert torch.equal(by_kernel, by_torch)
    assert torch.equal(by_kernel[[0, 3, 5]], logits[[0, 3, 5]])  # rows without a mask row are untouched
    bit = (bitmask[2, 7 // 32] >> (7 % 32)) & 1
    assert (by_kernel[2, 7] == logits[2, 7]) == bool(bit)
    if vocab > 32 * words:
        assert torch.isinf(by_kernel[rows, 32 * words:]).all()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_every_output_satisfies_its_constraint(tiny_chat_model_dir, temperature):
    eng = engine(tiny_chat_model_dir)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=64, structured=CONSTRAINTS[i % 3])
              for i in range(12)]
    for i, out in enumerate(run(eng, params, 12)):
        assert out.finish_reason == "stop", out
        assert valid(CONSTRAINTS[i % 3], out.text), out.text


@pytest.mark.parametrize("method", ["ngram", "self-draft"])
def test_drafts_the_grammar_forbids_are_rejected_and_greedy_output_is_unchanged(method, tiny_chat_model_dir):
    """Drafts come from the unconstrained model (self-draft) or the context (n-gram), so most break the grammar."""
    params = [SamplingParams(temperature=0.0, max_tokens=64, structured=CONSTRAINTS[i % 3]) for i in range(12)]
    plain = run(engine(tiny_chat_model_dir), params, 12)
    extra = {"ngram": {"method": "ngram", "ngram_min": 1, "adaptive": False},
             "self-draft": {"method": "draft", "draft_model": str(tiny_chat_model_dir)}}[method]
    speculating = engine(tiny_chat_model_dir, spec={"num_tokens": 4, "max_batch_size": 64, **extra})
    spec = run(speculating, params, 12)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert speculating.stats.num_spec_draft_tokens > speculating.stats.num_spec_accepted_tokens


def test_a_continued_request_replays_its_output_into_the_matcher(tiny_chat_model_dir):
    """As a decode worker takes a handed-off or resumed request: the rest equals the uninterrupted output."""
    eng = engine(tiny_chat_model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=64, structured=CONSTRAINTS[0])
    prompt = prompts(1)[0]
    (whole,) = eng.generate([prompt], params)
    tokens = whole.outputs[0].token_ids
    eng.add_request("resumed", prompt, params, output_token_ids=tokens[:5])
    while eng.has_unfinished():
        for out in eng.step():
            last = out
    assert last.outputs[0].token_ids == tokens


def test_output_the_constraint_rejects_is_refused(tiny_chat_model_dir):
    eng = engine(tiny_chat_model_dir)
    wrong = eng.tokenizer.encode("not json", add_special_tokens=False)
    params = SamplingParams(max_tokens=8, structured=CONSTRAINTS[0])
    with pytest.raises(RequestError, match="outside the request's structured output"):
        eng.add_request("r", prompts(1)[0], params, output_token_ids=wrong)
    with pytest.raises(RequestError, match="JSON schema .* does not compile: .*strnig"):
        eng.add_request("s", prompts(1)[0], SamplingParams(structured=StructuredOutput(
            kind="json_schema", spec='{"type": "strnig"}')))
    assert not eng.requests and not eng.structured.live


def test_a_draft_that_ends_the_grammar_leaves_only_stop_tokens_after_it(tiny_chat_model_dir):
    """An accepted stop-token draft ends the matcher mid-walk: the rows after it allow the stop tokens alone, the
    matcher is rolled back, and nothing raises (it once failed the worker's whole turn)."""
    eng = engine(tiny_chat_model_dir)
    (seq,) = eng.add_request("r", prompts(1)[0], SamplingParams(structured=StructuredOutput(kind="choice",
                                                                                           choices=["alpha"])))
    words = eng.tokenizer.encode("alpha", add_special_tokens=False)
    eos = sorted(eng.tokenizer.eos_token_ids)[0]
    draft = [*words, eos, words[0]]
    logits = torch.zeros(len(draft) + 1, eng.runner.vocab_size)
    eng.structured.mask(logits, [seq], [draft])
    assert not seq.grammar.is_terminated() and seq.grammar.accept_token(words[0])  # rolled back to the start
    for row in range(len(words) + 1, len(draft) + 1):  # after the stop token
        allowed = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert set(allowed) <= set(eng.tokenizer.eos_token_ids) and allowed
    eng.abort_request("r")


def test_masked_tokens_have_a_finite_logprob_floor(tiny_chat_model_dir):
    eng = engine(tiny_chat_model_dir)
    params = [SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, structured=CONSTRAINTS[2])]
    (out,) = run(eng, params, 1)
    values = [v for row in out.top_logprobs for _, v in row] + out.logprobs
    assert all(v >= -9999.0 for v in values) and min(values) == -9999.0


def test_a_grammar_ended_while_ignoring_eos_stops_the_sequence(tiny_chat_model_dir):
    eng = engine(tiny_chat_model_dir)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, structured=CONSTRAINTS[2])]
    (out,) = run(eng, params, 1)
    assert out.finish_reason == "stop" and out.text in CONSTRAINTS[2].choices + [
        c + eng.tokenizer.decode([t]) for c in CONSTRAINTS[2].choices for t in eng.tokenizer.eos_token_ids]


def test_structured_params_cross_the_wire_and_only_to_a_worker_that_knows_them():
    params = SamplingParams(structured=CONSTRAINTS[2])
    request = wire.PrefillRequest("r", [1, 2], params, seed=1, lease_s=5.0)
    assert wire.decode(wire.encode(request)).params.structured == CONSTRAINTS[2]
    assert "structured" not in older_body(request, 12)["params"]
    assert STRUCTURED_SINCE == 13 <= wire.PROTOCOL_VERSION
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"kind": "xml"}, StructuredOutput)
    with pytest.raises(ValueError, match="choice constraint"):
        StructuredOutput(kind="choice", choices=[""])


def chat(**extra) -> SamplingParams:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    return ChatCompletionRequest.model_validate(body).sampling_params(16)


def test_each_request_form_becomes_one_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    expected = StructuredOutput(kind="json_schema", spec=json.dumps(schema, separators=(",", ":")))
    assert chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
                ).structured == expected
    assert chat(guided_json=schema).structured == expected
    assert chat(guided_json=json.dumps(schema)).structured == expected
    assert chat(structured_outputs={"json": schema}).structured == expected
    assert chat(response_format={"type": "json_object"}).structured == StructuredOutput(kind="json_object")
    assert chat(response_format={"type": "text"}).structured is None and chat().structured is None
    assert chat(guided_regex="a+").structured == StructuredOutput(kind="regex", spec="a+")
    assert chat(guided_choice=["x", "y"]).structured == StructuredOutput(kind="choice", choices=["x", "y"])
    assert chat(structured_outputs={"grammar": 'root ::= "a"'}).structured.kind == "grammar"
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "p", "guided_regex": "b"})
    assert completion.sampling_params(16).structured == StructuredOutput(kind="regex", spec="b")


@pytest.mark.parametrize("extra, param", [
    ({"guided_json": "[" * 5000 + "]" * 5000}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": False}}}, "response_format.json_schema.schema"),
    ({"guided_json": {"items": {"items": {"items": {}}}} | json.loads('{"a":' * 70 + "1" + "}" * 70)}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"guided_json": "{nope"}, "guided_json"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
])
def test_a_malformed_constraint_is_a_400_naming_the_field(extra, param):
    with pytest.raises(ApiError) as caught:
        chat(**extra)
    assert caught.value.status == 400 and caught.value.param == param


def _byte_fallback_tokenizer_dir(path):
    """A SentencePiece-style tokenizer (BPE with byte fallback, a metaspace pre-tokenizer): the other vocabulary
    type xgrammar tells apart from byte-level BPE's."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("\u2581", "a", "b", "c", "\u2581a", "\u2581b", "ab", "\u2581ab", "bc"):
        vocab[piece] = len(vocab)
    merges = [("\u2581", "a"), ("\u2581", "b"), ("a", "b"), ("\u2581a", "b"), ("b", "c")]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "unk_token": "<unk>",
                                                            "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


@pytest.mark.parametrize("which", ["embedded", "byte-fallback"])
def test_the_tokenizer_info_read_from_tokenizer_json_is_xgrammars_own(which, embedded_model_dir, tmp_path,
                                                                        monkeypatch):
    """The worker reads xgrammar's view of the tokenizer from tokenizer.json without transformers
    (``structured_output.tokenizer_info``): the same vocabulary, type, prefix-space rule, stop and special tokens
    as xgrammar's own reading of transformers' tokenizer, and (a padded vocabulary, as a model's often is) past
    the tokenizer's ids."""
    xgrammar = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    model_dir = embedded_model_dir if which == "embedded" else _byte_fallback_tokenizer_dir(tmp_path)
    hf = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = len(hf.get_vocab()) + 7
    stop = [hf.eos_token_id]
    theirs = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop)

    def not_this_way(*args, **kwargs):
        raise AssertionError("tokenizer_info went through from_huggingface")

    monkeypatch.setattr(xgrammar.TokenizerInfo, "from_huggingface", not_this_way)
    ours = structured_output.tokenizer_info(xgrammar, model_dir, vocab_size, stop)
    assert ours.vocab_type == theirs.vocab_type == (xgrammar.VocabType.BYTE_LEVEL if which == "embedded"
                                                    else xgrammar.VocabType.BYTE_FALLBACK)
    assert (ours.vocab_size, ours.add_prefix_space, ours.stop_token_ids, ours.special_token_ids) == \
        (theirs.vocab_size, theirs.add_prefix_space, theirs.stop_token_ids, theirs.special_token_ids)
    assert ours.decoded_vocab == theirs.decoded_vocab
    assert ours.dump_metadata() == theirs.dump_metadata()
