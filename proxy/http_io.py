"""Reading a request body under a size limit, and noticing when the client leaves.

``read_model`` refuses a body over ``max_prompt_bytes`` with 413 before
reading it whole (Content-Length first, then the running count for chunked
uploads) and parses it into a pydantic model, 422 on anything invalid.

``DisconnectWatcher`` waits on the ASGI receive channel for
``http.disconnect`` and cancels the request group when it comes: the
workers get their Abort (and ReleaseKV) the moment the client goes, whether
the response streams or not and whether or not a token is due.
"""
from __future__ import annotations

import asyncio
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from proxy.errors import ApiError, from_validation_error
from proxy.requests import RequestGroup

M = TypeVar("M", bound=BaseModel)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than max_prompt_bytes={limit}", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_model(request: Request, model: type[M], limit: int) -> M:
    body = await read_body(request, limit)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


class DisconnectWatcher:
    """Cancels ``group`` when the client disconnects; ``stop`` once the response is done."""

    def __init__(self, request: Request, group: RequestGroup) -> None:
        self.disconnected = False
        self._receive = request.receive
        self._group = group
        self._task = asyncio.create_task(self._watch(), name="client-disconnect-watch")

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                break
        self.disconnected = True
        self._group.cancel("the client disconnected")

    def stop(self) -> None:
        self._task.cancel()
