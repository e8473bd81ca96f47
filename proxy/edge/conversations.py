"""Conversation persistence: a session's turns (the messages sent and the reply) in SQLite, kept across restarts.

With ``conversation_store_path`` set, each chat turn of a session (``X-Session-Id``) that completes is written:

    CREATE TABLE turns (
        session  TEXT NOT NULL,     -- the session id
        turn     INTEGER NOT NULL,  -- 0, 1, 2, ... within the session
        tenant   TEXT NOT NULL,
        model    TEXT NOT NULL,     -- the model name and the version that served the turn
        version  TEXT NOT NULL,
        messages TEXT NOT NULL,     -- the request's messages, JSON
        reply    TEXT NOT NULL,     -- the generated text (the first choice's)
        finish_reason TEXT,
        created  REAL NOT NULL,     -- unix time the turn was written
        PRIMARY KEY (session, turn))

Retention: turns older than ``conversation_retention_s`` are deleted at start and then every hour.

After a proxy restart, a session continues where it was as long as the client sends the same conversation: when a
turn's messages begin with the stored last turn's messages followed by its reply, the session keeps the model
version it was pinned to (for what is left of ``session_pin_max_s`` since its first turn). A conversation that
differs is a new one under that id: its turns start again at 0. ``GET /v1/sessions/{id}`` reads the stored turns
back (the owning tenant's key with auth on).

SQLite runs in one thread of its own (WAL mode), so the event loop never waits on the disk; a call that takes longer
than ``conversation_store_timeout_s`` is given up (the turn is served, only not kept; the read-back answers 503).
"""
from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from dataclasses import dataclass

from proxy.core.daemon_executor import DaemonExecutor

log = logging.getLogger("tessera.proxy")
SWEEP_INTERVAL_S = 3600.0
SCHEMA = """
CREATE TABLE IF NOT EXISTS turns (
    session TEXT NOT NULL, turn INTEGER NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL, version TEXT NOT NULL,
    messages TEXT NOT NULL, reply TEXT NOT NULL, finish_reason TEXT, created REAL NOT NULL,
    PRIMARY KEY (session, turn));
CREATE INDEX IF NOT EXISTS turns_created ON turns (created);
"""


@dataclass(frozen=True)
class Continued:
    """What a request continues: the stored session's pinned version and when its first turn was."""
    turn: int  # the number the request's turn gets
    version: str | None  # None: a new conversation
    first_created: float


class ConversationStore:
    def __init__(self, path: str, retention_s: float, timeout_s: float) -> None:
        self.path = path
        self.retention_s = retention_s
        self.timeout_s = timeout_s
        self._executor = DaemonExecutor("conversations")  # a stuck call does not hold the proxy's exit
        self._db: sqlite3.Connection | None = None
        self._next_sweep = 0.0
        self._closed = False
        self._executor.submit(self._open).result()  # a bad path fails the start, not a request

    def _open(self) -> None:
        self._db = sqlite3.connect(self.path)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(SCHEMA)
        self._sweep()

    async def _run(self, fn, *args):
        call = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        try:
            return await asyncio.wait_for(call, self.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the conversation store took longer than sessions.conversation_store_timeout_s="
                               f"{self.timeout_s}s") from None

    async def continues(self, session: str, tenant: str, messages: list[dict]) -> Continued:
        return await self._run(self._continues, session, tenant, messages)

    async def record(self, session: str, turn: int, tenant: str, model: tuple[str, str], messages: list[dict],
                     reply: str, finish_reason: str | None) -> None:
        await self._run(self._record, session, turn, tenant, model, messages, reply, finish_reason)

    async def turns(self, session: str, tenant: str | None) -> list[dict]:
        return await self._run(self._turns, session, tenant)

    def _continues(self, session: str, tenant: str, messages: list[dict]) -> Continued:
        row = self._db.execute("SELECT turn, version, messages, reply FROM turns WHERE session = ? AND tenant = ? "
                               "ORDER BY turn DESC LIMIT 1", (session, tenant)).fetchone()
        if row is None:
            return Continued(0, None, time.time())
        turn, version, stored, reply = row
        before = json.loads(stored) + [{"role": "assistant", "content": reply}]
        if messages[:len(before)] != before:
            self._db.execute("DELETE FROM turns WHERE session = ? AND tenant = ?", (session, tenant))
            self._db.commit()
            return Continued(0, None, time.time())
        first = self._db.execute("SELECT created FROM turns WHERE session = ? AND tenant = ? AND turn = 0",
                                 (session, tenant)).fetchone()
        return Continued(turn + 1, version, first[0] if first else time.time())

    def _record(self, session, turn, tenant, model, messages, reply, finish_reason) -> None:
        self._db.execute("INSERT OR REPLACE INTO turns VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         (session, turn, tenant, model[0], model[1], json.dumps(messages), reply, finish_reason,
                          time.time()))
        self._db.commit()
        if time.monotonic() >= self._next_sweep:
            self._sweep()

    def _turns(self, session: str, tenant: str | None) -> list[dict]:
        rows = self._db.execute("SELECT turn, tenant, model, version, messages, reply, finish_reason, created "
                                "FROM turns WHERE session = ? ORDER BY turn", (session,)).fetchall()
        return [{"turn": r[0], "model": f"{r[2]}@{r[3]}", "messages": json.loads(r[4]), "reply": r[5],
                 "finish_reason": r[6], "created": r[7]} for r in rows if tenant is None or r[1] == tenant]

    def _sweep(self) -> None:
        removed = self._db.execute("DELETE FROM turns WHERE created < ?", (time.time() - self.retention_s,)).rowcount
        self._db.commit()
        self._next_sweep = time.monotonic() + SWEEP_INTERVAL_S
        if removed:
            log.info("conversation store: removed %d turns older than sessions.conversation_retention_s=%gs", removed,
                     self.retention_s)

    def close(self) -> None:
        """Closes the database once the call in progress (if any) ends, waiting for that at most
        ``conversation_store_timeout_s`` beyond its own bound; past that the close is left queued behind it."""
        def close_db() -> None:
            if self._db is not None:
                self._db.close()
        if self._closed:
            return
        self._closed = True
        try:
            self._executor.submit(close_db).result(timeout=2 * self.timeout_s)
        except TimeoutError:
            log.warning("conversation store: not closed, a call still runs past sessions.conversation_store_timeout_s="
                        "%gs (the database keeps what was committed)", self.timeout_s)
        self._executor.shutdown()


async def continue_turn(services, body, session: str | None, tenant: str):
    """A chat turn of a session (the caller asks only with a conversation store): restores the session's pinned
    version when the turn continues the stored conversation, and returns what writes the turn once its reply is
    complete (else None)."""
    store = services.conversations
    if session is None:
        return None
    messages = body.model_dump(mode="json", exclude_none=True)["messages"]
    try:
        continued = await store.continues(session, tenant, messages)
    except Exception:  # a store that fails or stalls must not fail the turn: it is served, only not kept
        log.exception("could not read session %r from the conversation store", session)
        return None
    if continued.version is not None:
        services.models.pin(body.model, session, continued.version, time.time() - continued.first_created)

    async def remember(model: tuple[str, str], choices: list) -> None:
        try:
            await store.record(session, continued.turn, tenant, model, messages, choices[0].text,
                               choices[0].finish_reason)
        except Exception:  # the client has its reply; a store that fails must not take it back
            log.exception("could not store turn %d of session %r", continued.turn, session)
    return remember
