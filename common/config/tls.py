"""Checking a proxy config's TLS files at load time, so that the error names the config field."""
from __future__ import annotations

import ssl

from common.config.base import ConfigError


def check_tls_files(config) -> None:
    """Open the TLS certificate, key and CA files the way the HTTPS listener will."""
    if not config.security.tls_cert_file:
        return
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(config.security.tls_cert_file, config.security.tls_key_file)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"config fields 'security.tls_cert_file' = {config.security.tls_cert_file!r} and "
                          f"'security.tls_key_file' = {config.security.tls_key_file!r} are not a matching PEM "
                          f"certificate and key: {exc}") from None
    if config.security.tls_ca_file:
        try:
            context.load_verify_locations(config.security.tls_ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"config field 'security.tls_ca_file' = {config.security.tls_ca_file!r} is not a PEM "
                              f"CA bundle: {exc}") from None
