"""Closed-loop tenant load for the fairness tests (test_tenants.py, test_proxies_shared.py).

Each tenant's streams send one completion after another; what each tenant was served is counted over a fixed
number of completions after a warm-up, never over a wall-clock window. A busy machine changes how many
completions fit in a second, not the order in which admission serves the tenants, so a share measured this way
is the policy's, whatever the load beside the test. Every stream sends its next request as soon as its last
one ended, until the count is reached: both tenants stay backlogged through the measured completions.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tests.e2e.proxy_harness import MODEL

BODY = {"model": MODEL, "prompt": "Tell me about foxes.", "max_tokens": 10}
# Bounds a run, so that a stuck one fails rather than hangs; never a timing.
RUN_PATIENCE_S = 300.0


@dataclass
class Completions:
    """The completions of a run in the order they ended, each as its tenant key and its weighted tokens (prompt
    + 2 x completion, from usage: what VTC charges). The first ``warm_up`` are the start's, when the streams
    send their first requests all at once; the ``measured`` ones after them are what ``served`` counts."""
    warm_up: int
    measured: int
    ended: list[tuple[str, int]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # bodies of the answers other than 200

    @property
    def measuring(self) -> bool:
        return self.warm_up <= len(self.ended) < self.warm_up + self.measured

    @property
    def done(self) -> bool:
        return len(self.ended) >= self.warm_up + self.measured

    def served(self) -> dict[str, int]:
        """Each key's weighted tokens over the measured completions."""
        totals: dict[str, int] = {}
        for key, tokens in self.ended[self.warm_up:self.warm_up + self.measured]:
            totals[key] = totals.get(key, 0) + tokens
        return totals

    def count(self, key: str) -> int:
        """How many of the measured completions were ``key``'s."""
        return sum(k == key for k, _ in self.ended[self.warm_up:self.warm_up + self.measured])

    def share(self, key: str) -> float:
        served = self.served()
        return served.get(key, 0) / sum(served.values())


async def closed_loops(streams: dict[str, list[tuple[str, int]]], completions: Completions,
                       going: Callable[[], bool] | None = None) -> None:
    """Each tenant key's closed loops, ``(proxy url, count)`` each, while ``going()`` (by default: until
    ``completions`` has its count); every answer is recorded in ``completions``."""
    going = going or (lambda: not completions.done)

    async def loop(client: httpx.AsyncClient, key: str) -> None:
        while going():
            response = await client.post("/v1/completions", json=BODY)
            if response.status_code != 200:
                completions.failures.append(response.text)
                continue
            usage = response.json()["usage"]
            completions.ended.append((key, usage["prompt_tokens"] + 2 * usage["completion_tokens"]))

    clients, loops = [], []
    for key, spread in streams.items():
        for url, count in spread:
            client = httpx.AsyncClient(base_url=url, timeout=30, headers={"Authorization": f"Bearer {key}"})
            clients.append(client)
            loops += [loop(client, key) for _ in range(count)]
    try:
        async with asyncio.timeout(RUN_PATIENCE_S):
            await asyncio.gather(*loops)
    except TimeoutError:
        raise AssertionError(f"the closed loops did not finish within {RUN_PATIENCE_S:g}s: "
                             f"{len(completions.ended)} completions, {len(completions.failures)} failures") from None
    finally:
        for client in clients:
            await client.aclose()
