"""A conversation's replies through a cluster against the single-process engine's, turn by turn: each turn's
reference continues the reference history, so a cluster that reuses a history's KV must still give exactly the
replies the engine computes from the text alone (greedy)."""
from __future__ import annotations

from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams


def assert_replies_are_the_engines(model_dir, messages: list[str], answers: list[dict], max_tokens: int,
                                   system: str | None = None) -> None:
    """``answers``: the cluster's chat completions, one per user message in ``messages``."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=256))
    history = [{"role": "system", "content": system}] if system is not None else []
    for text, answer in zip(messages, answers, strict=True):
        history.append({"role": "user", "content": text})
        [reference] = engine.generate([engine.tokenizer.apply_chat_template(history)],
                                      SamplingParams(temperature=0.0, max_tokens=max_tokens))
        assert answer["choices"][0]["message"]["content"] == reference.outputs[0].text
        history.append({"role": "assistant", "content": reference.outputs[0].text})
