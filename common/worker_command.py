"""``tessera prefill|decode|both``: run one worker process from a config file."""
from __future__ import annotations

import argparse

from common.cli_options import add_config_options, configure_logging
from common.role_config import WorkerConfig, load_config, parse_overrides

ROLE_HELP = {
    "prefill": "run a prefill worker: computes prompts and lends their KV pages",
    "decode": "run a decode worker: pulls KV pages and generates (prefills short prompts itself)",
    "both": "run an aggregated worker that prefills and decodes its own requests",
}


def add_worker_commands(subparsers) -> None:
    for role, text in ROLE_HELP.items():
        parser = subparsers.add_parser(role, help=text, description=text + ".")
        add_config_options(parser)
        parser.set_defaults(handler=_run, role=role)


def _run(args: argparse.Namespace) -> int:
    overrides = parse_overrides(args.overrides)
    overrides["role"] = args.role
    config = load_config(WorkerConfig, args.config, overrides)
    configure_logging(args.log_level, args.log_format, role=config.role, worker_id=config.worker_id)
    if config.engine.num_threads:
        import torch

        torch.set_num_threads(config.engine.num_threads)
    from common.worker_runtime import serve

    if config.role == "prefill":
        from prefill_worker.worker import PrefillHandler

        handler = PrefillHandler(config)
    else:
        from decode_worker.worker import DecodeHandler

        handler = DecodeHandler(config, role=config.role)
    try:
        serve(config, handler)
    finally:
        handler.close()
    return 0
