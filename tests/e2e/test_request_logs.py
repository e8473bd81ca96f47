"""The proxy's log lines about a request carry its id and tenant; prompts only with log_prompts.

A real proxy (uvicorn thread) with scripted workers on real sockets: the
HTTP handler's line and the line the worker link's task writes when a
worker fails the request both name the request; prompt token ids appear
only when ``log_prompts`` is on.
"""
from __future__ import annotations

import io
import json
import logging
import threading

import pytest

from common.runtime.telemetry import make_handler
from common.protocol.wire import RequestFailed, encode
from tests.e2e.proxy_harness import *  # noqa: F401,F403 -- fixtures, helpers and wire types


@pytest.fixture()
def json_lines():
    stream = io.StringIO()
    logger = logging.getLogger("tessera.proxy")
    handler = make_handler("json", stream, role="proxy")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    logger.removeHandler(handler)
    logger.setLevel(old_level)


@pytest.mark.parametrize("log_prompts", [False, True])
def test_request_lines_name_the_request_and_tenant(make_proxy, make_worker, json_lines, log_prompts):
    proxy = make_proxy(observability={"log_prompts": log_prompts})
    make_worker(proxy, "p0", "prefill")
    decode = make_worker(proxy, "d0", "decode", stall=True)
    ready(proxy)
    answers = []
    client = threading.Thread(target=lambda: answers.append(proxy.http.post("/v1/completions", json={
        "model": MODEL, "prompt": "Hello there", "max_tokens": 5, "user": "alice"})))
    client.start()
    handed = decode.wait_for(lambda m: isinstance(m, DecodeRequest))
    decode.send_raw(encode(RequestFailed(handed.request_id, "d0", "out of memory", retryable=False)))
    client.join(30)
    assert answers and answers[0].status_code == 500, answers

    lines = json_lines()
    response_id = handed.request_id.rsplit("-", 1)[0]
    (user_line,) = [line for line in lines if "from user" in line["msg"]]
    assert (user_line["request_id"], user_line["tenant"], user_line["role"]) == (response_id, "default", "proxy")
    (failed,) = [line for line in lines if "failed" in line["msg"] and line["level"] == "WARNING"]
    assert (failed["request_id"], failed["tenant"]) == (handed.request_id, "default")
    prompt_lines = [line for line in lines if "prompt token ids" in line["msg"]]
    if log_prompts:
        assert str(handed.prompt_token_ids) in prompt_lines[0]["msg"]
        assert prompt_lines[0]["request_id"] == response_id
    else:
        assert not prompt_lines
        assert not any(str(handed.prompt_token_ids)[1:-1] in line["msg"] for line in lines)
