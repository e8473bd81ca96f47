"""Structured output and tool calling through the disaggregated cluster (`make run`'s layout), embedded model.

The prefill worker samples each request's first token under the constraint and the decode worker, replaying it,
the rest: 50 json_schema requests of varied schemas all parse and validate, greedy constrained output equals the
single-process engine's, every request form (response_format, guided_*, structured_outputs; chat and completions;
streamed or not) constrains, and a bad constraint is a 400 naming the problem. The official ``openai`` client's
tool round trip works with ``tool_choice`` required and a named function, whole and streamed.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from common.cli.local_cluster import LocalCluster, post_json
from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams, StructuredOutput
from bench.structured_schemas import prompt, schemas

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def cluster(embedded_model_dir, tmp_path_factory):
    c = LocalCluster.for_tests(embedded_model_dir, tmp_path_factory.mktemp("logs")).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


def schema_body(i: int, schema: dict, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt(i)}], "max_tokens": MAX_TOKENS,
            "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                       "strict": True}}, **extra}


def test_fifty_varied_json_schemas_all_parse_and_validate(cluster):
    cases = schemas(50)

    async def run():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as client:
            # Half greedy, half sampled (seeded): the mask holds for both.
            bodies = [schema_body(i, s, temperature=0.0 if i % 2 == 0 else 0.8, seed=i) for i, s in enumerate(cases)]
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))

    responses = asyncio.run(run())
    failures = []
    for i, (response, schema) in enumerate(zip(responses, cases)):
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        try:
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        except (ValueError, jsonschema.ValidationError) as error:
            failures.append((i, choice["finish_reason"], choice["message"]["content"], str(error)[:200]))
    assert not failures, failures


def test_greedy_constrained_output_equals_the_single_process_engine(cluster, embedded_model_dir):
    cases = schemas(6)
    engine = LLMEngine(EngineConfig(model=str(embedded_model_dir), num_kv_blocks=256))
    chats = [engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt(i)}]) for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                             structured=StructuredOutput(kind="json_schema", spec=json.dumps(s, separators=(",", ":"))))
              for s in cases]
    expected = [o.outputs[0].text for o in engine.generate(chats, params)]
    texts = []
    for i, schema in enumerate(cases):
        status, body = post_json(cluster.url + "/v1/chat/completions", schema_body(i, schema, temperature=0.0))
        assert status == 200, body
        texts.append(body["choices"][0]["message"]["content"])
    assert texts == expected


def test_every_request_form_constrains(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Is the sea blue? Answer."}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            extra_body={"guided_choice": ["yes", "no", "it depends"]})
    assert answer.choices[0].message.content in ("yes", "no", "it depends")
    phone = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0,
                                      extra_body={"guided_regex": r"\d{3}-\d{3}-\d{4}"})
    assert len(phone.choices[0].text) == 12 and phone.choices[0].text[3] == "-"
    anything = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=120, temperature=0,
                                              response_format={"type": "json_object"})
    assert anything.choices[0].finish_reason == "length" or isinstance(
        json.loads(anything.choices[0].message.content), dict)
    schema = schemas(2)[1]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True,
                                            temperature=0, extra_body={"structured_outputs": {"json": schema}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)
    grammar = 'root ::= "(" [a-z]+ ")"'
    status, body = post_json(cluster.url + "/v1/completions", {"model": MODEL, "prompt": "A word:", "max_tokens": 12,
                                                                "temperature": 0, "guided_grammar": grammar})
    text = body["choices"][0]["text"]
    assert status == 200 and text.startswith("(") and (text.endswith(")") or body["choices"][0]["finish_reason"]
                                                        == "length"), body


@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_constraint_is_a_400_naming_the_problem(cluster, stream):
    bad_schema = {"model": MODEL, "prompt": "x", "stream": stream, "guided_json": {"type": "strnig"}}
    status, body = post_json(cluster.url + "/v1/completions", bad_schema)
    assert status == 400 and "strnig" in body["error"]["message"], body
    bad_regex = {"model": MODEL, "prompt": "x", "stream": stream, "guided_regex": "(unclosed"}
    status, body = post_json(cluster.url + "/v1/completions", bad_regex)
    assert status == 400 and "regex" in body["error"]["message"], body
    two = {"model": MODEL, "prompt": "x", "stream": stream, "guided_regex": "a+", "guided_choice": ["b"]}
    status, body = post_json(cluster.url + "/v1/completions", two)
    assert status == 400 and body["error"]["param"] == "guided_choice", body
    no_schema = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": stream,
                 "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}
    status, body = post_json(cluster.url + "/v1/chat/completions", no_schema)
    assert status == 400 and body["error"]["param"] == "response_format.json_schema.schema", body
    not_json = {"model": MODEL, "prompt": "x", "stream": stream, "guided_json": "{not json"}
    status, body = post_json(cluster.url + "/v1/completions", not_json)
    assert status == 400 and body["error"]["param"] == "guided_json", body


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 30},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def streamed_calls(stream) -> tuple[list[dict], str | None]:
    """Tool calls accumulated from ``delta.tool_calls`` chunks as a client does, and the finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_the_openai_client_tool_round_trip_with_an_enforced_choice(cluster, tool_choice):
    from openai import OpenAI

    client = OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    choice = NAMED if tool_choice == "named" else "required"
    kw = dict(model=MODEL, tools=[WEATHER, CLOCK], tool_choice=choice, parallel_tool_calls=False, temperature=0,
              max_tokens=100)
    response = client.chat.completions.create(messages=messages, **kw)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls" and message.content is None, response
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in (("get_weather", "get_time") if tool_choice == "required" else ("get_weather",))
    parameters = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), parameters)

    calls, finish = streamed_calls(client.chat.completions.create(messages=messages, stream=True, **kw))
    assert finish == "tool_calls" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (call.function.name, json.loads(call.function.arguments))]

    # The result goes back as a tool message; the model answers in text (auto: the tools are still offered).
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], temperature=0,
                                            max_tokens=30)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
    streamed = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK],
                                              temperature=0, max_tokens=30, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == (answer.choices[0].message.content or "")


