"""Chat templates render in the proxy without transformers, exactly as transformers renders them.

Each template (the embedded SmolLM2's, and tests/fixtures/chat_templates/ in the shape of the
Llama 3.1, Mistral v0.3, Qwen2.5 and Qwen3 formats) is rendered by ``common.text.Tokenizer`` and by
transformers' ``apply_chat_template`` over the same tokenizer files; the text and the token ids must
be equal, with and without tools.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from common.text.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
TEMPLATES = ["smollm2", "llama3", "mistral", "qwen25", "qwen3"]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                   "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web — returns snippets.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}

CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "Say hello."}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}],
    "multi turn": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "Count to three: 🐱 ünïcödé \"quotes\" <tags>"},
    ],
    "reasoning": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
        {"role": "user", "content": "And 3+3?"},
    ],
}
TOOL_CONVERSATIONS = {
    "tool call and result": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call12345", "content": '{"temp": 21, "unit": "c"}'},
    ],
    "tools declared": [{"role": "user", "content": "Find me a recipe."}],
}


@pytest.fixture(scope="module")
def tokenizer_dirs(embedded_model_dir, tmp_path_factory) -> dict[str, Path]:
    """One tokenizer directory per template: the embedded model's tokenizer files with that template."""
    dirs = {}
    for name in TEMPLATES:
        path = tmp_path_factory.mktemp(name)
        for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            shutil.copy(embedded_model_dir / file, path / file)
        if name != "smollm2":
            shutil.copy(FIXTURES / f"{name}.jinja", path / "chat_template.jinja")
        dirs[name] = path
    return dirs


def both(path: Path):
    return Tokenizer(path), AutoTokenizer.from_pretrained(path)


def reference(hf, messages, tools=None, **kwargs):
    text = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
    ids = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True, **kwargs)
    return text, list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_rendering_equals_transformers(tokenizer_dirs, template, conversation):
    ours, hf = both(tokenizer_dirs[template])
    messages = CONVERSATIONS[conversation]
    text, ids = reference(hf, messages)
    assert ours.render_chat(messages) == text
    assert ours.apply_chat_template(messages) == ids


@pytest.mark.parametrize("template", ["llama3", "mistral", "qwen25", "qwen3"])
@pytest.mark.parametrize("conversation", list(TOOL_CONVERSATIONS))
def test_rendering_with_tools_equals_transformers(tokenizer_dirs, template, conversation):
    ours, hf = both(tokenizer_dirs[template])
    messages = TOOL_CONVERSATIONS[conversation]
    tools = [WEATHER, SEARCH]
    text, ids = reference(hf, messages, tools)
    assert "get_weather" in text
    assert ours.render_chat(messages, tools) == text
    assert ours.apply_chat_template(messages, tools) == ids


def test_template_variables_reach_the_template(tokenizer_dirs):
    ours, hf = both(tokenizer_dirs["qwen3"])
    messages = CONVERSATIONS["one turn"]
    text, ids = reference(hf, messages, enable_thinking=False)
    assert text.endswith("<think>\n\n</think>\n\n")
    assert ours.render_chat(messages, template_kwargs={"enable_thinking": False}) == text
    assert ours.apply_chat_template(messages, template_kwargs={"enable_thinking": False}) == ids


def test_a_template_error_is_raised_not_rendered(tokenizer_dirs):
    ours, _ = both(tokenizer_dirs["mistral"])
    with pytest.raises(Exception, match="alternate"):
        ours.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_the_sandbox_refuses_reaching_into_python(tmp_path, tokenizer_dirs):
    path = tmp_path / "evil"
    shutil.copytree(tokenizer_dirs["smollm2"], path)
    (path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|access"):
        Tokenizer(path).render_chat([{"role": "user", "content": "x"}])
