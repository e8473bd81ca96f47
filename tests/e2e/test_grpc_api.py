"""The gRPC API through the real proxy, with the generated client (docs/examples/grpc_client.py).

On the short model's cluster (`make run`'s layout): Generate streams greedy output equal to HTTP's, chat and
completion; cancelling a call, or a request on a GenerateStream call, frees its pages; GenerateStream multiplexes
and sends no more messages than the client granted credits for; Embed, Tokenize and Admin answer as HTTP does.
With scripted workers: a tenant over its rate gets RESOURCE_EXHAUSTED with a RetryInfo detail, and a missing API
key UNAUTHENTICATED.
"""
from __future__ import annotations

import json
import queue
import threading

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from common.cli.local_cluster import LocalCluster, free_port, post_json
from common.config.roles import ProxyConfig
from docs.examples.grpc_client import chat, generate, generate_many
from proxy.edge.grpc_api import tessera_pb2 as pb
from proxy.edge.grpc_api import tessera_pb2_grpc as rpc
from proxy.tenancy.api_keys import hash_key
from tests.e2e.proxy_harness import *  # noqa: F401,F403 -- fixtures (make_proxy, make_worker) and helpers

MODEL = "SmolLM2-135M-Instruct"
PAGES_FREED_S = ProxyConfig().kv_lease_s  # pages are freed as a request ends, or at its lease's end at the latest


@pytest.fixture(scope="module")
def served(short_model_dir, tmp_path_factory):
    port = free_port()
    cluster = LocalCluster.for_tests(short_model_dir, tmp_path_factory.mktemp("logs"),
                                     proxy_overrides=[f"http.grpc_port={port}"]).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield cluster, channel
    channel.close()
    codes = cluster.stop()
    assert all(code == 0 for code in codes.values()), codes


def pages_used(cluster, held: bool = False) -> None:
    """Until every worker's pages are free (``held``: until some are in use), as their heartbeats report."""
    settle(lambda: cluster.metric("tessera_proxy_kv_pages_used"), lambda used: any(used.values()) == held,
           PAGES_FREED_S, "some KV pages are in use" if held else "every KV page is free (kv_lease_s at the latest)")


def test_generate_streams_greedy_output_equal_to_http(served):
    cluster, channel = served
    stub = rpc.GenerateStub(channel)
    for text in ("Write a haiku about the sea.", "What is a hash table?"):
        streamed, finish = generate(stub, chat(text, MODEL, 24))
        status, body = post_json(cluster.url + "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 24, "temperature": 0})
        assert status == 200 and streamed == body["choices"][0]["message"]["content"]
        assert finish == body["choices"][0]["finish_reason"]
    completion = pb.GenerateRequest(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    messages = list(stub.Generate(completion))
    assert messages[-1].usage.completion_tokens == sum(len(c.token_ids) for m in messages for c in m.choices)
    status, body = post_json(cluster.url + "/v1/completions", {"model": MODEL, "prompt": "The capital of France is",
                                                               "max_tokens": 12, "temperature": 0})
    assert "".join(c.text for m in messages for c in m.choices) == body["choices"][0]["text"]


def test_extra_fields_reach_the_request_and_bad_ones_are_invalid_argument(served):
    _, channel = served
    stub = rpc.GenerateStub(channel)
    request = chat("Is the sea blue?", MODEL, 10)
    request.extra = json.dumps({"guided_choice": ["yes", "no"]})
    assert generate(stub, request)[0] in ("yes", "no")
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(pb.GenerateRequest(model=MODEL, prompt="x", temperature=-1.0)))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "temperature" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(pb.GenerateRequest(model="no-such-model", prompt="x")))
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND


def test_cancelling_the_call_frees_the_pages(served):
    cluster, channel = served
    request = chat("Tell me a long story about a lighthouse keeper.", MODEL, 400)
    request.extra = json.dumps({"ignore_eos": True})
    pages_used(cluster)  # nothing left from an earlier test
    call = rpc.GenerateStub(channel).Generate(request)
    try:
        assert next(call).choices
        pages_used(cluster, held=True)  # it holds pages while it runs
    finally:
        call.cancel()
    pages_used(cluster)
    # The call's handler counts it as it sees the cancellation, on its own time.
    settle(lambda: cluster.metric("tessera_proxy_requests_total"),
           lambda counts: counts.get('{endpoint="grpc_generate",status="client_closed"}', 0) >= 1, PATIENCE_S,
           "the proxy counts the cancelled call as client_closed")