def test_auto_parses_the_calls_in_the_models_output_whole_and_streamed(cluster):
    """Under ``auto`` the model chooses; the embedded 135M model never chooses a call, so a regex makes its output
    the tagged call a tool-capable model writes. The proxy parses the call out of that output."""
    from openai import OpenAI

    client = OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    forced = r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,12}", ' \
             r'"unit": "celsius"\}\}\n</tool_call>'
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, CLOCK],
              tool_choice="auto", temperature=0, max_tokens=60, extra_body={"guided_regex": forced})
    response = client.chat.completions.create(**kw)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "celsius"
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls, finish = streamed_calls(chunks)
    assert finish == "tool_calls" and streamed_text.strip() == "Let me check."
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]


def test_auto_and_none_answer_in_text_when_the_model_calls_nothing(cluster):
    """The embedded 135M model does not choose to call tools; its text comes back as content, whole or streamed
    (the parsing of calls it could make is tests/unit/test_tools.py's)."""
    messages = [{"role": "user", "content": "Say hello."}]
    for tool_choice in ("auto", "none"):
        body = {"model": MODEL, "messages": messages, "tools": [WEATHER], "tool_choice": tool_choice,
                "temperature": 0, "max_tokens": 20}
        status, whole = post_json(cluster.url + "/v1/chat/completions", body)
        assert status == 200 and whole["choices"][0]["message"]["content"], whole
        with httpx.stream("POST", cluster.url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=120) as response:
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
        text = "".join(json.loads(line)["choices"][0]["delta"].get("content") or "" for line in lines
                       if json.loads(line)["choices"])
        assert text == whole["choices"][0]["message"]["content"]
