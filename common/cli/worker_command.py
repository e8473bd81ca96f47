"""What every worker role's command does: load the config, build the handler, serve until told to stop.

Each worker role package registers its own subcommand (``prefill_worker.command``,
``decode_worker.command``) and hands ``run_worker`` a function that builds its
handler; the runtime knows no role.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

from common.cli.options import add_config_options, configure_logging
from common.config.roles import WorkerConfig, load_config, parse_overrides


def add_worker_parser(subparsers, role: str, text: str, make_handler: Callable[[WorkerConfig], object]) -> None:
    parser = subparsers.add_parser(role, help=text, description=text + ".")
    add_config_options(parser)
    parser.set_defaults(handler=lambda args: run_worker(args, make_handler), role=role)


def run_worker(args: argparse.Namespace, make_handler: Callable[[WorkerConfig], object]) -> int:
    overrides = parse_overrides(args.overrides, args.role)
    overrides["role"] = args.role
    config = load_config(WorkerConfig, args.config, overrides)
    configure_logging(args.log_level, args.log_format, role=config.role, worker_id=config.worker_id)
    import torch

    # Subnormal floats are flushed to zero in a worker process (as inference engines do): their slow path
    # costs steps, and the model's numbers do not depend on them. Set here, for this process alone.
    torch.set_flush_denormal(True)
    if config.engine.num_threads:
        torch.set_num_threads(config.engine.num_threads)
    from common.runtime.worker_runtime import serve

    handler = make_handler(config)
    try:
        serve(config, handler)
    finally:
        handler.close()
    return 0