def test_generate_stream_multiplexes_within_its_credits_and_cancels_by_message(served):
    cluster, channel = served
    stub = rpc.GenerateStub(channel)
    texts = generate_many(stub, {"a": chat("Say hi.", MODEL, 8), "b": chat("Count to three.", MODEL, 8)}, credits=1)
    assert set(texts) == {"a", "b"} and all(texts.values())
    assert texts["a"] == generate(stub, chat("Say hi.", MODEL, 8))[0]

    pages_used(cluster)
    outgoing: queue.Queue = queue.Queue()
    long = chat("Tell me a long story about a dragon.", MODEL, 400)
    long.extra = json.dumps({"ignore_eos": True})
    outgoing.put(pb.StreamRequest(start=pb.StreamRequest.Start(id="long", request=long, initial_credits=3)))
    replies = stub.GenerateStream(iter(outgoing.get, None))
    got: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [got.put(r) for r in replies], daemon=True).start()
    first = [got.get(timeout=60) for _ in range(3)]
    assert all(r.id == "long" and r.WhichOneof("kind") == "response" for r in first)
    with pytest.raises(queue.Empty):
        got.get(timeout=1.0)  # three credits, three messages: the rest waits for a grant
    outgoing.put(pb.StreamRequest(cancel=pb.StreamRequest.Cancel(id="long")))
    outgoing.put(pb.StreamRequest(credit=pb.StreamRequest.Credit(messages=1000)))
    while (reply := got.get(timeout=60)).WhichOneof("kind") != "done":
        assert reply.id == "long"
    outgoing.put(None)
    pages_used(cluster)


def test_embed_tokenize_and_admin_answer_as_http_does(served):
    cluster, channel = served
    embedded = rpc.EmbedStub(channel).Embed(pb.EmbedRequest(model=MODEL, input=["hello", "world"]))
    status, body = post_json(cluster.url + "/v1/embeddings", {"model": MODEL, "input": ["hello", "world"]})
    assert status == 200 and len(embedded.data) == 2
    assert embedded.data[0].values == pytest.approx(body["data"][0]["embedding"], abs=1e-6)
    tokens = rpc.TokenizeStub(channel).Tokenize(pb.TokenizeRequest(prompt="hello world"))
    assert list(tokens.tokens) == post_json(cluster.url + "/tokenize", {"prompt": "hello world"})[1]["tokens"]
    text = rpc.TokenizeStub(channel).Detokenize(pb.DetokenizeRequest(tokens=tokens.tokens))
    assert text.prompt.endswith("hello world")
    admin = rpc.AdminStub(channel)
    assert admin.Health(pb.HealthRequest()).ready
    assert MODEL in [m["id"] for m in admin.ListModels(pb.ListModelsRequest()).models]


def test_a_tenant_over_its_rate_gets_resource_exhausted_with_retry_info(make_proxy, make_worker):
    port = free_port()
    proxy = make_proxy(http={"grpc_port": port},
                       tenancy={"auth_enabled": True, "tenants": [
        {"name": "beta", "api_key_sha256": [hash_key("sk-beta")], "requests_per_s": 0.2, "request_burst": 1}]})
    make_worker(proxy, "p0", "prefill")
    make_worker(proxy, "d0", "decode")
    ready(proxy)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = rpc.GenerateStub(channel)
        request = pb.GenerateRequest(model=MODEL, prompt="Tell me about foxes.", max_tokens=4)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request))
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        key = (("authorization", "Bearer sk-beta"),)
        assert list(stub.Generate(request, metadata=key))[-1].usage.completion_tokens > 0
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, metadata=key))
    error = caught.value
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "requests_per_s" in error.details()
    (detail,) = rpc_status.from_call(error).details
    info = error_details_pb2.RetryInfo()
    assert detail.Unpack(info) and info.retry_delay.seconds >= 1
    assert int(dict(error.trailing_metadata())["retry-after"]) >= 1


def test_a_half_closed_stream_gets_the_rest_without_credits_and_a_reused_id_ends_the_call(served):
    _, channel = served
    stub = rpc.GenerateStub(channel)
    start = pb.StreamRequest(start=pb.StreamRequest.Start(id="x", request=chat("Say hi.", MODEL, 12), initial_credits=1))
    replies = list(stub.GenerateStream(iter([start])))  # sent, then half-closed: no credit ever comes
    assert replies[-1].WhichOneof("kind") == "done" and len(replies) > 2
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.GenerateStream(iter([start, start])))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "still running" in caught.value.details()


def test_a_named_tool_choice_comes_back_as_typed_tool_calls(served):
    _, channel = served
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
    request = chat("Weather in Paris?", MODEL, 40)
    request.extra = json.dumps({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    calls = [call for m in rpc.GenerateStub(channel).Generate(request) for c in m.choices for call in c.tool_calls]
    assert [c.name for c in calls] == ["get_weather"] and "city" in json.loads(calls[0].arguments)


def test_a_stream_whose_client_grants_no_credit_ends_after_grpc_credit_timeout_s(make_proxy, make_worker):
    port = free_port()
    proxy = make_proxy(http={"grpc_port": port, "grpc_credit_timeout_s": 1.0})
    make_worker(proxy, "p0", "prefill")
    decode = make_worker(proxy, "d0", "decode", token_interval_s=0.5)  # still running at the timeout
    ready(proxy)
    outgoing: queue.Queue = queue.Queue()
    request = pb.GenerateRequest(model=MODEL, prompt="Tell me about foxes.", max_tokens=8)
    outgoing.put(pb.StreamRequest(start=pb.StreamRequest.Start(id="r", request=request, initial_credits=1)))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        replies = rpc.GenerateStub(channel).GenerateStream(iter(outgoing.get, None))  # never half-closed
        with pytest.raises(grpc.RpcError) as caught:
            list(replies)
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED  # ended by the proxy, naming the setting
    assert "grpc_credit_timeout_s" in caught.value.details()
    decode.wait_for(lambda m: isinstance(m, Abort))  # its request was cancelled on the worker too
    outgoing.put(None)
