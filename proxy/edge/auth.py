"""Who sent a generation request: the tenant behind its API key, or the configured default.

- ``auth_enabled``: the request must carry ``Authorization: Bearer <key>``
  whose sha256 belongs to a configured tenant. A missing header, another
  scheme, or an unknown key is a 401 in OpenAI's error shape
  (``invalid_api_key``), checked before the body is read.
- Auth off: the default tenant, unless ``tenant_from_user_field`` is set and
  the body's ``user`` names a configured tenant.

Only the generation endpoints are guarded; /v1/models, /tokenize, health
and metrics stay open (they run nothing on the workers). The settings are
the ``TenantRegistry``'s, not the start-up config's: a reload changes them.
"""
from __future__ import annotations

from proxy.core.errors import ApiError
from proxy.tenancy.tenants import Tenant, TenantRegistry

SCHEME = "bearer"


def tenant_from_header(tenants: TenantRegistry, authorization: str | None) -> Tenant | None:
    """The key's tenant with auth on (ApiError 401 otherwise); None with auth off (decided by the body)."""
    if not tenants.auth_enabled:
        return None
    if not authorization:
        raise _unauthorized("no API key provided: send 'Authorization: Bearer <key>'")
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != SCHEME or not key:
        raise _unauthorized("the Authorization header must be 'Bearer <key>'")
    tenant = tenants.by_key(key)
    if tenant is None:
        raise _unauthorized(f"incorrect API key provided: {_redacted(key)}")
    return tenant


def tenant_from_body(tenants: TenantRegistry, user: str | None) -> Tenant:
    """With auth off: the tenant named by ``user`` when so configured, else the default tenant."""
    if tenants.from_user_field and user:
        named = tenants.get(user)
        if named is not None:
            return named
    return tenants.default


def _redacted(key: str) -> str:
    return f"{key[:3]}...{key[-4:]}" if len(key) > 10 else "***"


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key")
