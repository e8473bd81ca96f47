"""``tessera decode`` and ``tessera both``: run a decode (or aggregated) worker from a config file."""
from __future__ import annotations

from common.cli.worker_command import add_worker_parser


def _make_handler(config):
    from decode_worker.worker import DecodeHandler
    from kv_transfer.factory import backend_for

    return DecodeHandler(config, lambda: backend_for(config), role=config.role)


def _adopt(old, config):
    """A decode (or aggregated) handler that takes over a worker switching to that role
    (common/runtime/role_switch.py)."""
    from decode_worker.worker import DecodeHandler

    return DecodeHandler.adopt(old, config)


def add_decode_command(subparsers) -> None:
    add_worker_parser(subparsers, "decode",
                      "run a decode worker: pulls KV pages and generates (prefills short prompts itself)",
                      _make_handler, _adopt)


def add_both_command(subparsers) -> None:
    add_worker_parser(subparsers, "both", "run an aggregated worker that prefills and decodes its own requests",
                      _make_handler, _adopt)
