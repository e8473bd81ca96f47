"""API keys: what a new one looks like, and the sha256 the config keeps of it (``api_key_sha256``), never the key."""
from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "sk-tessera-"


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_key() -> str:
    """A random key, with its prefix."""
    return KEY_PREFIX + secrets.token_urlsafe(24)
