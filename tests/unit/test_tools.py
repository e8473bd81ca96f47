"""Tool calling in the proxy: requests, the prompt each template gets, the grammar of required and named choices,
and the calls parsed from output, whole and streamed. Through the cluster: ``tests/e2e/test_structured_outputs.py``."""
from __future__ import annotations

import json

import pytest

from common.storage.model_store import resolve_model
from common.text.tokenizer import Tokenizer
from proxy.core.errors import ApiError
from proxy.edge.streaming import ChatFormat, ChoiceState
from proxy.edge.protocol import ChatCompletionRequest, chat_prompt_ids
from proxy.core.requests import TokenEvent
from proxy.edge.tools import ToolCallFormat

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def request(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "tools": [WEATHER, TIME], **extra})


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir) -> Tokenizer:
    return Tokenizer(resolve_model(str(embedded_model_dir), "float32"))


def test_required_and_named_choices_become_grammars_auto_and_none_do_not():
    required = json.loads(request(tool_choice="required", parallel_tool_calls=False).sampling_params(16).structured.spec)
    assert required["type"] == "array" and required["minItems"] == 1 and required["maxItems"] == 1
    assert [c["properties"]["name"]["const"] for c in required["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert required["items"]["anyOf"][1]["properties"]["arguments"] == {"$ref": "#/$defs/tool1"}
    assert required["$defs"]["tool1"] == {"type": "object", "properties": {}}
    named = request(tool_choice={"type": "function", "function": {"name": "get_weather"}}).sampling_params(16)
    assert json.loads(named.structured.spec) == WEATHER["function"]["parameters"]
    assert request().sampling_params(16).structured is None
    assert request(tool_choice="none").sampling_params(16).structured is None


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
])
def test_inconsistent_tool_requests_are_400s_naming_the_field(extra, param):
    with pytest.raises(ApiError) as caught:
        request(**extra).sampling_params(16)
    assert caught.value.status == 400 and caught.value.param == param


def test_a_template_without_tools_gets_them_in_the_system_message_and_calls_as_tags(tokenizer):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    body = request(messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}])
    text = tokenizer.decode(chat_prompt_ids(tokenizer, body.messages, body.tool_use), skip_special_tokens=False)
    assert "<tools>" in text and '"name": "get_time"' in text and text.index("<tools>") < text.index("Weather in")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>" in text
    hidden = request(tool_choice="none")
    assert "<tools>" not in tokenizer.decode(chat_prompt_ids(tokenizer, hidden.messages, hidden.tool_use))


def test_a_tool_aware_template_gets_the_tools_and_calls_with_object_arguments(tokenizer, monkeypatch):
    template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:"
                "{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}{{ m.content }};"
                "{% endfor %}")
    monkeypatch.setattr(tokenizer, "chat_template", template)
    monkeypatch.setattr(tokenizer, "_template", None)
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    body = request(messages=[*USER, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "content": "2 C"}])
    text = tokenizer.decode(chat_prompt_ids(tokenizer, body.messages, body.tool_use))
    assert text == "[get_weather][get_time]user:Weather in Paris?;assistant:Oslo;tool:2 C;"


def test_calls_are_parsed_from_auto_output_and_the_text_around_them_is_content():
    use = request().tool_use
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "unknown", "arguments": {}}</tool_call><tool_call>{"name": "get_time"}'
    content, calls = use.parse(text)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"} and calls[0]["id"].startswith("call_")
    assert content == 'Let me check.\n\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
    assert use.parse("no calls here") == ("no calls here", [])
    assert use.parse("<tool_call>{broken") == ("<tool_call>{broken", [])
    required = request(tool_choice="required").tool_use
    assert required.parse('[{"name": "get_time", "arguments": {}}]')[1][0]["function"]["name"] == "get_time"
    assert required.parse('[{"name": "get_ti') == ('[{"name": "get_ti', [])  # cut short by max_tokens


def stream(fmt, pieces: list[str], finish: str = "stop") -> list[dict]:
    state, chunks = ChoiceState(0, 0), []
    for i, piece in enumerate(pieces):
        event = TokenEvent(0, piece, [i], finish_reason=finish if i == len(pieces) - 1 else None)
        chunk = fmt.chunk_choice(state, event)
        state.add(event, None)
        if chunk is not None:
            chunks.append(chunk)
    return chunks


def test_auto_streams_content_until_a_call_begins_then_the_calls_at_the_end():
    fmt = ToolCallFormat(ChatFormat(None, False), request().tool_use)
    chunks = stream(fmt, ["Sure", ", checking", " <tool", '_call>{"name": "get_weather", ',
                          '"arguments": {"city": "Rome"}}</tool_call>', ""])
    assert "".join(c["delta"].get("content", "") for c in chunks) == "Sure, checking "
    last = chunks[-1]
    assert last["finish_reason"] == "tool_calls" and last["delta"]["tool_calls"][0]["index"] == 0
    assert json.loads(last["delta"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    plain = stream(ToolCallFormat(ChatFormat(None, False), request().tool_use), ["A <", "b", " c"])
    assert "".join(c["delta"].get("content", "") for c in plain) == "A <b c" and plain[-1]["finish_reason"] == "stop"


def test_a_named_choice_streams_one_call_and_answers_it_whole():
    use = request(tool_choice={"type": "function", "function": {"name": "get_weather"}}).tool_use
    chunks = stream(ToolCallFormat(ChatFormat(None, False), use), ['{"city"', ': "Lima"}'])
    assert len(chunks) == 1 and chunks[0]["delta"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Lima"}'}
    state = ChoiceState(0, 0, text='{"city": "Lima"}', finish_reason="stop")
    whole = ToolCallFormat(ChatFormat(None, False), use).final_choice(state)
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert whole["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_required_keeps_each_tools_own_references_resolvable():
    nested = {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"type": "integer"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": nested}}
    spec = json.loads(request(tools=[tool], tool_choice="required").sampling_params(16).structured.spec)
    assert spec["$defs"]["tool0"]["properties"]["a"] == {"$ref": "#/$defs/tool0/$defs/A"}


def test_model_output_of_any_shape_is_text_or_calls_never_an_error():
    use = request(parallel_tool_calls=False).tool_use
    deep = "[" * 5000 + "]" * 5000
    for text in ['<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>', f"<tool_call>{deep}</tool_call>",
                 '<tool_call>{"name": "get_time", "arguments": "x"}</tool_call>']:
        assert use.parse(text) == (text, [])
    two = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", ' \
          '"parameters": {"city": "Rome"}}</tool_call>'
    assert [c["function"]["name"] for c in use.parse(two)[1]] == ["get_time"]  # parallel_tool_calls=false
    assert request().tool_use.parse(two)[1][1]["function"]["arguments"] == '{"city": "Rome"}'
    deep_call = {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": deep}}
    body = request(messages=[*USER, {"role": "assistant", "tool_calls": [deep_call]}])
    assert body.messages[1].template_dict(native_tools=False)["role"] == "assistant"
