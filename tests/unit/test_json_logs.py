"""Structured logs: one JSON object per line, with the request and tenant a line is about."""
import asyncio
import io
import json
import logging

import pytest

from common.runtime.telemetry import bind_request, make_handler, request_scope


@pytest.fixture()
def capture():
    """A logger of its own writing JSON into a buffer; returns (logger, parsed lines)."""
    stream = io.StringIO()
    logger = logging.getLogger("tessera.test.json_logs")
    handler = make_handler("json", stream, role="decode", worker_id="decode-0")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

    def lines() -> list[dict]:
        return [json.loads(line) for line in stream.getvalue().splitlines()]

    yield logger, lines
    logger.removeHandler(handler)


def test_each_line_is_one_json_object_with_the_process_fields(capture):
    logger, lines = capture
    logger.info("worker %s registered", "decode-0")
    (line,) = lines()
    assert line["level"] == "INFO" and line["logger"] == "tessera.test.json_logs"
    assert line["msg"] == "worker decode-0 registered"
    assert line["role"] == "decode" and line["worker_id"] == "decode-0"
    assert line["ts"].endswith("+00:00") and isinstance(line["pid"], int)
    assert "request_id" not in line and "tenant" not in line


def test_lines_inside_a_request_scope_carry_its_id_and_tenant(capture):
    logger, lines = capture
    with request_scope("cmpl-1-0", "acme"):
        logger.warning("pull failed")
        logger.info("explicit", extra={"request_id": "cmpl-9-0"})  # the call's own fields win
    logger.info("after")
    with request_scope(None):
        logger.info("no request")
    scoped, explicit, after, none = lines()
    assert (scoped["request_id"], scoped["tenant"]) == ("cmpl-1-0", "acme")
    assert (explicit["request_id"], explicit["tenant"]) == ("cmpl-9-0", "acme")
    assert "request_id" not in after and "request_id" not in none


def test_concurrent_tasks_keep_their_own_request(capture):
    logger, lines = capture

    async def handler(request_id: str, tenant: str) -> None:
        bind_request(request_id, tenant)  # as the proxy's submit does in each HTTP handler task
        await asyncio.sleep(0.01)
        logger.info("streaming %s", request_id)

    async def main() -> None:
        await asyncio.gather(handler("a", "t1"), handler("b", "t2"), handler("c", "t1"))

    asyncio.run(main())
    seen = {(line["msg"].split()[-1], line["request_id"], line["tenant"]) for line in lines()}
    assert seen == {("a", "a", "t1"), ("b", "b", "t2"), ("c", "c", "t1")}


def test_exceptions_are_kept_in_the_line(capture):
    logger, lines = capture
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("step failed")
    (line,) = lines()
    assert line["level"] == "ERROR" and "RuntimeError: boom" in line["exc"]


def test_text_format_tags_the_request():
    stream = io.StringIO()
    logger = logging.getLogger("tessera.test.text_logs")
    logger.addHandler(make_handler("text", stream))
    logger.propagate = False
    logger.setLevel(logging.INFO)
    with request_scope("cmpl-2-0", "acme"):
        logger.info("hello")
    assert "tessera.test.text_logs" in stream.getvalue() and "[cmpl-2-0 acme] hello" in stream.getvalue()


def test_unknown_format_names_the_option():
    with pytest.raises(ValueError, match="--log-format"):
        make_handler("xml")
