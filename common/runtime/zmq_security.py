"""ZeroMQ CURVE on the control and KV sockets: key loading, socket setup, the ZAP authenticator; and the
eventfd the threads that own those sockets poll beside them to be woken (``Waker``).

Every ZeroMQ socket that crosses hosts goes through here:

- proxy ROUTER (``proxy.cluster.worker_link``): a CURVE server; its asyncio
  authenticator accepts only the public keys in ``curve_authorized_keys_dir``.
- worker DEALER to the proxy (``common.runtime.worker_runtime``): a CURVE client that
  also pins the proxy's public key, so it cannot talk to an impostor.
- zmq KV transfer (``kv_transfer.zmq_backend``): each worker's ROUTER is a CURVE
  server accepting its peers' keys; each DEALER to a peer pins the public key
  the peer published in its transfer metadata, which reached this worker only
  over the authenticated control channel (Register -> proxy -> Peers).

Keys are zmq certificate files (``tessera curve-keys generate``): ``NAME.key`` holds
the public key, ``NAME.key_secret`` both. Loading errors name the config field.
Life cycle of an authenticator: ``start_authenticator`` once per context,
before the server socket binds; ``stop()`` before the context is terminated.
With no keys configured, none of this runs and the sockets are plaintext.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.auth.thread import ThreadAuthenticator

from common.config.base import ConfigError

log = logging.getLogger("tessera.security")


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # z85
    secret: bytes  # z85


@dataclass(frozen=True)
class CurveServer:
    """What a CURVE server socket needs: its own keys and the peers it lets in."""

    keys: KeyPair
    authorized_keys_dir: Path


@dataclass(frozen=True)
class WorkerCurve:
    """A worker's keys: its own pair, the proxy's public key, the peers allowed to pull KV from it."""

    keys: KeyPair
    proxy_public: bytes
    authorized_keys_dir: Path | None

    def kv_server(self) -> CurveServer:
        if self.authorized_keys_dir is None:
            raise ConfigError("config field 'curve_authorized_keys_dir' is empty: the zmq KV server needs its "
                              "peers' public keys")
        return CurveServer(self.keys, self.authorized_keys_dir)


def require_curve() -> None:
    if not zmq.has("curve"):
        raise ConfigError("CURVE keys are configured but this libzmq was built without CURVE support")


def load_key_pair(path: str, field: str) -> KeyPair:
    public, secret = _load(path, field)
    if secret is None:
        raise ConfigError(f"config field {field!r} = {path!r} holds no secret key: give the NAME.key_secret "
                          "file that `tessera curve-keys generate` wrote")
    return KeyPair(public, secret)


def load_public_key(path: str, field: str) -> bytes:
    return _load(path, field)[0]


def _load(path: str, field: str) -> tuple[bytes, bytes | None]:
    if not Path(path).is_file():
        raise ConfigError(f"config field {field!r} = {path!r}: no such file")
    try:
        return zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"config field {field!r} = {path!r} is not a zmq certificate file: {exc}") from None


def load_authorized_keys(directory: str, field: str) -> set[bytes]:
    """The z85 public keys of every ``*.key`` file in ``directory``; at least one."""
    if not Path(directory).is_dir():
        raise ConfigError(f"config field {field!r} = {directory!r}: no such directory")
    try:
        keys = set(zmq.auth.load_certificates(directory))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"config field {field!r} = {directory!r}: a key file cannot be read: {exc}") from None
    if not keys:
        raise ConfigError(f"config field {field!r} = {directory!r} holds no public key (*.key) file: "
                          "no peer could connect")
    return keys


def proxy_curve(config) -> CurveServer | None:
    """The proxy's CURVE settings from a ProxyConfig; None when CURVE is off."""
    if not config.security.curve_secret_key_file:
        return None
    require_curve()
    load_authorized_keys(config.security.curve_authorized_keys_dir, "security.curve_authorized_keys_dir")
    return CurveServer(load_key_pair(config.security.curve_secret_key_file, "security.curve_secret_key_file"),
                       Path(config.security.curve_authorized_keys_dir))


def worker_curve(config) -> WorkerCurve | None:
    """A worker's CURVE settings from a WorkerConfig; None when CURVE is off."""
    if not config.security.curve_secret_key_file:
        return None
    require_curve()
    peers = None
    if config.security.curve_authorized_keys_dir:
        load_authorized_keys(config.security.curve_authorized_keys_dir, "security.curve_authorized_keys_dir")
        peers = Path(config.security.curve_authorized_keys_dir)
    return WorkerCurve(load_key_pair(config.security.curve_secret_key_file, "security.curve_secret_key_file"),
                       load_public_key(config.security.curve_proxy_public_key_file, "security.curve_proxy_public_key_file"), peers)


def apply_curve_server(sock: zmq.Socket, keys: KeyPair) -> None:
    """Make ``sock`` a CURVE server; call before bind."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def apply_curve_client(sock: zmq.Socket, keys: KeyPair, server_public: bytes) -> None:
    """Make ``sock`` a CURVE client that only talks to the holder of ``server_public``; call before connect."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_public


class _KeyRing:
    """ZAP credentials provider: a fixed set of public keys, refusals logged as warnings."""

    def __init__(self, keys: set[bytes], what: str) -> None:
        self._keys = keys
        self._what = what

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._keys:
            return True
        log.warning("%s refused a CURVE client whose public key %s is not in its authorized keys",
                    self._what, key.decode(errors="replace"))
        return False


def start_authenticator(context: zmq.Context, server: CurveServer, what: str):
    """Start the ZAP handler of ``context`` (asyncio or threaded, to match it); returns it, to ``stop()``."""
    keys = load_authorized_keys(str(server.authorized_keys_dir), "security.curve_authorized_keys_dir")
    auth = start_key_authenticator(context, keys, what)
    log.info("%s: CURVE on, %d authorized public key(s) from %s", what, len(keys), server.authorized_keys_dir)
    return auth


def start_key_authenticator(context: zmq.Context, keys: set[bytes], what: str):
    """Start the ZAP handler of ``context`` letting in the CURVE clients of ``keys`` alone; returns it."""
    if isinstance(context, zmq.asyncio.Context):
        auth = AsyncioAuthenticator(context, log=log.getChild("zap"))
    else:
        auth = ThreadAuthenticator(context, log=log.getChild("zap"))
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_KeyRing(keys, what))
    return auth


class Waker:
    """An eventfd registered in a thread's ``zmq.Poller`` beside its sockets: ``wake()`` from any thread makes
    the poll return at once, so work queued for a socket-owning thread does not wait out the poll timeout.

    An eventfd is one counter: writes never block (the count cannot realistically overflow), and the polling
    thread's one ``drain()`` after the poll saw ``fd`` readable clears every pending wake-up. Both are the C
    calls themselves, bound once, so a wake-up runs no Python frame of its own.
    """

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.wake = functools.partial(os.eventfd_write, self.fd, 1)
        self.drain = functools.partial(os.eventfd_read, self.fd)

    def close(self) -> None:
        os.close(self.fd)
