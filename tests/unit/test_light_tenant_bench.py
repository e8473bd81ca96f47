"""bench/light_tenant.py's accounting of the cold start's timeline: each tenant's choices decoding at an instant and
the weighted tokens it was served in the second before."""
from __future__ import annotations

from types import SimpleNamespace

from bench.light_tenant import served, timeline_at

ARGS = SimpleNamespace(input_len=64, output_len=4)


def request(tenant: str, stamps: list[float], status: int = 200) -> dict:
    return {"tenant": tenant, "status": status, "stamps": stamps}


def test_a_choice_decodes_from_its_second_token_to_its_last_and_its_tokens_count_when_they_come():
    records = [request("A", [0.5, 1.2, 1.4, 2.5]), request("B", [1.1, 1.3]), request("B", [], status=429)]
    at = timeline_at(records, 1.6, ARGS)
    assert at["decoding_A"] == 1 and at["decoding_B"] == 0  # B's last token was its second: it ended
    # in [0.6, 1.6): A's input came before (0.5), two of its 4 events (2 x 4 tokens over 4 events: 2 each) within;
    # B's input at its first token, and both its events (4 each)
    assert at["served_A"] == round(served(records, "A", 0.6, 1.6, 64, 4)) == 4
    assert at["served_B"] == 64 + 8
    assert timeline_at(records, 3.0, ARGS)["decoding_A"] == 0
