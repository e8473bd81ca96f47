"""Decode failover at the proxy: a request whose worker is lost or gives it back resumes elsewhere.

Scripted workers (``tests.scripted_worker``) continue their script after a resumed request's output
so far, so the text a client receives across a resume must be exactly the script's, every token once.
The engine's side (that a worker continues the same tokens) is tests/unit/test_engine_resume.py; real
processes killed mid-stream are tests/e2e/test_failover_processes.py.
"""
from __future__ import annotations

from tests.e2e.proxy_harness import *  # noqa: F401,F403 -- fixtures, helpers and wire types
from common.protocol.wire import RequestFailed, TokenDelta, TokenDeltas


def stream(proxy, **extra):
    """A streamed completion with usage, as a response context."""
    request = {"model": MODEL, "prompt": "Hi", "stream": True, "max_tokens": 50,
               "stream_options": {"include_usage": True}, **extra}
    return proxy.http.stream("POST", "/v1/completions", json=request)


def collect(lines) -> tuple[str, dict | None, list[dict]]:
    """(text, usage, errors) of the rest of an SSE stream."""
    text, usage, errors = "", None, []
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        if "error" in event:
            errors.append(event["error"])
            continue
        for choice in event.get("choices", []):
            text += choice.get("text") or ""
        usage = event.get("usage") or usage
    return text, usage, errors


def lose_the_decode_worker(make_proxy, make_worker, after: int, goodbye: bool = True, replace: bool = True,
                           **proxy_options) -> tuple[str, str, dict | None, list[dict], dict]:
    """Prefill worker p0 and decode worker d0 serve one stream; after ``after`` text events d1 joins
    (``replace``) and d0 stops (``goodbye=False``: silent, as if killed). Returns (the text before the loss,
    the rest, usage, error events, the proxy and workers by name)."""
    proxy = make_proxy(**proxy_options)
    workers = {"proxy": proxy, "p0": make_worker(proxy, "p0", "prefill"),
               "d0": make_worker(proxy, "d0", "decode", token_interval_s=0.05)}
    with stream(proxy) as r:
        lines = r.iter_lines()
        before = ""
        while after:
            line = next(lines)
            if line.startswith("data: ") and line != "data: [DONE]":
                before += "".join(c.get("text") or "" for c in json.loads(line[6:]).get("choices", []))
                after -= 1
        if replace:
            workers["d1"] = make_worker(proxy, "d1", "decode")
        workers["d0"].stop(goodbye=goodbye)
        rest, usage, errors = collect(lines)
    return before, rest, usage, errors, workers


def test_a_lost_decode_worker_hands_its_stream_to_another(make_proxy, make_worker, script):
    before, rest, usage, errors, workers = lose_the_decode_worker(make_proxy, make_worker, 4, goodbye=False,
                                                                  heartbeat_timeout_s=0.5)
    assert not errors and before + rest == SCRIPT_TEXT
    assert usage["completion_tokens"] == len(script)
    resumed = workers["p0"].messages(PrefillRequest)[-1]  # its PrefillDone carried the resumed attempt's token
    assert resumed.request_id.endswith("~1") and resumed.output_token_ids
    decode = workers["d1"].wait_for(lambda m: isinstance(m, DecodeRequest))
    assert decode.request_id == resumed.request_id
    assert decode.output_token_ids == resumed.output_token_ids  # then first_token, sampled by the prefill
    assert [t for t, _ in script[:len(resumed.output_token_ids)]] == resumed.output_token_ids
    proxy = workers["proxy"]
    assert "tessera_proxy_migrations_total 1.0" in proxy.http.get("/metrics").text  # counted as it resumed
    settle(lambda: dict(proxy.services.cluster.inflight), lambda inflight: not inflight, PATIENCE_S,
           "the finished request leaves the proxy")


def test_a_decode_worker_that_says_goodbye_hands_over_at_once(make_proxy, make_worker, script):
    before, rest, usage, errors, _ = lose_the_decode_worker(make_proxy, make_worker, 3)
    assert not errors and before + rest == SCRIPT_TEXT and usage["completion_tokens"] == len(script)


def test_a_request_given_back_resumes_and_the_old_attempt_is_a_stray(make_proxy, make_worker, script):
    proxy = make_proxy()
    make_worker(proxy, "p0", "prefill")
    first = make_worker(proxy, "d0", "decode", stall=True)
    second = make_worker(proxy, "d1", "decode", stall=True)
    with stream(proxy) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the first token, from the prefill
        settle(lambda: first.messages(DecodeRequest) + second.messages(DecodeRequest), bool, HEARTBEAT_TIMEOUT_S,
               "a decode worker receives the DecodeRequest (heartbeat_timeout_s bounds a send)")
        holder, other = (first, second) if first.messages(DecodeRequest) else (second, first)
        old = holder.messages(DecodeRequest)[0].request_id
        other.stall = False
        holder.send(RequestFailed(old, holder.worker_id, "worker is draining", retryable=True))
        rest, usage, errors = collect(lines)
    assert not errors and script[0][1] + rest == SCRIPT_TEXT and usage["completion_tokens"] == len(script)
    assert [m.request_id for m in holder.messages(DecodeRequest)] == [old]  # resumed elsewhere, not back on it
    holder.send(TokenDeltas([TokenDelta(old, [script[1][0]], script[1][1])]))  # late words of the old attempt
    holder.wait_for(lambda m: isinstance(m, Abort) and m.request_id == old)


def test_without_migrations_a_lost_stream_ends_with_an_error_event(make_proxy, make_worker):
    _, _, _, errors, _ = lose_the_decode_worker(make_proxy, make_worker, 2, max_migrations=0)
    assert len(errors) == 1 and "max_migrations=0" in errors[0]["message"] and "d0" in errors[0]["message"]


def test_a_request_longer_than_migration_max_tokens_fails_instead(make_proxy, make_worker):
    _, _, _, errors, _ = lose_the_decode_worker(make_proxy, make_worker, 3, replace=False, migration_max_tokens=2)
    assert len(errors) == 1 and "migration_max_tokens=2" in errors[0]["message"]


def test_a_lost_prefill_worker_resumes_the_prefill_elsewhere(make_proxy, make_worker):
    proxy = make_proxy()
    stalled = make_worker(proxy, "p0", "prefill", stall=True)
    make_worker(proxy, "d0", "decode")

    def replace_the_prefill_worker():  # the response's headers wait for its first token
        stalled.wait_for(lambda m: isinstance(m, PrefillRequest))
        make_worker(proxy, "p1", "prefill")
        stalled.stop(goodbye=True)

    threading.Thread(target=replace_the_prefill_worker, daemon=True).start()
    with stream(proxy) as r:
        text, _, errors = collect(r.iter_lines())
    assert not errors and text == SCRIPT_TEXT


def test_nothing_left_to_resume_on_is_an_error_event_naming_the_loss(make_proxy, make_worker):
    _, _, _, errors, _ = lose_the_decode_worker(make_proxy, make_worker, 2, replace=False)
    assert len(errors) == 1 and "d0" in errors[0]["message"], errors
