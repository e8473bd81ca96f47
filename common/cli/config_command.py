"""``tessera config check|docs``: validate a role's config without starting it; print the reference.

``check FILE [--role proxy|prefill|decode|both] [--set key=value ...]`` loads
the file exactly as the role would at start-up (YAML, then overrides, then
validation and path checks), then opens what it names: the CURVE key files
and the TLS certificate and key. A file with a ``role:`` key is a worker
config; any other needs ``--role``. On success it prints a summary and exits
0; on failure it prints the error, which names the field, and exits 2.

``docs`` prints docs/configuration.md and ``schema proxy|worker`` the JSON
Schema of a config file; both come from the pydantic schema that validates
the config (``common.config.base``), as ``check`` does.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from common.config.base import ConfigError, json_schema
from common.config.roles import ProxyConfig, WorkerConfig, load_config, load_yaml, parse_overrides
from common.config.tls import check_tls_files
from common.protocol.names import ROLES
from common.runtime.zmq_security import proxy_curve, worker_curve


def add_config_command(subparsers) -> None:
    config = subparsers.add_parser(
        "config", help="check a config file without starting anything, or print the config reference or schema",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = config.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check", help="validate a proxy or worker config file; exit 2 with the error if it is invalid",
        description="Validate FILE as the role would at start-up, open the key and certificate files it "
        "names, and print a summary. A file with 'role:' is a worker config; otherwise give --role.",
    )
    check.add_argument("file", metavar="FILE", help="YAML config file")
    check.add_argument("--role", choices=("proxy", *ROLES), help="which role the file configures")
    check.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="[ROLE:]KEY=VALUE",
        help="override a field as the role's own --set does (repeatable)",
    )
    check.set_defaults(handler=_check_command)
    docs = actions.add_parser("docs", help="print docs/configuration.md, generated from the config definitions")
    docs.set_defaults(handler=_docs_command)
    schema = actions.add_parser(
        "schema", help="print the JSON Schema of a proxy or worker config file (for editors' YAML validation)")
    schema.add_argument("role", choices=("proxy", "worker"), help="which file's schema")
    schema.set_defaults(handler=_schema_command)


def check_config(path: str, role: str | None, overrides: list[str]) -> ProxyConfig | WorkerConfig:
    """Load and validate like the role's start-up does, plus open its key and certificate files."""
    data = load_yaml(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    file_role = data.get("role")
    if file_role is not None and role is not None and role != file_role:
        raise ConfigError(f"{path} says role: {file_role!r} but --role is {role!r}")
    role = role or file_role
    if role is None:
        raise ConfigError(f"{path} has no 'role:' key: pass --role proxy for a proxy config, or the worker's "
                          f"role (one of {', '.join(ROLES)})")
    extra = parse_overrides(overrides, role)
    if role == "proxy":
        config = load_config(ProxyConfig, path, extra)
        proxy_curve(config)
        check_tls_files(config)
    else:
        config = load_config(WorkerConfig, path, {**extra, "role": role})
        worker_curve(config)
    return config


def summary(config: ProxyConfig | WorkerConfig, data: dict) -> list[str]:
    is_proxy = isinstance(config, ProxyConfig)
    lines = [f"role: {'proxy' if is_proxy else config.role}",
             f"fields set: {', '.join(sorted(data)) or 'none (all defaults)'}"]
    if is_proxy:
        lines.append(f"HTTP: {'https' if config.security.tls_cert_file else 'http'}://{config.host}:{config.port}"
                     + (" (client certificates required)" if config.security.tls_ca_file else ""))
        lines.append(f"workers connect to: {config.worker_bind}")
    else:
        lines.append(f"proxy: {config.proxy_address}; model {config.engine.model} ({config.engine.dtype}); "
                     f"KV transfer {config.transfer_backend}")
    if config.security.curve_secret_key_file:
        lines.append(f"CURVE: on (key {config.security.curve_secret_key_file})")
    else:
        lines.append("CURVE: off (the worker control plane is unauthenticated)")
    return lines


def _check_command(args: argparse.Namespace) -> int:
    try:
        config = check_config(args.file, args.role, args.overrides)
        data = load_yaml(Path(args.file).read_text()) or {}
    except (ConfigError, OSError, yaml.YAMLError) as exc:
        print(f"tessera config check: {args.file}: invalid: {exc}", file=sys.stderr)
        return 2
    overridden = {pair.partition("=")[0].split(".")[0] for pair in args.overrides}
    print(f"{args.file}: OK")
    for line in summary(config, {**data, **dict.fromkeys(overridden)}):
        print(f"  {line}")
    return 0


def _schema_command(args: argparse.Namespace) -> int:
    print(json.dumps(json_schema(ProxyConfig if args.role == "proxy" else WorkerConfig), indent=2))
    return 0


def _docs_command(args: argparse.Namespace) -> int:
    from common.config.docs import render

    sys.stdout.write(render())
    return 0

