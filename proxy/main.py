"""``tessera proxy``: run the OpenAI-compatible proxy in front of the workers.

One process, one event loop (uvloop): uvicorn serves the FastAPI app, and
the app's lifespan runs the ZeroMQ link and the heartbeat watchdog in the
same loop. SIGTERM or SIGINT drains first (see ``proxy.server``): /readyz
turns 503, requests in flight finish for up to the drain timeout, then the
server stops and the ZeroMQ socket is closed before its context. The HTTP
listener's TLS, connection limits and timeouts come from the config
(``proxy.edge.listener``); CURVE on the worker socket from ``common.runtime.zmq_security``.
SIGHUP, or a change of the ``--config`` file, reloads the tenant settings
(``proxy.reload``) with the same ``--set`` overrides. ``--processes N`` runs N
such processes behind one port (``proxy.supervisor``).
"""
from __future__ import annotations

import argparse
import logging
import socket

from common.cli.options import add_config_options, add_renamed_option, configure_logging, positive_int
from common.config.roles import ProxyConfig, load_config, parse_overrides


def add_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "proxy",
        help="run the OpenAI-compatible proxy the workers register with",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_options(parser)
    parser.add_argument("--processes", type=positive_int, default=1, metavar="N",
                        help="run N proxy processes behind the one HTTP port (SO_REUSEPORT); process i binds its "
                        "worker socket at worker_bind's port + i, and the workers list every one in proxy_address; "
                        "set redis_url so that they share tenant counters, rate limits and the decode slots "
                        "(proxy/supervisor.py; default: 1)")
    add_renamed_option(parser, "--workers", "--processes")
    parser.add_argument("--reuse-port", action="store_true",
                        help="listen with SO_REUSEPORT, sharing the port with other proxy processes")
    parser.set_defaults(handler=_run_command)


def _run_command(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format, role="proxy")
    overrides = parse_overrides(args.overrides, "proxy")
    config = load_config(ProxyConfig, args.config, overrides)
    if args.processes > 1:
        from proxy.supervisor import supervise
        argv = [*(["--config", args.config] if args.config else []),
                *(arg for override in args.overrides for arg in ("--set", override)),
                "--log-level", args.log_level, "--log-format", args.log_format]
        return supervise(config, argv, args.processes)
    run(config, args.config, overrides, reuse_port=args.reuse_port)
    return 0


def listening_socket(host: str, port: int, reuse_port: bool = True) -> socket.socket:
    """A socket bound to host:port; ``reuse_port``: with SO_REUSEPORT, which other processes may bind too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def run(config: ProxyConfig, config_path: str | None = None, overrides: dict | None = None,
        reuse_port: bool = False) -> None:
    """``config_path`` and ``overrides``: where ``config`` came from, which SIGHUP and the file watch read
    again (``proxy.reload``); ``reuse_port``: listen with SO_REUSEPORT (``--processes``)."""
    # Imported here so that `tessera --help` answers without loading the server stack.
    from proxy.app import create_app
    from common.config.tls import check_tls_files
    from proxy.edge.listener import listener_config
    from proxy.tenancy.metering import check_path as check_metering_path
    from proxy.reload import ConfigSource
    from proxy.server import DrainingServer

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_tls_files(config)  # uvicorn's own error would not name the config field
    if config.tenancy.metering_path:
        check_metering_path(config.tenancy.metering_path)
    app = create_app(config, source=ConfigSource(config_path, overrides or {}))
    drain_timeout_s = config.drain_timeout_s
    # log_config=None: uvicorn's lines go through the root handler, in the chosen --log-format.
    server_config = listener_config(app, config, loop="uvloop", log_level="info", log_config=None,
                                    timeout_graceful_shutdown=int(drain_timeout_s) + 1)
    sockets = None
    if reuse_port or config.http.process_port:  # else uvicorn binds host:port itself
        sockets = [listening_socket(config.host, config.port, reuse_port)]
        if config.http.process_port:
            sockets.append(listening_socket(config.host, config.http.process_port, reuse_port=False))
    services = app.state.services
    if reuse_port:  # one of several processes on the port: a restarted one's first requests wait for its workers
        services.cluster.join_grace_s = config.heartbeat_timeout_s
    DrainingServer(server_config, services.cluster, drain_timeout_s, services.streams).run(sockets=sockets)
