"""``tessera curve-keys generate``: a CURVE key pair for the proxy or one worker (the ZeroMQ control plane's keys;
a client's API keys are ``tessera api-keys``).

Writes zmq certificate files, as ``zmq.auth.create_certificates`` does:
``DIR/NAME.key`` (the public key: copy it into the authorized keys directory
of whoever must accept this process) and ``DIR/NAME.key_secret`` (both keys:
it stays on this host, readable by its owner only, mode 0600). Existing files
are never overwritten: replacing a key is a deliberate act (delete, then
generate). ``--owner USER[:GROUP]`` gives the directory and both files to the
service's user, so that a key made with sudo is readable by the unit that runs
as that user. See docs/security.md for how the files are distributed.
"""
from __future__ import annotations

import argparse
import grp
import os
import pwd
import re
import shutil
from pathlib import Path

import zmq
import zmq.auth

from common.config.base import ConfigError

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"


def add_curve_keys_command(subparsers) -> None:
    keys = subparsers.add_parser(
        "curve-keys", help="generate CURVE key pairs for the proxy and the workers' ZeroMQ sockets",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = keys.add_subparsers(dest="action", metavar="ACTION", required=True)
    generate = actions.add_parser(
        "generate", help="write NAME.key (public) and NAME.key_secret (0600) into DIR",
        description="Write a new CURVE key pair as zmq certificate files: DIR/NAME.key (public) and "
        "DIR/NAME.key_secret (secret, mode 0600). Refuses to overwrite existing files.",
    )
    generate.add_argument("--out", required=True, metavar="DIR", help="directory to write into (created 0700)")
    generate.add_argument("--name", required=True, help="key name, e.g. proxy or prefill-0 (letters, digits, ._-)")
    generate.add_argument("--owner", metavar="USER[:GROUP]", help="give DIR and both files to this user (and its "
                          "group, or GROUP): the service user that reads them, when run with sudo")
    generate.set_defaults(handler=_generate_command)


def generate_key_pair(out: str | Path, name: str, owner: str | None = None) -> tuple[Path, Path]:
    """Write the pair, owned by ``owner`` (USER[:GROUP]) when given; returns (public file, secret file)."""
    uid_gid = _owner_ids(owner) if owner else None  # before anything is written
    if not re.fullmatch(NAME_PATTERN, name):
        raise ConfigError(f"key name {name!r} is invalid: letters, digits, '.', '_' and '-', not starting "
                          "with a punctuation mark")
    if not zmq.has("curve"):
        raise ConfigError("this libzmq was built without CURVE support: no key can be used")
    out = Path(out)
    public, secret = out / f"{name}.key", out / f"{name}.key_secret"
    existing = [str(p) for p in (public, secret) if p.exists()]
    if existing:
        raise ConfigError(f"refusing to overwrite {', '.join(existing)}: delete the old pair first")
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    # The secret file is created 0600 before zmq writes into it, so it is never readable by others.
    os.close(os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    public_written, secret_written = zmq.auth.create_certificates(out, name)
    os.chmod(secret_written, 0o600)
    if uid_gid is not None:
        for path in (out, public_written, secret_written):
            try:
                shutil.chown(path, *uid_gid)
            except PermissionError:
                raise ConfigError(f"--owner {owner}: cannot give {path} to it without root (run with sudo)") from None
    return Path(public_written), Path(secret_written)


def _owner_ids(owner: str) -> tuple[int, int]:
    """USER[:GROUP] as (uid, gid); the group defaults to the user's own."""
    user, _, group = owner.partition(":")
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ConfigError(f"--owner {owner}: no user {user!r} on this host") from None
    if not group:
        return entry.pw_uid, entry.pw_gid
    try:
        return entry.pw_uid, grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"--owner {owner}: no group {group!r} on this host") from None


def _generate_command(args: argparse.Namespace) -> int:
    public, secret = generate_key_pair(args.out, args.name, args.owner)
    print(f"public key: {public}  (copy into the authorized keys directory of its peers)")
    print(f"secret key: {secret}  (mode 0600; keep it on this host)")
    return 0
