"""tessera generate: run the offline engine on prompts, or chat with it.

Prompts come from --prompt (repeatable). Without one, a chat starts when
stdin is a terminal; otherwise every non-empty stdin line is a prompt. A
single prompt streams its completion as it is generated; several run as one
batch and print in prompt order, separated by blank lines. The chat keeps
the conversation, so each turn sees the earlier ones; in it, /exit or end of
input (Ctrl-D) leaves and /reset forgets the conversation.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from common.cli.options import add_model_options, positive_int
from common.storage.model_store import resolve_model
from common.protocol.sampling_params import SamplingParams

CHAT_HELP = "/exit or Ctrl-D leaves, /reset forgets the conversation"


def add_generate_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text offline, one-shot or as an interactive chat",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--prompt", action="append", metavar="TEXT", help="a prompt; repeat the flag for a batch"
    )
    add_model_options(parser, with_model=True)
    # The sampling defaults follow the SmolLM2 model card's recommendation.
    parser.add_argument("--max-tokens", type=positive_int, default=256, help="default: 256")
    parser.add_argument("--temperature", type=float, default=0.2, help="0 is greedy (default: 0.2)")
    parser.add_argument("--top-p", type=float, default=0.9, help="default: 0.9")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables it (default: 0)")
    parser.add_argument("--seed", type=int, help="makes sampling repeatable")
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap prompts in the model's chat template (default: on)",
    )
    parser.add_argument("--threads", type=positive_int, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--deterministic", action="store_true",
                        help="batch-invariant numerics (engine.deterministic) with any weights: the same tokens a "
                        "cluster in this mode gives for the same prompt, whatever the batch (default: auto, on for "
                        "bfloat16 weights where it costs little, as a worker's engine.deterministic)")
    parser.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    # Built before the model loads, so a bad flag fails at once.
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    prompts = args.prompt
    interactive = prompts is None and sys.stdin.isatty()
    if prompts is None and not interactive:
        prompts = [line.strip() for line in sys.stdin if line.strip()]
        if not prompts:
            raise ValueError("no prompts: give --prompt TEXT, or prompt lines on stdin")
    model_dir = resolve_model(args.model, args.dtype, args.cache_dir)
    if interactive:
        _chat(_load_engine(args, model_dir, None), params, args.chat)
        return 0
    # Imported here: torch and the model code take seconds to load, and `tessera --help` should not wait for them.
    from common.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir)
    inputs = [_as_input(tokenizer, [{"role": "user", "content": p}], args.chat) for p in prompts]
    engine = _load_engine(args, model_dir, [len(tokenizer.encode(i) if isinstance(i, str) else i) + args.max_tokens
                                            for i in inputs])
    if len(inputs) == 1:
        engine.add_request("prompt-0", inputs[0], params)
        _print_until_done(engine)
        return 0
    outputs = engine.generate(inputs, params)
    print("\n\n".join(out.outputs[0].text for out in outputs))
    return 0


def _load_engine(args: argparse.Namespace, model_dir: Path, tokens: list[int] | None):
    """The offline engine, its KV pool sized to the work (``ModelRunner``'s ``kv_tokens``): ``tokens`` for each
    prompt (its own and --max-tokens), else (the chat) one conversation of the model's whole context; at most what
    engine.kv_cache_memory_bytes' default holds, past which the batch queues. A one-shot prompt maps a few MiB, not
    2 GiB (faulted in at load, which a VM whose host takes back free memory makes slow: engine.cpu.huge_pages)."""
    from common.config.base import EngineConfig
    from common.engine.llm_engine import LLMEngine

    config = EngineConfig(model=str(model_dir), dtype=args.dtype, num_threads=args.threads,
                          deterministic=True if args.deterministic else "auto")
    return LLMEngine(config, kv_tokens=tokens if tokens is not None else [sys.maxsize])  # the chat: the context


def _as_input(tokenizer, messages: list[dict], chat: bool) -> str | list[int]:
    """The chat template's token ids for ``messages``, or the last message's raw text without it."""
    return tokenizer.apply_chat_template(messages) if chat else messages[-1]["content"]


def _print_until_done(engine) -> str:
    """Print the one running request's completion as it arrives; return all of it."""
    text = ""
    while engine.has_unfinished():
        for out in engine.step():
            completion = out.outputs[0]
            sys.stdout.write(completion.text_delta)
            sys.stdout.flush()
            text = completion.text
    sys.stdout.write("\n")
    return text


def _chat(engine, params: SamplingParams, use_template: bool) -> None:
    print(f"Chatting with {engine.model_dir.name}: {CHAT_HELP}.", file=sys.stderr)
    history: list[dict] = []
    for turn in itertools.count():
        try:
            line = input("> ").strip()
        except EOFError:
            print()
            return
        if line == "/exit":
            return
        if line == "/reset":
            history.clear()
            continue
        if not line:
            continue
        # Without the template each line stands alone, so history stays empty.
        messages = [*history, {"role": "user", "content": line}]
        try:
            engine.add_request(f"chat-{turn}", _as_input(engine.tokenizer, messages, use_template), params)
        except ValueError as error:
            # Typically the conversation outgrew the context; the chat goes on.
            print(f"tessera: error: {error} ({CHAT_HELP})", file=sys.stderr)
            continue
        reply = _print_until_done(engine)
        if use_template:
            history = [*messages, {"role": "assistant", "content": reply}]
        print()
