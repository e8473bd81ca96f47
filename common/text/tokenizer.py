"""The text side of a request: token ids <-> text, chat templates, streaming deltas, stop strings.

``Tokenizer`` reads a model directory's ``tokenizer.json`` with the
``tokenizers`` library and renders its chat template with Jinja2 the way
transformers' ``apply_chat_template`` does (a sandboxed environment with the
same filters and globals; tests/unit/test_chat_template.py holds the two
equal), so the proxy needs neither transformers nor torch. The output
processor keeps one ``TextState`` per output sequence and, once per step,
hands it the new token ids:

    state = TextState(tokenizer, prompt_ids, params)
    delta, stop = state.update(new_token_ids)   # stop: the stop string that matched
    state.flush()                               # at finish: releases held-back text
    state.text                                  # everything emitted so far

Text is held back for two reasons and released as soon as it is settled: the
last tokens end inside a UTF-8 character (byte-level BPE), or the text ends
with what could be the beginning of a stop string.

A byte-level BPE tokenizer's output (GPT-2's, Llama 3's, Qwen's, SmolLM's) is
streamed by its tokens' bytes (``ByteLevelDetokenizer``, a lookup per token);
any other's by decoding a short window of tokens again (``IncrementalDetokenizer``,
two library calls per step), which also renders a SentencePiece leading space
as it reads after the prompt.

Every ``Tokenizer`` of one tokenizer.json (by its digest) in a process shares the library's parse of it and its byte
pieces: a worker that swaps models, or a test process building engine after engine, reads a vocabulary once.
"""
from __future__ import annotations

import codecs
import gc
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend
from tokenizers import decoders

from common.protocol.sampling_params import SamplingParams

# Prompt tokens decoded ahead of the first output token, so that it renders as
# it would mid-text (a SentencePiece leading space, say); vLLM uses the same 5.
_PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE_CHARACTER = "\ufffd"
# The named special tokens a chat template sees as variables, as transformers passes them.
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

log = logging.getLogger(__name__)

# The tokenizer.json files this process has read, by their digest (``_read``): an engine, a proxy's served model or a
# test's tokenizer built again on the same file shares the library's parsed tokenizer (a tenth of a CPU-second and
# 18 MB for a 50,000-id vocabulary) and its byte pieces (as much again, 10 MB). The least recently used past this
# many are let go (a proxy keeps each served model's own).
_KEPT_FILES = 4


def _byte_chars() -> dict[int, int]:
    """Byte-level BPE's alphabet (GPT-2's): the character that stands for each byte in a vocabulary string, as
    ``str.translate``'s table to the byte's own code point; every other code point below 256 maps past latin-1, so
    a string holding one fails to encode (the library's decoder keeps such a token's UTF-8 bytes instead)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)}
    table = {code: code if code in printable else 0x110000 - 1 for code in range(256)}  # U+10FFFF: not latin-1
    shifted = [byte for byte in range(256) if byte not in printable]
    table.update({256 + n: byte for n, byte in enumerate(shifted)})
    return table


_BYTE_CHARS = _byte_chars()


class Tokenizer:
    """A model directory's tokenizer, its chat template and the end-of-sequence ids it implies."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self._file = _read((model_dir / "tokenizer.json").read_bytes())
        self.backend = self._file.backend
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special_tokens = {name: _token_text(config[name]) for name in _SPECIAL_TOKEN_NAMES
                               if config.get(name) is not None}
        eos = self.special_tokens.get("eos_token")
        eos_id = self.backend.token_to_id(eos) if eos is not None else None
        self.eos_token_ids: set[int] = _eos_token_ids(eos_id, model_dir)
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)  # every id it can produce
        self.chat_template = _chat_template(model_dir, config)
        self._template: jinja2.Template | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No clean-up of spaces before punctuation: it would make a window's
        # decode differ from the same tokens' decode inside the full text.
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_piece(self, token_id: int) -> str | None:
        """The vocabulary string of one token (byte-level BPE shows bytes as printable characters)."""
        return self.backend.id_to_token(token_id)

    def byte_pieces(self, skip_special_tokens: bool) -> list[bytes] | None:
        """Each token id's bytes in decoded text (b"" for a special token skipped), when the decoder is byte-level
        BPE's alone: then an output's text is its tokens' bytes, joined and read as UTF-8. None for any other
        decoder. Built on first use (a tenth of a second for 50,000 ids) and kept for the process, shared by every
        ``Tokenizer`` of the same tokenizer.json: the list is read, never changed."""
        pieces, key = self._file.byte_pieces, bool(skip_special_tokens)
        if key not in pieces:
            pieces[key] = _byte_pieces(self.backend, key)
        return pieces[key]

    def ordinary_token_ids(self) -> list[int]:
        """Every id but the added (special or control) tokens: what random prompts are drawn from."""
        added = set(self.backend.get_added_tokens_decoder())
        return [t for t in range(self.vocab_size) if t not in added]

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> str:
        """The chat template's text for ``messages``, as transformers' ``apply_chat_template`` renders it.

        ``template_kwargs``: more variables for the template (``enable_thinking``, say).
        """
        if not self.chat_template:
            raise ValueError(
                "the tokenizer has no chat template (chat_template in tokenizer_config.json "
                "or chat_template.jinja); send a plain prompt instead of chat messages"
            )
        if self._template is None:
            self._template = _environment().from_string(self.chat_template)
        # As transformers: keys holding None are dropped (templates test for presence), reasoning gets its aliases.
        chat = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
        return self._template.render(**{**self.special_tokens, **(template_kwargs or {})}, messages=chat,
                                     tools=tools, documents=None, add_generation_prompt=add_generation_prompt)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> list[int]:
        """The token ids of the rendered chat; the template writes its own special tokens."""
        text = self.render_chat(messages, tools, add_generation_prompt, template_kwargs)
        return self.encode(text, add_special_tokens=False)


