"""Tokenizer wrapper, UTF-8-safe streaming detokenization and stop strings.

Most tests use a tiny byte-level BPE trained here, whose vocabulary splits
accented letters, CJK and emoji across several tokens; the last ones repeat
the key checks on the embedded SmolLM2 tokenizer.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from common.protocol.sampling_params import SamplingParams
from common.text import tokenizer as tokenizer_module
from common.text.tokenizer import (ByteLevelDetokenizer, IncrementalDetokenizer, StopChecker, TextState, Tokenizer,
                                   _byte_pieces, detokenizer)

SPECIALS = ["<|eos|>", "<|user|>", "<|assistant|>", "<|end|>"]  # ids 0..3
EOS, END = 0, 3
CORPUS = [
    "héllo wörld 日本語 🙂",
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello tokens. Ünïcödé ñ ç 中文 😀🎉",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
UNICODE_TEXT = "héllo wörld 日本語 🙂 ok, Ünïcödé 中文 😀🎉!"


def save_tiny_tokenizer(directory: Path, generation_eos: int | list[int] | None, template: bool = True) -> Path:
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(CORPUS * 20, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=SPECIALS[EOS])
    if template:
        hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(directory)
    if generation_eos is not None:
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return directory


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer(save_tiny_tokenizer(tmp_path_factory.mktemp("tiny-bpe"), generation_eos=[EOS, END]))


def stream(state: TextState, token_ids: list[int]) -> list[str]:
    """Feed one token per step, then flush; the released deltas in order."""
    deltas = [state.update([t])[0] for t in token_ids]
    return deltas + [state.flush()]


def text_state(tokenizer: Tokenizer, prompt: str = "", **params) -> TextState:
    return TextState(tokenizer, tokenizer.encode(prompt), SamplingParams(**params))


# ---- the wrapper ---------------------------------------------------------------


def test_encode_decode_round_trip(tokenizer):
    ids = tokenizer.encode(UNICODE_TEXT)
    assert tokenizer.decode(ids) == UNICODE_TEXT
    assert tokenizer.decode(ids + [EOS]) == UNICODE_TEXT
    assert tokenizer.decode(ids + [EOS], skip_special_tokens=False) == UNICODE_TEXT + "<|eos|>"
    assert tokenizer.vocab_size == 330


def test_the_test_vocabulary_splits_characters_across_tokens(tokenizer):
    pieces = [tokenizer.decode([t]) for t in tokenizer.encode(UNICODE_TEXT)]
    assert any("\ufffd" in piece for piece in pieces)


def test_eos_ids_merge_tokenizer_and_generation_config(tokenizer, tmp_path):
    assert tokenizer.eos_token_ids == {EOS, END}
    assert Tokenizer(save_tiny_tokenizer(tmp_path / "int", generation_eos=END)).eos_token_ids == {EOS, END}
    assert Tokenizer(save_tiny_tokenizer(tmp_path / "none", generation_eos=None)).eos_token_ids == {EOS}


def test_chat_template_gives_token_ids(tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert all(isinstance(t, int) for t in ids)
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|user|>hello<|assistant|>"
    no_prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=False)
    assert tokenizer.decode(no_prompt, skip_special_tokens=False) == "<|user|>hello"


def test_missing_chat_template_is_a_clear_error(tmp_path):
    bare = Tokenizer(save_tiny_tokenizer(tmp_path, generation_eos=None, template=False))
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


# ---- incremental detokenization ------------------------------------------------


def test_streaming_never_splits_a_character(tokenizer):
    ids = tokenizer.encode(UNICODE_TEXT)
    deltas = stream(text_state(tokenizer, "prompt: "), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == UNICODE_TEXT
    assert "" in deltas[:-1]  # some steps had to hold an incomplete character back


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40), prompt=st.text(max_size=10))
def test_streamed_valid_text_is_exact_and_never_broken(tokenizer, text, prompt):
    ids = tokenizer.encode(text)
    deltas = stream(text_state(tokenizer, prompt), ids)
    assert all("\ufffd" not in d for d in deltas if "\ufffd" not in text)
    assert "".join(deltas) == tokenizer.decode(ids)


@pytest.mark.parametrize("kind", ["bytes", "windows"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ids=st.lists(st.integers(0, 329), max_size=30),
    prompt=st.text(max_size=10),
    skip_special_tokens=st.booleans(),
    chunks=st.lists(st.integers(1, 4), min_size=30, max_size=30),
)
def test_deltas_concatenate_to_the_full_decode_for_any_ids(tokenizer, kind, ids, prompt, skip_special_tokens, chunks):
    """Even for byte soup that is not valid UTF-8, and for multi-token steps, by either detokenizer: the byte-level
    one (each token's bytes through an incremental UTF-8 decoder) and the one that decodes windows again.

    The prompt is text, so it ends on a character boundary; output bytes that
    complete a character the prompt's ids left open would join that character.
    """
    if kind == "bytes":
        detokenizer = ByteLevelDetokenizer(tokenizer.byte_pieces(skip_special_tokens))
    else:
        detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), skip_special_tokens)
    deltas, start = [], 0
    for size in chunks:
        deltas.append(detokenizer.add(ids[start:start + size]))
        start += size
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_byte_level_tokenizer_streams_by_bytes_and_any_other_by_windows(tokenizer, tmp_path):
    """The tiny test vocabulary and SmolLM2's are byte-level BPE: each token's piece is the bytes the library
    decodes it to. A SentencePiece-style (Metaspace) tokenizer has no such pieces and streams by windows, exactly."""
    for skip in (True, False):
        pieces = tokenizer.byte_pieces(skip)
        assert [p.decode("utf-8", "replace") for p in pieces] == \
            [tokenizer.decode([t], skip_special_tokens=skip) for t in range(tokenizer.vocab_size)]
    assert tokenizer.byte_pieces(True)[EOS] == b"" and tokenizer.byte_pieces(False)[EOS] == b"<|eos|>"
    assert isinstance(detokenizer(tokenizer, [], True), ByteLevelDetokenizer)
    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    raw.save(str(tmp_path / "tokenizer.json"))
    metaspace = Tokenizer(tmp_path)
    assert metaspace.byte_pieces(True) is None
    assert isinstance(detokenizer(metaspace, [], True), IncrementalDetokenizer)
    ids, prompt = metaspace.encode("hello world, hello tokens"), metaspace.encode("the quick")
    streamed = "".join(stream(TextState(metaspace, prompt, SamplingParams()), ids))
    assert streamed == " hello world, hello tokens"  # as it reads after the prompt, its first space kept


def test_byte_pieces_that_differ_from_the_library_decode_are_not_used(tokenizer):
    """The pieces are held to the library's own decode of every id: one that differs (a decoder this code does not
    foresee) turns the byte path off."""
    class Differs:
        def __init__(self, backend) -> None:
            self._backend = backend

        def __getattr__(self, name):
            return getattr(self._backend, name)

        def decode_batch(self, batch, skip_special_tokens):
            texts = self._backend.decode_batch(batch, skip_special_tokens=skip_special_tokens)
            return [*texts[:7], texts[7] + "x", *texts[8:]]

    assert _byte_pieces(tokenizer.backend, True) is not None
    assert _byte_pieces(Differs(tokenizer.backend), True) is None


def test_tokenizers_of_one_file_share_its_parse_and_byte_pieces_and_a_changed_file_is_read_again(tmp_path):
    """Two model directories with the same tokenizer.json (a random-weight model beside the one whose tokenizer it
    took) share one parse and one table per process; a file that differs by a byte is its own; the process keeps a
    bounded number of files."""
    first = save_tiny_tokenizer(tmp_path / "first", generation_eos=EOS)
    second = tmp_path / "second"
    second.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (second / name).write_bytes((first / name).read_bytes())
    a, b = Tokenizer(first), Tokenizer(second)
    assert a.backend is b.backend and a.byte_pieces(True) is b.byte_pieces(True)
    assert a.byte_pieces(True) is not a.byte_pieces(False)
    spec = json.loads((second / "tokenizer.json").read_text())
    spec["model"]["vocab"]["<extra>"] = len(spec["model"]["vocab"])
    (second / "tokenizer.json").write_text(json.dumps(spec))
    changed = Tokenizer(second)
    assert changed.backend is not a.backend and changed.vocab_size == a.vocab_size + 1
    assert len(changed.byte_pieces(True)) == len(a.byte_pieces(True)) + 1
    for n in range(tokenizer_module._KEPT_FILES):
        other = tmp_path / f"other-{n}"
        other.mkdir()
        spec["model"]["vocab"][f"<extra-{n}>"] = len(spec["model"]["vocab"])
        (other / "tokenizer.json").write_text(json.dumps(spec))
        Tokenizer(other)
    assert len(tokenizer_module._FILES) == tokenizer_module._KEPT_FILES
    assert Tokenizer(first).backend is not a.backend  # let go as the least recently read, and read again


def test_terminating_eos_adds_no_text_even_when_special_tokens_show(tokenizer):
    ids = tokenizer.encode("done") + [EOS]
    state = text_state(tokenizer, skip_special_tokens=False)
    assert "".join(stream(state, ids)) == "done"
    assert state.num_tokens == len(ids)
    kept = text_state(tokenizer, skip_special_tokens=False, ignore_eos=True)
    assert "".join(stream(kept, ids)) == "done<|eos|>"
    stop_token = text_state(tokenizer, skip_special_tokens=False, stop_token_ids=[1])
    assert "".join(stream(stop_token, tokenizer.encode("ab") + [1])) == "ab"


# ---- stop strings --------------------------------------------------------------


def test_stop_string_split_across_tokens_is_caught_and_excluded(tokenizer):
    ids = tokenizer.encode("abc STOP def")
    assert not any("STOP" in tokenizer.decode([t]) for t in ids)  # really spans tokens
    state = text_state(tokenizer, stop=["STOP"])
    results = [state.update([t]) for t in ids]
    deltas = [d for d, _ in results]
    assert [s for _, s in results if s is not None] == ["STOP"]
    assert state.text == "abc " and "".join(deltas) == "abc "
    assert not any("S" in d for d in deltas)  # never partially emitted
    assert state.num_tokens == next(i for i, (_, s) in enumerate(results) if s) + 1
    assert state.update(tokenizer.encode(" more")) == ("", None)
    assert state.flush() == "" and state.text == "abc "


def test_include_stop_str_in_output(tokenizer):
    state = text_state(tokenizer, stop=["STOP"], include_stop_str_in_output=True)
    deltas = stream(state, tokenizer.encode("abc STOP def"))
    assert "".join(deltas) == state.text == "abc STOP"
    assert state.stop_string == "STOP"


def test_held_back_prefix_is_released_when_it_is_not_a_stop(tokenizer):
    state = text_state(tokenizer, stop=["STOP"])
    assert state.update(tokenizer.encode("abc ST"))[0] == "abc "
    assert state.update(tokenizer.encode("AR"))[0] == "STAR"


def test_held_back_prefix_is_released_at_flush(tokenizer):
    state = text_state(tokenizer, stop=["STOP"])
    assert state.update(tokenizer.encode("abc ST")) == ("abc ", None)
    assert state.flush() == "ST"
    assert state.text == "abc ST" and state.stop_string is None and state.flushed


def test_earliest_completed_stop_wins_however_the_text_is_chunked(tokenizer):
    ids = tokenizer.encode("hello world and STOP")
    for chunk in (1, 3, len(ids)):
        state = text_state(tokenizer, stop=["STOP", "world", "lo w"])
        for start in range(0, len(ids), chunk):
            state.update(ids[start:start + chunk])
        assert (state.text, state.stop_string) == ("hel", "lo w")


def test_a_multi_token_step_stops_at_the_token_that_completed_the_stop(tokenizer):
    head, tail = tokenizer.encode("xy END"), tokenizer.encode(" after")
    state = text_state(tokenizer, stop=["END"])
    assert state.update(head + tail) == ("xy ", "END")
    assert state.num_tokens == len(head)


def test_take_delta_collects_releases_between_reports(tokenizer):
    state = text_state(tokenizer)
    state.update(tokenizer.encode("one "))
    state.update(tokenizer.encode("two"))
    assert state.take_delta() == "one two"
    assert state.take_delta() == ""
    state.update(tokenizer.encode(" three"))
    state.flush()
    assert state.take_delta() == " three"


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Scan every end position; the first stop to complete (longest on a tie) wins."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[: end if include else end - len(stop)], stop
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abST ", max_size=30),
    stops=st.lists(st.text(alphabet="abST ", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    include=st.booleans(),
)
def test_stop_checker_matches_reference_and_never_retracts(text, stops, cuts, include):
    checker = StopChecker(stops, include)
    pieces = [text[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)])]
    released, stop = "", None
    for piece in pieces:
        out, stop = checker.feed(piece)
        released += out
        if stop is not None:
            break
    if stop is None:
        released += checker.feed("", final=True)[0]
    expected_text, expected_stop = reference_stop(text, stops, include)
    assert (released, stop) == (expected_text, expected_stop)


# ---- the embedded model's tokenizer -------------------------------------------


@pytest.fixture(scope="module")
def smollm2(embedded_model_dir) -> Tokenizer:
    return Tokenizer(embedded_model_dir)


@pytest.mark.slow
def test_smollm2_eos_and_chat_template(smollm2):
    im_end = smollm2.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1 and im_end[0] in smollm2.eos_token_ids
    ids = smollm2.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    text = smollm2.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_streaming_is_exact_and_stops(smollm2):
    prompt = smollm2.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = smollm2.encode(UNICODE_TEXT + " The end.", add_special_tokens=False)
    deltas = stream(TextState(smollm2, prompt, SamplingParams()), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == smollm2.decode(ids) == UNICODE_TEXT + " The end."
    state = TextState(smollm2, prompt, SamplingParams(stop=["中文"]))
    assert [s for t in ids if (s := state.update([t])[1])] == ["中文"]
    assert state.text == UNICODE_TEXT.split("中文")[0]


# ---- equal to transformers on the embedded model ----------------------------------------------
TEXTS = ["Hello, world!", "  leading and trailing spaces  ", "ünïcödé ÿ 你好 🐱‍👤 \u200b", "line\nbreaks\r\n\ttabs",
         "<|im_start|>user\nhi<|im_end|>", "numbers 1234567890 3.14159", "", "a" * 300, "emoji 👋🏽 and  double  spaces"]


@pytest.fixture(scope="module")
def smollm2_pair(embedded_model_dir):
    from transformers import AutoTokenizer

    return Tokenizer(embedded_model_dir), AutoTokenizer.from_pretrained(embedded_model_dir)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_equals_transformers(smollm2_pair, text, add_special_tokens):
    ours, hf = smollm2_pair
    assert ours.encode(text, add_special_tokens) == hf.encode(text, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_equals_transformers(smollm2_pair, text, skip_special_tokens):
    ours, hf = smollm2_pair
    ids = hf.encode(text) + [0, 1, 2]  # special tokens too
    assert ours.decode(ids, skip_special_tokens) == hf.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def test_vocabulary_and_eos_equal_transformers(smollm2_pair):
    ours, hf = smollm2_pair
    assert ours.vocab_size == len(hf)
    assert hf.eos_token_id in ours.eos_token_ids
    assert [ours.token_piece(t) for t in range(0, ours.vocab_size, 997)] == \
        hf.convert_ids_to_tokens(list(range(0, ours.vocab_size, 997)))
