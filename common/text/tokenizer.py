"""The text side of a request: token ids <-> text, streaming deltas, stop strings.

``Tokenizer`` wraps the model directory's Hugging Face tokenizer. The output
processor keeps one ``TextState`` per output sequence and, once per step,
hands it the new token ids:

    state = TextState(tokenizer, prompt_ids, params)
    delta, stop = state.update(new_token_ids)   # stop: the stop string that matched
    state.flush()                               # at finish: releases held-back text
    state.text                                  # everything emitted so far

Text is held back for two reasons and released as soon as it is settled: the
last tokens end inside a UTF-8 character (byte-level BPE), or the text ends
with what could be the beginning of a stop string.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from transformers import AutoTokenizer

from common.protocol.sampling_params import SamplingParams

# Prompt tokens decoded ahead of the first output token, so that it renders as
# it would mid-text (a SentencePiece leading space, say); vLLM uses the same 5.
_PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE_CHARACTER = "\ufffd"


class Tokenizer:
    """A model directory's tokenizer plus the end-of-sequence ids it implies."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self.hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.eos_token_ids: set[int] = _eos_token_ids(self.hf.eos_token_id, model_dir)
        self.vocab_size = len(self.hf)  # every id it can produce, added tokens included

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No clean-up of spaces before punctuation: it would make a window's
        # decode differ from the same tokens' decode inside the full text.
        return self.hf.decode(
            list(token_ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not self.hf.chat_template:
            raise ValueError(
                "the tokenizer has no chat template (chat_template in tokenizer_config.json "
                "or chat_template.jinja); send a plain prompt instead of chat messages"
            )
        ids = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        # transformers 5 returns a BatchEncoding where 4 returned the ids.
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def _eos_token_ids(tokenizer_eos: int | None, model_dir: Path) -> set[int]:
    """The tokenizer's EOS plus generation_config.json's eos_token_id (int or list)."""
    ids = set() if tokenizer_eos is None else {tokenizer_eos}
    config_path = model_dir / "generation_config.json"
    if config_path.is_file():
        configured = json.loads(config_path.read_text()).get("eos_token_id")
        if isinstance(configured, int):
            ids.add(configured)
        elif isinstance(configured, list):
            ids.update(configured)
    return ids


class IncrementalDetokenizer:
    """Stable text deltas for a growing list of token ids, O(1) work per token.

    Each call decodes a short window: the tokens of the previous delta (the
    prefix) plus the new ones, and returns what the new ones added. The
    delta is held back while the window's text ends in U+FFFD, i.e. inside
    a multi-byte character that later tokens will complete.
    """

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids = list(context_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def add(self, token_ids: Sequence[int]) -> str:
        self._token_ids.extend(token_ids)
        prefix, text = self._window_texts()
        if len(text) <= len(prefix) or text.endswith(_INCOMPLETE_CHARACTER):
            return ""
        return self._advance(prefix, text)

    def flush(self) -> str:
        """Whatever is held back, incomplete characters included."""
        return self._advance(*self._window_texts())

    def _window_texts(self) -> tuple[str, str]:
        window = self._token_ids[self._prefix_offset:]
        read = self._read_offset - self._prefix_offset
        decode = self._tokenizer.decode
        return decode(window[:read], self._skip_special_tokens), decode(window, self._skip_special_tokens)

    def _advance(self, prefix: str, text: str) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        return text[len(prefix):]


class StopChecker:
    """Finds stop strings in streamed text and holds back possible beginnings.

    Invariant: the text already released never ends with a proper prefix of a
    stop string, so a match can only start in the held-back part, and the
    held-back part plus each new delta is all that needs searching.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool) -> None:
        self._stop = list(stop)
        self._include = include_stop_str_in_output
        self._held = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str | None]:
        """(text safe to release, stop string that matched or None).

        After a match the released text ends at the match's start (or end,
        with include_stop_str_in_output) and the caller must feed no more.
        With ``final`` nothing is held back.
        """
        text, self._held = self._held + delta, ""
        match = self._first_completed(text)
        if match is not None:
            start, stop = match
            return text[: start + len(stop) if self._include else start], stop
        held = 0 if final else self._longest_partial_stop(text)
        self._held = text[len(text) - held:] if held else ""
        return text[: len(text) - held], None

    def _first_completed(self, text: str) -> tuple[int, str] | None:
        """The match that ends first; of those ending together, the longest.

        Ending first is what token-by-token streaming would see, so the
        answer does not depend on how the text was split into deltas.
        """
        found = [(at + len(s), at, s) for s in self._stop if (at := text.find(s)) >= 0]
        if not found:
            return None
        _, start, stop = min(found)
        return start, stop

    def _longest_partial_stop(self, text: str) -> int:
        return max(
            (k for s in self._stop for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])),
            default=0,
        )


class TextState:
    """One output sequence's text: what the output processor calls per step."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._stops = StopChecker(params.stop, params.include_stop_str_in_output)
        # The token that ends a sequence adds no text (vLLM), unless the
        # request wants its stop in the output.
        ending_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else tokenizer.eos_token_ids)
        self._silent_ids = set() if params.include_stop_str_in_output else ending_ids
        self.text = ""  # all text released so far
        self.num_tokens = 0  # output tokens consumed; none after a stop string
        self.stop_string: str | None = None
        self.flushed = False
        self._untaken = ""

    def update(self, new_token_ids: Sequence[int]) -> tuple[str, str | None]:
        """Consume new output tokens; (text delta, stop string matched now or None).

        Tokens are taken one at a time so that a stop string stops the
        sequence at the token that completed it; later ones are not consumed.
        """
        released, matched = [], None
        for token_id in new_token_ids:
            if self.stop_string is not None or self.flushed:
                break
            self.num_tokens += 1
            if token_id not in self._silent_ids:
                text, self.stop_string = self._stops.feed(self._detokenizer.add([token_id]))
                released.append(text)
                matched = self.stop_string
        return self._release("".join(released)), matched

    def flush(self) -> str:
        """At finish: release held-back text; it is checked for stop strings too."""
        done = self.flushed or self.stop_string is not None
        self.flushed = True
        if done:
            return ""
        text, self.stop_string = self._stops.feed(self._detokenizer.flush(), final=True)
        return self._release(text)

    def take_delta(self) -> str:
        """Text released since the previous call (one report's worth)."""
        delta, self._untaken = self._untaken, ""
        return delta

    def _release(self, text: str) -> str:
        self.text += text
        self._untaken += text
        return text
