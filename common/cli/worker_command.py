"""What every worker role's command does: load the config, build the handler, serve until told to stop.

Each worker role package registers its own subcommand (``prefill_worker.command``,
``decode_worker.command``) and hands ``run_worker`` a function that builds its
handler, and one that builds it around a running worker's handler (a role switch,
``common/runtime/role_switch.py``); ``ADOPTERS`` gathers the latter from every role
as the ``tessera`` command adds the roles' subcommands. The runtime knows no role.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

from common.cli.options import add_config_options, configure_logging
from common.config.roles import WorkerConfig, load_config, parse_overrides


# role -> how its handler takes over a running worker's (``common.runtime.worker_contracts.Adopt``), one entry per
# role whose command was added: common/cli/main.py adds every role's before it runs one.
ADOPTERS: dict[str, Callable] = {}


def add_worker_parser(subparsers, role: str, text: str, make_handler: Callable[[WorkerConfig], object],
                      adopt: Callable) -> None:
    ADOPTERS[role] = adopt
    parser = subparsers.add_parser(role, help=text, description=text + ".")
    add_config_options(parser)
    parser.set_defaults(handler=lambda args: run_worker(args, make_handler), role=role)


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The settings a worker command's parsed ``args`` give it."""
    overrides = parse_overrides(args.overrides, args.role)
    overrides["role"] = args.role
    return load_config(WorkerConfig, args.config, overrides)


def run_worker(args: argparse.Namespace, make_handler: Callable[[WorkerConfig], object]) -> int:
    config = worker_config(args)
    configure_logging(args.log_level, args.log_format, role=config.role, worker_id=config.worker_id)
    from common.engine.malloc import use_configured_malloc

    # Before torch: a worker that should run on jemalloc and does not starts again with it preloaded (same pid).
    use_configured_malloc(config.engine.cpu.malloc)
    import torch

    # Subnormal floats are flushed to zero in a worker process (as inference engines do): their slow path
    # costs steps, and the model's numbers do not depend on them. Set here, for this process alone.
    torch.set_flush_denormal(True)
    if config.engine.num_threads:
        torch.set_num_threads(config.engine.num_threads)
    from common.runtime.worker_runtime import serve

    handler = make_handler(config)
    try:
        serve(config, handler, ADOPTERS)
    finally:
        handler.close()  # after a role switch: the handler it handed over to (WorkerBase.close)
    return 0
