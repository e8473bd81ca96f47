"""The gRPC API's pieces that need no server: the generated modules match the .proto, requests become the HTTP
bodies (validated by the same models), and HTTP statuses map to gRPC codes. Served: tests/e2e/test_grpc_api.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from proxy.core.errors import ApiError
from proxy.edge.grpc_api import tessera_pb2 as pb
from proxy.edge.grpc_api.service import http_body, status_of
from proxy.edge.protocol import ChatCompletionRequest, CompletionRequest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("tessera_pb2.py", "tessera_pb2_grpc.py")


def test_the_generated_modules_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", "proxy/edge/grpc_api/tessera.proto"], cwd=ROOT, check=True)
    for name in GENERATED:
        fresh = (tmp_path / "proxy" / "edge" / "grpc_api" / name).read_text()
        assert fresh == (ROOT / "proxy" / "edge" / "grpc_api" / name).read_text(), (
            f"{name} is stale: regenerate it (the command is at the top of tessera.proto)")


def test_a_request_becomes_the_http_body_with_its_extra_fields():
    request = pb.GenerateRequest(model="m", chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")]),
                                 max_tokens=5, temperature=0.7, stop=["."], user="u")
    request.extra = json.dumps({"guided_choice": ["a", "b"], "logprobs": True, "guided_json": {"maxLength": 3}})
    body = http_body(request)
    assert body.guided_json == {"maxLength": 3} and isinstance(body.guided_json["maxLength"], int)
    assert isinstance(body, ChatCompletionRequest) and body.messages[0].content == "hi"
    assert (body.max_tokens, body.temperature, body.stop, body.user, body.logprobs) == (5, 0.7, ["."], "u", True)
    assert body.guided_choice == ["a", "b"] and body.top_p is None  # unset optional fields stay the default
    ids = http_body(pb.GenerateRequest(model="m", prompt_token_ids=pb.TokenIds(ids=[1, 2])))
    assert isinstance(ids, CompletionRequest) and ids.prompt == [1, 2]


@pytest.mark.parametrize("request_, param", [
    (pb.GenerateRequest(model="m"), "input"),
    (pb.GenerateRequest(model="m", prompt="x", extra="[1]"), "extra"),
    (pb.GenerateRequest(model="m", prompt="x", extra="{nope"), "extra"),
    (pb.GenerateRequest(model="m", prompt="x", extra='{"min_p": Infinity}'), "min_p"),
    (pb.GenerateRequest(model="m", prompt="x", top_p=1.5), "top_p"),
    (pb.GenerateRequest(model="m", chat=pb.Chat(messages=[pb.ChatMessage(role="robot")])), "messages.0.role"),
])
def test_a_bad_request_is_a_400_naming_the_field(request_, param):
    with pytest.raises(ApiError) as caught:
        http_body(request_)
    assert caught.value.status == 400 and caught.value.param == param


def test_http_statuses_map_to_grpc_codes():
    expected = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 413: "INVALID_ARGUMENT",
                429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED", 500: "INTERNAL"}
    assert {status: status_of(ApiError(status, "x")).name for status in expected} == expected
    assert status_of(ApiError(429, "x")) is grpc.StatusCode.RESOURCE_EXHAUSTED
