"""``tessera tenants hash-key``: the sha256 of an API key, for a tenant's ``api_key_sha256`` in the proxy config.

The proxy stores and compares only these hashes, so its config holds no usable
key. The key is read from stdin (one per line) unless given as an argument,
which keeps it out of shell history:

    printf '%s\\n' "$KEY" | tessera tenants hash-key
    tessera tenants hash-key --generate      # a new random key, and its hash
"""
from __future__ import annotations

import argparse
import sys

from proxy.tenancy.api_keys import hash_key, new_key


def add_tenants_command(subparsers) -> None:
    tenants = subparsers.add_parser(
        "tenants", help="tenant API key tools", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = tenants.add_subparsers(dest="action", metavar="ACTION", required=True)
    hashing = actions.add_parser("hash-key", help="print the sha256 of API keys (from stdin, or the arguments)",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hashing.add_argument("keys", nargs="*", metavar="KEY", help="keys to hash (default: one per line on stdin)")
    hashing.add_argument("--generate", action="store_true",
                         help="make a new random key; print it and its hash, tab-separated")
    hashing.set_defaults(handler=_hash_keys)


def _hash_keys(args: argparse.Namespace) -> int:
    if args.generate:
        key = new_key()
        print(f"{key}\t{hash_key(key)}")
        return 0
    keys = args.keys or [line.strip() for line in sys.stdin if line.strip()]
    if not keys:
        raise ValueError("tessera tenants hash-key: no key given (pass it as an argument or on stdin)")
    for key in keys:
        print(hash_key(key))
    return 0
