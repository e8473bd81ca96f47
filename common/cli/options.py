"""Command-line options that several ``tessera`` subcommands share."""
from __future__ import annotations

import argparse
import sys

from common.runtime import telemetry
from common.storage.model_store import DTYPES, EMBEDDED_NAMES, default_cache_root, fastest_dtype

# The dtype of every command that serves or prepares a model, unless --dtype says otherwise.
DEFAULT_DTYPE = "float32"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 (got {text})")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number above 0 (got {text})")
    return value


def dtype_option(text: str) -> str:
    """``--dtype``: a dtype, or ``auto``, which picks the fastest this CPU runs and says which and why."""
    if text == "auto":
        dtype, why = fastest_dtype()
        print(f"tessera: --dtype auto: {dtype}: {why}", file=sys.stderr)
        return dtype
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"one of {', '.join((*DTYPES, 'auto'))} (got {text!r})")
    return text


def add_dtype_option(parser: argparse.ArgumentParser, what: str = "weight and compute dtype",
                     default: str = DEFAULT_DTYPE) -> None:
    """``--dtype``, the same in every command that loads a model. Every command that serves or prepares one
    defaults to ``DEFAULT_DTYPE``, as the workers' ``engine.dtype`` does, so that ``tessera model prepare`` makes
    the model the others load; ``auto`` is chosen by name (``make run`` does)."""
    parser.add_argument(
        "--dtype", type=dtype_option, default=default, metavar="{float32,bfloat16,auto}",
        help=f"{what}; auto: bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX) or on an AVX2 CPU "
        "without AVX-512 (beside oneDNN's float32 copy of the weights), else float32, "
        f"with a line saying which (default: {default})")


def add_model_options(parser: argparse.ArgumentParser, *, with_model: bool) -> None:
    """Add --dtype and --cache-dir, and --model when the command takes any model."""
    if with_model:
        parser.add_argument(
            "--model",
            default="embedded",
            help="a registered model as NAME@VERSION, or NAME for its promoted version (see `tessera model "
            f"list`), a Hugging Face model directory, or one of {', '.join(EMBEDDED_NAMES)} for the embedded "
            "SmolLM2-135M-Instruct (default: embedded)",
        )
    add_dtype_option(parser)
    parser.add_argument(
        "--cache-dir",
        help="where prepared models are kept (default: $TESSERA_CACHE_DIR, else ~/.cache/tessera; "
        f"now {default_cache_root()})",
    )


def add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (see configs/)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="[ROLE:]KEY=VALUE",
        help="override a config field, e.g. --set engine.dtype=bfloat16 (repeatable); a ROLE: prefix (proxy, "
        "prefill, decode, both) keeps it to that role's processes, so one list of overrides serves every role",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    parser.add_argument("--log-format", default="text", choices=telemetry.LOG_FORMATS,
                        help="text lines, or one JSON object per line with request_id and tenant (default: text)")


class RenamedOption(argparse.Action):
    """An option's former name, hidden from the help: using it fails with one line naming the new one, so that a
    script or unit written for the old name says what to change instead of "unrecognized arguments"."""

    def __init__(self, option_strings: list[str], dest: str, new_name: str, **kwargs) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs="?", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)
        self.new_name = new_name

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.exit(2, f"{parser.prog}: {option_string} is now {self.new_name}\n")


def add_renamed_option(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    parser.add_argument(old, action=RenamedOption, new_name=new)


def configure_logging(level: str, fmt: str = "text", **process_fields: str) -> None:
    """``process_fields`` (role, worker_id) go on every JSON line."""
    telemetry.install(level, fmt, **process_fields)
