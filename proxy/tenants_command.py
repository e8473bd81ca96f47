"""``tessera api-keys``: the API keys that clients send, stored by the proxy only as their sha256 (a tenant's
``api_key_sha256`` in the proxy config), so that its config holds no usable key. The ZeroMQ control plane's
keys are ``tessera curve-keys``.

    tessera api-keys generate                     # a new random key, and its hash, tab-separated
    printf '%s\\n' "$KEY" | tessera api-keys hash   # the hash of each key on stdin, one per line

A key to hash is read from stdin unless given as an argument, which keeps it out of shell history. The command
was ``tessera tenants hash-key``; the entry point keeps its function's name, so that an older tree run under
this install's entry points (``bench.proxy_cost --baseline``) still finds it.
"""
from __future__ import annotations

import argparse
import sys

from proxy.tenancy.api_keys import hash_key, new_key


def add_tenants_command(subparsers) -> None:
    keys = subparsers.add_parser(
        "api-keys", help="make client API keys and the sha256 a tenant's api_key_sha256 holds", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = keys.add_subparsers(dest="action", metavar="ACTION", required=True)
    generate = actions.add_parser("generate", help="make a new random key; print it and its hash, tab-separated")
    generate.set_defaults(handler=_generate)
    hashing = actions.add_parser("hash", help="print the sha256 of API keys (from stdin, or the arguments)",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hashing.add_argument("keys", nargs="*", metavar="KEY", help="keys to hash (default: one per line on stdin)")
    hashing.set_defaults(handler=_hash_keys)


def _generate(args: argparse.Namespace) -> int:
    key = new_key()
    print(f"{key}\t{hash_key(key)}")
    return 0


def _hash_keys(args: argparse.Namespace) -> int:
    keys = args.keys or [line.strip() for line in sys.stdin if line.strip()]
    if not keys:
        raise ValueError("tessera api-keys hash: no key given (pass it as an argument or on stdin)")
    for key in keys:
        print(hash_key(key))
    return 0