def _token_text(value) -> str:
    """A special token as tokenizer_config.json holds it: a string, or an AddedToken's map."""
    return value["content"] if isinstance(value, dict) else str(value)


def _chat_template(model_dir: Path, config: dict) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one serves chat
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` for templates, refusing underscore attributes (no reach into CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers marks assistant spans with it)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, namespace=_Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


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


class _TokenizerFile:
    """One tokenizer.json as this process has read it: the library's tokenizer (its methods read, never change it)
    and the byte pieces built from it so far, by skip_special_tokens."""

    def __init__(self, backend: _Backend) -> None:
        self.backend = backend
        self.byte_pieces: dict[bool, list[bytes] | None] = {}


_FILES: OrderedDict[str, _TokenizerFile] = OrderedDict()
_FILES_LOCK = threading.Lock()


def _read(data: bytes) -> _TokenizerFile:
    """The tokenizer of a tokenizer.json's bytes, parsed once a process while its digest is among the last
    ``_KEPT_FILES`` read."""
    digest = hashlib.sha256(data).hexdigest()
    with _FILES_LOCK:  # the cache is the process's, whichever thread builds a tokenizer
        known = _FILES.get(digest)
        if known is not None:
            _FILES.move_to_end(digest)
            return known
        _FILES[digest] = read = _TokenizerFile(_Backend.from_str(data.decode("utf-8")))
        while len(_FILES) > _KEPT_FILES:
            _FILES.popitem(last=False)
        return read


def _byte_pieces(backend: _Backend, skip_special_tokens: bool) -> list[bytes] | None:
    """``Tokenizer.byte_pieces``, checked against the library's own decode of every id alone: a table that differs
    in any is not used."""
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    # Some 200,000 short-lived objects, none in a cycle: the collector's passes over a worker's heap while they are
    # made would cost as much again as making them.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _checked_byte_pieces(backend, skip_special_tokens)
    finally:
        if collecting:
            gc.enable()


def _checked_byte_pieces(backend: _Backend, skip_special_tokens: bool) -> list[bytes] | None:
    added = backend.get_added_tokens_decoder()
    size = backend.get_vocab_size(with_added_tokens=True)
    pieces = []
    for token_id in range(size):
        piece = backend.id_to_token(token_id)
        if piece is None:
            pieces.append(b"")
        elif token_id in added:
            pieces.append(b"" if skip_special_tokens and added[token_id].special else piece.encode())
        else:
            try:
                pieces.append(piece.translate(_BYTE_CHARS).encode("latin-1"))
            except UnicodeEncodeError:  # not byte-level characters: the library keeps the string's own bytes
                pieces.append(piece.encode())
    decoded = backend.decode_batch([[token_id] for token_id in range(size)], skip_special_tokens=skip_special_tokens)
    wrong = next((t for t in range(size) if decoded[t] != pieces[t].decode("utf-8", "replace")), None)
    if wrong is not None:
        log.warning("token %d decodes to %r, not to its byte-level piece %r: streamed text re-decodes windows of "
                    "tokens instead", wrong, decoded[wrong], pieces[wrong])
        return None
    return pieces


def detokenizer(tokenizer: Tokenizer, context_ids: Sequence[int],
                skip_special_tokens: bool) -> ByteLevelDetokenizer | IncrementalDetokenizer:
    """The detokenizer for one output sequence: by its tokens' bytes where the tokenizer is byte-level BPE, else
    by windows of tokens decoded again."""
    pieces = tokenizer.byte_pieces(skip_special_tokens)
    if pieces is not None:
        return ByteLevelDetokenizer(pieces)
    return IncrementalDetokenizer(tokenizer, context_ids, skip_special_tokens)


class ByteLevelDetokenizer:
    """Stable text deltas for a byte-level BPE tokenizer's output: each token's bytes (``Tokenizer.byte_pieces``)
    through an incremental UTF-8 decoder, which holds a character's first bytes back until the rest come (and
    replaces what no later byte could complete, as the library's decode does). The text is what
    ``Tokenizer.decode`` gives for the output's ids, built without decoding any token twice: a lookup and a few
    bytes per token, where a window's two decodes cost microseconds."""

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = pieces
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_ids: Sequence[int]) -> str:
        pieces, size = self._pieces, len(self._pieces)
        if len(token_ids) == 1:
            token_id = token_ids[0]
            return self._utf8.decode(pieces[token_id] if token_id < size else b"")
        return self._utf8.decode(b"".join([pieces[t] if t < size else b"" for t in token_ids]))

    def flush(self) -> str:
        """Whatever is held back: an unfinished character's bytes, as U+FFFD."""
        return self._utf8.decode(b"", True)


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


def joined(pieces: list[str]) -> str:
    """The text of ``pieces`` (a string built a piece at a time, joined only when read), left as one piece."""
    if len(pieces) > 1:
        pieces[:] = ["".join(pieces)]
    return pieces[0] if pieces else ""


class TextState:
    """One output sequence's text: what the output processor calls per step."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._detokenizer = detokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._stops = StopChecker(params.stop, params.include_stop_str_in_output)
        # The token that ends a sequence adds no text (vLLM), unless the
        # request wants its stop in the output.
        ending_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else tokenizer.eos_token_ids)
        self._silent_ids = set() if params.include_stop_str_in_output else ending_ids
        self._stopping = bool(params.stop)  # without stop strings the checker is passed by (it would hold nothing)
        self._pieces: list[str] = []  # the text released so far, in the pieces released (joined when read)
        self.text_length = 0  # of ``text``
        self.num_tokens = 0  # output tokens consumed; none after a stop string
        self.stop_string: str | None = None
        self.flushed = False
        self._untaken = ""

    @property
    def text(self) -> str:
        """All text released so far."""
        return joined(self._pieces)

    def update(self, new_token_ids: Sequence[int]) -> tuple[str, str | None]:
        """Consume new output tokens; (text delta, stop string matched now or None).

        Tokens are taken one at a time so that a stop string stops the
        sequence at the token that completed it; later ones are not consumed.
        """
        if self.stop_string is not None or self.flushed:
            return "", None
        if not self._stopping:  # the common case, one step's token: no stop string to look for
            silent = self._silent_ids
            self.num_tokens += len(new_token_ids)
            spoken = [t for t in new_token_ids if t not in silent] if silent else new_token_ids
            add = self._detokenizer.add
            return self._release(add(spoken) if len(spoken) == 1 else "".join(add([t]) for t in spoken)), None
        released, matched = [], None
        for token_id in new_token_ids:
            if self.stop_string is not None:
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
        if text:
            self._pieces.append(text)
            self.text_length += len(text)
            self._untaken += text
        return text
