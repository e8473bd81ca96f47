"""Log lines as text or as one JSON object per line, with the request they are about.

``install(level, log_format, **process_fields)`` configures the root logger
once per process (``--log-format json|text``). The process fields (role,
worker id) go on every JSON line.

A line is "about a request" when it is logged inside ``request_scope(id,
tenant)`` (a contextvar, so it follows asyncio tasks and stays put across
threads), or when the call passes ``extra={"request_id": ..., "tenant":
...}`` itself, which wins. JSON lines then carry ``request_id`` and
``tenant``; text lines append ``[request_id tenant]``.

Prompts never reach the log through this module; callers log prompt
tokens only when the ``log_prompts`` config field is set.
"""
from __future__ import annotations

import contextvars
import json
import logging
from contextlib import contextmanager
from datetime import datetime, timezone

LOG_FORMATS = ("text", "json")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d]%(request_tag)s %(message)s"

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("tessera_request_id", default=None)
_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar("tessera_tenant", default=None)


@contextmanager
def request_scope(request_id: str | None, tenant: str | None = None):
    """Lines logged inside are about ``request_id`` (nothing changes when it is None)."""
    if request_id is None:
        yield
        return
    tokens = (_request_id.set(request_id), _tenant.set(tenant))
    try:
        yield
    finally:
        _tenant.reset(tokens[1])
        _request_id.reset(tokens[0])


def bind_request(request_id: str, tenant: str | None = None) -> None:
    """Mark the rest of the current asyncio task (an HTTP handler) as about ``request_id``."""
    _request_id.set(request_id)
    _tenant.set(tenant)


class _RequestFilter(logging.Filter):
    """Fills ``request_id``/``tenant`` from the scope unless the call gave them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = _request_id.get()
        if getattr(record, "tenant", None) is None:
            record.tenant = _tenant.get()
        parts = [p for p in (record.request_id, record.tenant) if p]
        record.request_tag = f" [{' '.join(parts)}]" if parts else ""
        return True


class JsonFormatter(logging.Formatter):
    def __init__(self, **process_fields: str) -> None:
        super().__init__()
        self.process_fields = {k: v for k, v in process_fields.items() if v}

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
            **self.process_fields,
        }
        for name in ("request_id", "tenant"):
            value = getattr(record, name, None)
            if value:
                line[name] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def make_handler(log_format: str, stream=None, **process_fields: str) -> logging.Handler:
    """A handler writing ``stream`` (default stderr) in ``log_format``, request fields filled in."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format {log_format!r} is invalid: one of {LOG_FORMATS}")
    handler = logging.StreamHandler(stream)
    handler.addFilter(_RequestFilter())
    if log_format == "json":
        handler.setFormatter(JsonFormatter(**process_fields))
    else:
        handler.setFormatter(logging.Formatter(_TEXT_FORMAT))
    return handler


def install(level: str, log_format: str = "text", **process_fields: str) -> None:
    """Configure the root logger: one handler on stderr, in the chosen format."""
    handler = make_handler(log_format, **process_fields)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
