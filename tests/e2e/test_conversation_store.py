"""Conversations kept in SQLite across a proxy restart: a session that sends the same conversation keeps its
model version; one that sends another starts over; the turns read back; old turns are swept."""
from __future__ import annotations

import logging
import sqlite3
import threading
import time

import pytest

from tests.e2e.proxy_harness import *  # noqa: F401,F403 -- fixtures, helpers and wire types

NAME = "SmolLM2-135M-Instruct"


def start(make_proxy, make_worker, db) -> object:
    proxy = make_proxy(sessions={"conversation_store_path": str(db)})
    for version in ("v1", "v2"):
        for role in ("prefill", "decode"):
            make_worker(proxy, f"{role}-{version}-{id(proxy)}", role, model_version=version)
    settle(lambda: proxy.http.get("/v1/models").json()["data"][0]["versions"], lambda versions: len(versions) == 2,
           PATIENCE_S, "/v1/models lists both versions once their workers registered")
    return proxy


def turn(proxy, messages: list[dict], session: str = "chat-1"):
    response = proxy.http.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 50},
                               headers={"X-Session-Id": session})
    assert response.status_code == 200, response.text
    return response.headers["X-Tessera-Model"], response.json()["choices"][0]["message"]["content"]


def test_a_session_keeps_its_version_across_a_proxy_restart_when_it_sends_the_same_conversation(
        two_versions, make_proxy, make_worker, tmp_path):
    db = tmp_path / "conversations.sqlite"
    proxy = start(make_proxy, make_worker, db)
    history = [{"role": "user", "content": "Hello there."}]
    served, reply = turn(proxy, history)
    assert served == f"{NAME}@v1"
    two_versions.promote(NAME, "v2")  # new sessions get v2 from now on
    proxy.stop()
    proxy = start(make_proxy, make_worker, db)  # a new proxy process: no pin in memory
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    served, reply2 = turn(proxy, history)
    assert served == f"{NAME}@v1"  # the stored conversation kept its version
    assert turn(proxy, [{"role": "user", "content": "Something else."}], session="chat-2")[0] == f"{NAME}@v2"
    stored = proxy.http.get("/v1/sessions/chat-1").json()["data"]
    assert [(t["turn"], t["model"], t["reply"]) for t in stored] == [(0, f"{NAME}@v1", reply), (1, f"{NAME}@v1",
                                                                                                 reply2)]
    assert stored[1]["messages"] == history
    proxy.stop()
    proxy = start(make_proxy, make_worker, db)
    diverged = [{"role": "user", "content": "A different start."}]
    assert turn(proxy, diverged)[0] == f"{NAME}@v2"  # another conversation under that id: chosen afresh
    assert [t["turn"] for t in proxy.http.get("/v1/sessions/chat-1").json()["data"]] == [0]
    assert proxy.http.get("/v1/sessions/nope").status_code == 404


def test_turns_past_the_retention_are_swept_at_start(two_versions, make_proxy, make_worker, tmp_path):
    db = tmp_path / "conversations.sqlite"
    proxy = start(make_proxy, make_worker, db)
    turn(proxy, [{"role": "user", "content": "Hi."}])
    proxy.stop()
    with sqlite3.connect(db) as connection:
        connection.execute("UPDATE turns SET created = ?", (time.time() - 30 * 86400,))
    proxy = start(make_proxy, make_worker, db)
    assert proxy.http.get("/v1/sessions/chat-1").status_code == 404


def test_a_stalled_store_costs_the_turn_only_its_keeping(two_versions, make_proxy, make_worker, tmp_path,
                                                         monkeypatch, caplog):
    """Past conversation_store_timeout_s the turn is served anyway; the read-back answers 503 naming the setting;
    closing the store at shutdown does not wait for the stalled call past its bound."""
    from proxy.edge.conversations import ConversationStore

    proxy = start(make_proxy, make_worker, tmp_path / "conversations.sqlite")
    store = proxy.services.conversations
    store.timeout_s = 0.2
    stalled_until = threading.Event()  # the store answers nothing until the test is done with it
    monkeypatch.setattr(ConversationStore, "_continues", lambda self, *args: stalled_until.wait())
    monkeypatch.setattr(ConversationStore, "_turns", lambda self, *args: stalled_until.wait())
    try:
        assert turn(proxy, [{"role": "user", "content": "Hi."}])[0] == f"{NAME}@v1"
        stalled = proxy.http.get("/v1/sessions/chat-1")
        assert stalled.status_code == 503 and "conversation_store_timeout_s" in stalled.text
        with caplog.at_level(logging.WARNING, logger="tessera.proxy"):
            store.close()  # a call still stalls: the close gives up waiting for it (the proxy's shutdown goes on)
        assert "not closed" in caplog.text and "conversation_store_timeout_s=0.2" in caplog.text, caplog.text
    finally:
        stalled_until.set()  # its thread finishes what was queued, and the proxy can close it
