"""Token ids as the OpenAI API shows them in logprobs: a string and its bytes.

A byte-level BPE token (GPT-2 style, as SmolLM2 and Llama 3 use) may hold
part of a UTF-8 character, so decoding it alone would give U+FFFD; its exact
bytes come from the token's vocabulary string through the byte-to-unicode
table. Tokens of other vocabularies (SentencePiece ``▁``) fall back to their
decoded text. The string shown is the bytes decoded with replacement.
"""
from __future__ import annotations

from functools import lru_cache

from common.text.tokenizer import Tokenizer


def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode table (printable bytes map to themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_OF = _unicode_to_byte()


class TokenText:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.bytes_of = lru_cache(maxsize=1 << 16)(self._bytes_of)

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self._tokenizer.token_piece(token_id)
        if isinstance(piece, str) and piece and all(ch in _BYTE_OF for ch in piece):
            return bytes(_BYTE_OF[ch] for ch in piece)
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


def completion_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[float] | None,
                        top_logprobs: list[list[list]] | None, text_offset: int) -> dict:
    """The legacy completions shape: parallel lists, ``top_logprobs`` as {token: logprob} per position."""
    tokens = [token_text.text_of(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": _per_token(logprobs, len(token_ids)),
        "top_logprobs": [{token_text.text_of(t): lp for t, lp in alternatives}
                         for alternatives in _per_token(top_logprobs, len(token_ids), [])],
        "text_offset": offsets,
    }


def chat_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[float] | None,
                  top_logprobs: list[list[list]] | None) -> list[dict]:
    """The chat shape: one entry per token with its bytes and its alternatives."""
    def entry(token_id: int, logprob: float | None) -> dict:
        raw = token_text.bytes_of(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return [
        {**entry(t, lp), "top_logprobs": [entry(alt, alt_lp) for alt, alt_lp in alternatives]}
        for t, lp, alternatives in zip(token_ids, _per_token(logprobs, len(token_ids)),
                                       _per_token(top_logprobs, len(token_ids), []))
    ]


def _per_token(values: list | None, count: int, missing=None) -> list:
    """``values`` padded (or cut) to one per token; workers send None when they have none."""
    values = list(values or [])[:count]
    return values + [missing] * (count - len(values))
