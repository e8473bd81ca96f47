"""The ``tessera`` command.

Each subcommand is added by one registrar: a function that takes the
subparsers object, adds its parser, and sets ``handler`` to the function that
runs it and returns the exit status. The commands of ``common`` are listed in
``COMMANDS``; each role package (proxy, workers, bench) registers its own
under the ``tessera.commands`` entry-point group in ``pyproject.toml``, so this
module imports nothing above ``common``. Handlers import the engine only when
they run, so ``--help`` answers at once. A command that was renamed fails under
its old name with one line naming the new one (``RENAMED_COMMANDS``).
"""
from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import entry_points

from common.cli.config_command import add_config_command
from common.cli.curve_keys_command import add_curve_keys_command
from common.cli.generate_command import add_generate_command
from common.cli.model_command import add_model_command
from common.cli.status_command import add_status_command
from common.cli.up_command import add_up_command

ENTRY_POINT_GROUP = "tessera.commands"
# libgomp's threads spin this many times waiting for the next parallel region before they sleep. Its default
# (300,000) keeps a core busy about 8 ms after every engine step, which a co-located worker, the proxy and
# the client then wait for; inside a step the gaps between parallel regions are far shorter than 10,000 spins
# (docs/history/benchmarks-rounds.md, "libgomp's spin"). Set before any command imports torch, so that every
# process the ``tessera`` command starts, directly or through ``tessera up``, has it; a value in the environment
# wins.
GOMP_SPINCOUNT = "10000"


COMMANDS = (add_model_command, add_generate_command, add_up_command, add_config_command, add_curve_keys_command,
            add_status_command)
# Old command name -> what replaced it: a script or unit written for the old name learns the new one.
RENAMED_COMMANDS = {
    "keys": "`tessera curve-keys` (tessera curve-keys generate --out DIR --name NAME)",
    "tenants": "`tessera api-keys`: `tenants hash-key` is `api-keys hash`, `tenants hash-key --generate` is "
               "`api-keys generate`",
}


def registrars() -> list:
    """``COMMANDS``, then the role packages' registrars from their entry points, by name."""
    found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    if not found:
        raise RuntimeError(f"no {ENTRY_POINT_GROUP!r} entry points: tessera is not installed "
                           "(pip install -e . from the checkout)")
    return [*COMMANDS, *(ep.load() for ep in found)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera",
        description="Tessera: disaggregated prefill/decode LLM serving.",
    )
    parser.add_argument("--version", action="version", version=_version_line())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in registrars():
        register(subparsers)
    return parser


def _version_line() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from common.protocol.wire import PROTOCOL_VERSION
    try:
        release = version("tessera")
    except PackageNotFoundError:
        release = "unknown (not installed)"
    return f"tessera {release} (wire protocol {PROTOCOL_VERSION})"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in RENAMED_COMMANDS:
        print(f"tessera: `tessera {argv[0]}` is now {RENAMED_COMMANDS[argv[0]]}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as error:
        # Bad models, configs and sampling parameters all raise ValueError
        # with a message that names the culprit; a traceback adds nothing.
        print(f"tessera: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
