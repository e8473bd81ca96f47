"""One streaming request to an OpenAI-compatible server, recorded while its stream is read.

The body asks for ``max_tokens`` = the workload's output length, with
``ignore_eos`` (a vLLM/SGLang/Tessera extension; ``--no-ignore-eos`` for
servers that refuse unknown fields) so that the output has that length, and
``stream_options.include_usage`` so that the final chunk gives exact token
counts. Each request sends ``Authorization: Bearer <its tenant's key>``.

Failure kinds, one per request at most (``RequestRecord.fail``):
``http_<status>`` (answered with an error status), ``stream_error`` (an error
event inside the stream), ``incomplete`` (the stream closed before
``[DONE]``), ``empty_output`` (no generated text), ``bad_chunk`` (a chunk
that is not JSON), ``timeout`` (past ``--request-timeout``), ``connection``
(could not connect, or the connection broke); the runner adds ``deadline``
for requests cut off by ``--max-duration``.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from bench.loadgen.records import RequestRecord
from bench.loadgen.workloads import RequestSpec

ERROR_BODY_CHARS = 300


@dataclass(frozen=True)
class RequestOptions:
    base_url: str
    endpoint: str
    model: str
    temperature: float = 0.0
    ignore_eos: bool = True
    include_usage: bool = True
    headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict = field(default_factory=dict)  # merged into every request body (--extra-body)

    @property
    def chat(self) -> bool:
        return self.endpoint.endswith("/chat/completions")


def request_body(options: RequestOptions, spec: RequestSpec) -> dict:
    body = {"model": options.model, "max_tokens": spec.output_len, "temperature": options.temperature,
            "stream": True}
    if options.chat:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if options.ignore_eos:
        body["ignore_eos"] = True
    if options.include_usage:
        body["stream_options"] = {"include_usage": True}
    body.update(options.extra_body)
    return body


def chunk_text(chunk: dict) -> str:
    """The generated text a chunk carries, for either endpoint (reasoning text counts as generated)."""
    text = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        text += choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
    return text


async def send(client: httpx.AsyncClient, options: RequestOptions, spec: RequestSpec, api_key: str | None,
               record: RequestRecord, start: float) -> None:
    """Stream one completion into ``record``; times are ``perf_counter() - start``."""
    headers = dict(options.headers)
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    record.sent_s = time.perf_counter() - start
    try:
        async with client.stream("POST", options.base_url + options.endpoint, json=request_body(options, spec),
                                 headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.fail(f"http_{response.status_code}", text[:ERROR_BODY_CHARS])
                return
            await _read_stream(response, record, start)
    except httpx.TimeoutException as error:
        record.fail("timeout", f"{type(error).__name__}: {error}")
    except httpx.TransportError as error:
        record.fail("connection", f"{type(error).__name__}: {error}")


async def _read_stream(response: httpx.Response, record: RequestRecord, start: float) -> None:
    finished = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            finished = True
            break
        now = time.perf_counter() - start
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            record.fail("bad_chunk", payload[:ERROR_BODY_CHARS])
            return
        if "error" in chunk:
            record.fail("stream_error", json.dumps(chunk["error"])[:ERROR_BODY_CHARS])
            return
        if chunk.get("usage"):
            record.usage_prompt_tokens = chunk["usage"].get("prompt_tokens")
            record.usage_completion_tokens = chunk["usage"].get("completion_tokens")
        if text := chunk_text(chunk):
            record.chunk_times_s.append(now)
            record.output_text += text
    record.end_s = time.perf_counter() - start
    if not finished:
        record.fail("incomplete", "the stream closed before [DONE]")
    elif not record.chunk_times_s:
        record.fail("empty_output", "the stream carried no generated text")
