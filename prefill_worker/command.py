"""``tessera prefill``: run a prefill worker from a config file."""
from __future__ import annotations

from common.cli.worker_command import add_worker_parser


def _make_handler(config):
    from kv_transfer.factory import backend_for
    from prefill_worker.worker import PrefillHandler

    return PrefillHandler(config, lambda: backend_for(config))


def _adopt(old, config):
    """A prefill handler that takes over a worker switching to prefill (common/runtime/role_switch.py)."""
    from prefill_worker.worker import PrefillHandler

    return PrefillHandler.adopt(old, config)


def add_command(subparsers) -> None:
    add_worker_parser(subparsers, "prefill",
                      "run a prefill worker: computes prompts and lends their KV pages", _make_handler, _adopt)
