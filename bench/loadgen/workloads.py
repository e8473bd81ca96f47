"""What each request of a load point asks for: a prompt and the number of tokens to generate.

Workloads (``--workload``):

- ``random``: prompts of random token ids, ``--input-len`` long (a number or
  a ``LO-HI`` range drawn uniformly), sent as token ids on /v1/completions
  (exact lengths) or decoded to text for chat. Special tokens are never drawn.
- ``shared-prefix``: ``--num-prefixes`` random prefixes of ``--prefix-len``
  tokens, each request one of them plus its own random suffix of
  ``--input-len`` tokens, in shuffled order: what a prefix cache is for.
- ``copy``: ask the model to repeat or lightly edit a supplied passage, where
  the output largely copies the input (what speculative decoding speeds up).
- ``realistic``: the small hand-written prompt set shipped with Tessera, each
  with the answer length a helpful reply needs.
- ``sharegpt``: the first user turn of each conversation in a ShareGPT-format
  JSON file (``[{"conversations": [{"from": "human", "value": ...},
  {"from": "gpt", "value": ...}]}, ...]``), the reply's length as output length.

``--output-len`` overrides every workload's output lengths. Token workloads
need a tokenizer; text workloads use one when given, and otherwise leave the
input length to the server's ``usage`` and estimate reply lengths at four
characters per token.

Sampling is seeded and independent of the arrivals. The benchmark asks for a
new ``draw`` for the warm-up and for each load point, so that a prefix cache
filled by one point does not answer the next point's prompts (the text
workloads come from small sets, so their prompts do repeat, shuffled anew).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

WORKLOADS = ("random", "shared-prefix", "copy", "realistic", "sharegpt", "multi-turn")  # the last: multiturn.py
TOKEN_WORKLOADS = ("random", "shared-prefix")
DEFAULT_OUTPUT_LEN = (128, 128)
CHARS_PER_TOKEN = 4  # the usual estimate for English text with a BPE tokenizer
COPY_SLACK_TOKENS = 16  # room past the passage's length for the model to finish


@dataclass(frozen=True)
class RequestSpec:
    prompt: str | list[int]
    input_len: int | None
    output_len: int


@dataclass(frozen=True)
class WorkloadOptions:
    name: str = "random"
    input_len: tuple[int, int] = (256, 256)
    output_len: tuple[int, int] | None = None
    num_prefixes: int = 4
    prefix_len: int = 256
    dataset_path: Path | None = None


def parse_length(text: str, flag: str) -> tuple[int, int]:
    """``"256"`` -> (256, 256); ``"128-512"`` -> (128, 512)."""
    low, _, high = text.partition("-")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise ValueError(f"{flag} takes a token count or a LO-HI range, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"{flag} {text!r}: lengths must be at least 1, and LO no more than HI")
    return bounds


class TokenSource:
    """A tokenizer's ordinary (non-special) vocabulary, to draw prompts from and to count text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.allowed = np.array(tokenizer.ordinary_token_ids())

    def random_ids(self, rng: np.random.Generator, length: int) -> list[int]:
        return [int(t) for t in rng.choice(self.allowed, size=length)]

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def build_workload(options: WorkloadOptions, count: int, seed: int, tokens: TokenSource | None,
                   as_text: bool, draw: int = 0) -> list[RequestSpec]:
    """``count`` requests; each ``draw`` number gives other prompts from the same seed (see the module doc)."""
    rng = np.random.default_rng((seed, 1, draw))
    if options.name in TOKEN_WORKLOADS:
        if tokens is None:
            raise ValueError(f"the {options.name} workload needs --tokenizer")
        specs = _token_workload(options, count, rng, tokens, as_text)
    else:
        specs = _text_workload(options, count, rng, tokens)
    if options.output_len is not None:
        specs = [RequestSpec(s.prompt, s.input_len, _draw(rng, options.output_len)) for s in specs]
    return specs


def _draw(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def _token_workload(options: WorkloadOptions, count: int, rng: np.random.Generator, tokens: TokenSource,
                    as_text: bool) -> list[RequestSpec]:
    prefixes = [[]]
    if options.name == "shared-prefix":
        prefixes = [tokens.random_ids(rng, options.prefix_len) for _ in range(options.num_prefixes)]
    owners = rng.permutation(np.arange(count) % len(prefixes))
    specs = []
    for owner in owners:
        ids = prefixes[owner] + tokens.random_ids(rng, _draw(rng, options.input_len))
        prompt = tokens.decode(ids) if as_text else ids
        specs.append(RequestSpec(prompt, len(ids), _draw(rng, options.output_len or DEFAULT_OUTPUT_LEN)))
    return specs


def _text_workload(options: WorkloadOptions, count: int, rng: np.random.Generator,
                   tokens: TokenSource | None) -> list[RequestSpec]:
    def length(text: str) -> int:
        return tokens.count(text) if tokens else max(1, round(len(text) / CHARS_PER_TOKEN))

    if options.name == "sharegpt":
        pairs = load_sharegpt(options.dataset_path)
    else:
        prompt_set = json.loads(resources.files("bench.loadgen").joinpath("prompt_set.json").read_text())
        if options.name == "realistic":
            pairs = [(p["prompt"], p["output_len"]) for p in prompt_set["prompts"]]
        else:
            pairs = [(f"{instruction}\n\n{passage}", passage) for instruction in prompt_set["copy_instructions"]
                     for passage in prompt_set["passages"]]
    slack = COPY_SLACK_TOKENS if options.name == "copy" else 0
    order = [int(i) for i in rng.permutation(len(pairs))]
    specs = []
    for n in range(count):
        prompt, reply = pairs[order[n % len(pairs)]]
        output_len = reply if isinstance(reply, int) else length(reply) + slack
        specs.append(RequestSpec(prompt, length(prompt) if tokens else None, output_len))
    return specs


def load_sharegpt(path: Path | None) -> list[tuple[str, str]]:
    """(first user turn, the reply to it) of each conversation that has both."""
    if path is None:
        raise ValueError("the sharegpt workload needs --dataset-path (a ShareGPT-format JSON file)")
    pairs = []
    for entry in json.loads(Path(path).read_text()):
        turns = entry.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            if turns[0].get("value") and turns[1].get("value"):
                pairs.append((turns[0]["value"], turns[1]["value"]))
    if not pairs:
        raise ValueError(f"{path} has no conversation opening with a human turn answered by a gpt turn")
    return pairs
