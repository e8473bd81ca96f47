"""Which model version serves a request: the models the live workers serve, their promotion, canary and tokenizers.

A request's ``model`` names a model (``N``) or one of its versions (``N@V``); ``served_model_name`` is an alias of
the proxy's own model (``config.model``'s name; by default that name itself). ``choose`` turns it into a
``ModelChoice``:

    N@V -> that version, when a worker serves it
    N   -> a session's pinned version (below); else the canary version for its configured share of requests (a
           session always draws the same way), else the promoted version; with neither served, any served version
           of N (the oldest first)
    404 -> a name (or version) neither served, registered nor offered; 503 + Retry-After -> registered, offered
           or served before, but no live worker serves it now (loading, draining, scaled to zero)

A version no live worker serves but some worker offers (``standby_models``) is loaded on demand: the request that finds
it cold starts the load (``proxy.cluster.model_loading``), and it and the next ones get 503 with Retry-After until a
worker registers with it; ``N`` loads the promoted version where one is offered.

Promotion and canary come from the proxy's model registry (``common.storage.registry``, under the cache root),
read again whenever its state file changes, so the admin API of any proxy on the host, or ``tessera model
promote`` run offline, takes effect at once. A name with no registry state (an unregistered model directory) has
no promoted version: its oldest served version serves. Every request then keeps its version: the cluster routes its
prefill and decode to workers of that version only (``Cluster._candidates``).

Sessions (``X-Session-Id``, or ``user`` with ``session_from_user_field``): a session's first turn pins the version
it drew for ``session_pin_max_s``, across promotions and rollbacks, so a conversation never changes version mid-way.
Past that, or once no worker serves the pinned version, the next turn is chosen afresh and ``ModelChoice.moved_from``
names the version it left (the response says so in a header). ``pinned(name)`` counts each version's live pins:
draining an old version waits for them to end.

Tokenizers: a registered version's manifest names its files, and versions whose tokenizer.json hash the same share
one ``Tokenizer``; an unregistered version of the proxy's own model uses the proxy's; any other version the one its
workers' model directory holds, fetched from a worker by its hash (``proxy.cluster.tokenizer_fetch``: 503 + Retry-After
while it is) and shared by the versions whose tokenizer files hash the same.
"""
from __future__ import annotations

import hashlib
import logging
import os
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from common.storage.manifest import file_sha256
from common.storage.registry import ModelRegistry, RegistryError, State
from common.text.tokenizer import Tokenizer
from common.text.tokenizer_files import read_tokenizer_files, tokenizer_sha256
from proxy.core.errors import ApiError
from proxy.core.token_text import TokenText
from proxy.cluster.tokenizer_fetch import TokenizerFetcher
from proxy.core.workers import WorkerRegistry, WorkerState

log = logging.getLogger("tessera.proxy")
SESSION_HEADER = "x-session-id"  # the conversation: its turns keep one model version
MODEL_HEADER = "X-Tessera-Model"  # on every response: the model@version that served it
MOVED_HEADER = "X-Tessera-Session-Moved"  # the version a session was pinned to and left (no longer served)
MAX_PINS = 100_000  # sessions pinned at once; past it the oldest pin is dropped


@dataclass(frozen=True)
class ModelChoice:
    name: str
    version: str
    max_model_len: int  # the longest context every worker of the version accepts
    tokenizer: Tokenizer
    token_text: TokenText
    moved_from: str | None = None  # the version its session was pinned to, which no longer serves it

    @property
    def key(self) -> tuple[str, str]:
        return self.name, self.version


class ServedModels:
    def __init__(self, config, workers: WorkerRegistry, store: ModelRegistry, own: tuple[str, str],
                 tokenizer: Tokenizer, own_dir: Path, fetcher: TokenizerFetcher) -> None:
        """``own``: the (name, version) of ``config.model``, in ``own_dir``, whose tokenizer the proxy loaded as
        ``tokenizer``; ``fetcher``: the cluster's, for the tokenizers of versions neither that nor registered."""
        self.config = config
        self.workers = workers
        self.store = store
        self.fetcher = fetcher
        self.own_name = own[0]
        self.aliases = {config.served_model_name or own[0]: own[0]}
        self._own_text = (tokenizer, TokenText(tokenizer))
        self._texts: dict[str, tuple[Tokenizer, TokenText]] = {}  # tokenizer.json sha256 -> its tokenizer
        self._fetched: dict[str, tuple[Tokenizer, TokenText]] = {}  # tokenizer files' sha256 -> their tokenizer
        self._by_version: dict[tuple[str, str], tuple[Tokenizer, TokenText]] = {}
        if (own_dir / "tokenizer.json").is_file():
            self._texts[file_sha256(own_dir / "tokenizer.json")] = self._own_text
            self._fetched[tokenizer_sha256(read_tokenizer_files(own_dir))] = self._own_text
        self._states: dict[str, tuple[int, State]] = {}  # name -> (state file mtime, state)
        self._known: set[tuple[str, str]] = set()  # every version a worker served: 503 rather than 404 once gone
        self._pins: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()  # (name, session) -> pin
        self.draining: set[tuple[str, str]] = set()  # versions being drained (admin API): no new session goes there
        self.loader = None  # the cluster's ModelLoader: versions workers may load on demand (None: none)

    def served(self) -> dict[str, dict[str, list[WorkerState]]]:
        """name -> version -> its live workers; versions in the order their first worker registered."""
        served: dict[str, dict[str, list[WorkerState]]] = {}
        for worker in self.workers.workers.values():
            served.setdefault(worker.model, {}).setdefault(worker.model_version, []).append(worker)
            self._known.add((worker.model, worker.model_version))
        return served

    def _parse(self, requested: str) -> tuple[str, str]:
        """``N`` or ``N@V`` (or the alias) as (name, version); the version is empty for ``N``."""
        name, _, version = requested.partition("@")
        return self.aliases.get(name, name), version

    def check(self, requested: str) -> None:
        """404 unless ``requested`` names a model (or a version of one) that is served, registered or served before,
        or the proxy's own; asked before a request's other fields are, so that it is the first error."""
        name, version = self._parse(requested)
        served = self.served()
        known = self._known_now(name, version, served)
        if not known and self.loader is not None:  # versions workers offer to load count as served before
            self._known.update((n, v) for n, versions in self.loader.cold().items() for v in versions)
            known = self._known_now(name, version, served)
        if not known:
            names = sorted({*served, *(a for a, n in self.aliases.items() if n in served or n == self.own_name)})
            raise ApiError(404, f"model {requested!r} does not exist; this server serves "
                           f"{', '.join(map(repr, names)) or 'no model yet'}", code="model_not_found", param="model")

    def _known_now(self, name: str, version: str, served: dict) -> bool:
        if version:
            return (name, version) in self._known or (name in self.store.names()
                                                      and version in self.store.versions(name))
        return name in served or name == self.own_name or any(n == name for n, _ in self._known) \
            or name in self.store.names()

    def choose(self, requested: str, session: str | None = None) -> ModelChoice:
        """The version to serve ``requested`` (``check`` it first): 503 while no live worker serves it."""
        name, version = self._parse(requested)
        versions = self.served().get(name, {})
        # served: a decode-capable worker of the version takes work (a prefill worker alone cannot finish a
        # request; while the decode side still loads, the request gets the loading 503)
        live = {v: ws for v, ws in versions.items() if any(not w.draining and w.decode_capable for w in ws)}
        if version:
            if version not in live:
                self._unserved(requested, name, version)
            return self._choice(name, version, live[version])
        if not live:
            self._unserved(requested, name, None)
        now = time.monotonic()
        pin = self._pins.get((name, session)) if session is not None else None
        if pin is not None and pin[0] in live and now - pin[1] < self.config.sessions.session_pin_max_s:
            return self._choice(name, pin[0], live[pin[0]])
        state = self.state(name)
        fresh = [v for v in live if (name, v) not in self.draining] or list(live)  # for a new session: not draining
        chosen = state.promoted if state.promoted in live else fresh[0]
        canary = state.canary
        if canary is not None and canary.version in live and canary.version != chosen:
            if _draw(session) < canary.percent:
                chosen = canary.version
        if session is not None:
            self._pin(name, session, chosen, now)
        moved = pin[0] if pin is not None and pin[0] != chosen else None
        return self._choice(name, chosen, live[chosen], moved)

    def pin(self, requested: str, session: str, version: str, age_s: float) -> None:
        """Pin a session to ``version`` as its first turn did ``age_s`` ago (a conversation the store kept across a
        restart); nothing when that is past ``session_pin_max_s``."""
        if age_s < self.config.sessions.session_pin_max_s:
            self._pins[self._parse(requested)[0], session] = (version, time.monotonic() - max(age_s, 0.0))

    def pin_ends(self, name: str, version: str) -> float:
        """When (monotonic) the last session pinned to ``version`` of ``name`` stops being pinned; now if none."""
        now = time.monotonic()
        return max((since + self.config.sessions.session_pin_max_s for (n, _), (v, since) in self._pins.items()
                    if n == name and v == version), default=now)

    def pinned(self, name: str) -> dict[str, int]:
        """version -> sessions pinned to it now."""
        self._expire(time.monotonic())
        counts: dict[str, int] = {}
        for (pinned_name, _), (version, _) in self._pins.items():
            if pinned_name == name:
                counts[version] = counts.get(version, 0) + 1
        return counts

    def _pin(self, name: str, session: str, version: str, now: float) -> None:
        self._pins[name, session] = (version, now)
        self._pins.move_to_end((name, session))
        self._expire(now)
        while len(self._pins) > MAX_PINS:  # the oldest pins go first: their sessions choose afresh
            self._pins.popitem(last=False)

    def _expire(self, now: float) -> None:
        """Pins are kept in the order they were made: the expired ones are at the front."""
        while self._pins and now - next(iter(self._pins.values()))[1] >= self.config.sessions.session_pin_max_s:
            self._pins.popitem(last=False)

    def state(self, name: str) -> State:
        """The registry's promotion and canary of ``name``, read again when its state file changed."""
        path = self.store.root / name / "state.json"
        try:
            stamp = os.stat(path).st_mtime_ns
        except OSError:
            return State()
        cached = self._states.get(name)
        if cached is None or cached[0] != stamp:
            try:
                cached = self._states[name] = (stamp, self.store.state(name))
            except RegistryError as error:
                log.warning("model %s: its registry state cannot be read (%s); no promotion applies", name, error)
                return State()
        return cached[1]

    def listing(self) -> list[dict]:
        """``/v1/models``' entries: the alias of the proxy's model first, then every served model."""
        served = self.served()
        entries = []
        for alias, name in self.aliases.items():
            if alias != name or name not in served:  # listed before any worker serves it: clients look it up
                entries.append(self._entry(alias, name, served.get(name, {})))
        entries += [self._entry(name, name, versions) for name, versions in served.items()]
        cold = self.loader.cold() if self.loader is not None else {}
        listed = {entry["id"] for entry in entries}
        entries += [self._entry(name, name, {}) for name in cold if name not in listed]
        return entries

    def _entry(self, model_id: str, name: str, versions: dict[str, list[WorkerState]]) -> dict:
        state = self.state(name)
        canary = state.canary
        pins = self.pinned(name)
        return {"id": model_id, "object": "model", "owned_by": "tessera", "root": name,
                "max_model_len": min((w.max_model_len for ws in versions.values() for w in ws), default=None),
                "promoted_version": state.promoted if state.promoted in versions else next(iter(versions), None),
                "canary": {"version": canary.version, "percent": canary.percent} if canary else None,
                "versions": [{"version": v, "workers": len(ws), "draining": sum(w.draining for w in ws),
                              "max_model_len": min(w.max_model_len for w in ws), "pinned_sessions": pins.get(v, 0)}
                             for v, ws in versions.items()],
                "loadable_versions": self._loadable(name)}

    def _loadable(self, name: str) -> list[dict]:
        """The versions of ``name`` workers may load on demand: how many may, whether one is loading, and how long
        the last load took (seconds; None before one)."""
        if self.loader is None:
            return []
        loading = self.loader.loading_versions(name)
        return [{"version": v, "workers": n, "loading": v in loading,
                 "last_load_s": self.loader.load_s.get(f"{name}@{v}")}
                for v, n in sorted(self.loader.cold().get(name, {}).items())]

    def _choice(self, name: str, version: str, workers: list[WorkerState], moved_from: str | None = None
                ) -> ModelChoice:
        tokenizer, token_text = self._text(name, version, workers)
        if self.loader is not None:
            self.loader.chosen[name, version] = self.loader.clock()
        return ModelChoice(name, version, min(w.max_model_len for w in workers), tokenizer, token_text, moved_from)

    def _text(self, name: str, version: str, workers: list[WorkerState]) -> tuple[Tokenizer, TokenText]:
        """The version's tokenizer (``workers``: its live ones); looked up once (a version's files never change)."""
        text = self._by_version.get((name, version))
        if text is None:
            text = self._by_version[name, version] = self._load_text(name, version, workers)
        return text

    def _load_text(self, name: str, version: str, workers: list[WorkerState]) -> tuple[Tokenizer, TokenText]:
        try:
            manifest = self.store.manifest(name, version)
        except RegistryError:
            manifest = None
        if manifest is None or manifest.tokenizer.sha256 is None:
            if name == self.own_name:
                return self._own_text
            return self._workers_text(f"{name}@{version}", workers)
        text = self._texts.get(manifest.tokenizer.sha256)
        if text is None:
            tokenizer = Tokenizer(Path(manifest.source))
            text = self._texts[manifest.tokenizer.sha256] = (tokenizer, TokenText(tokenizer))
        return text

    def _workers_text(self, model: str, workers: list[WorkerState]) -> tuple[Tokenizer, TokenText]:
        """The tokenizer the version's workers reported the hash of (503 while it is fetched); a 503 that says to
        register it where none did (workers of protocol 14)."""
        digest = next((w.tokenizer_sha256 for w in workers if w.tokenizer_sha256), "")
        if not digest:
            raise ApiError(503, f"the proxy has no tokenizer for {model}: register that version in the proxy host's "
                           "model registry (tessera model register)", code="model_not_loaded", param="model",
                           retry_after_s=self.config.requests.retry_after_s)
        text = self._fetched.get(digest)
        if text is None:
            tokenizer = self.fetcher.tokenizer(model, digest, [w for w in workers if w.tokenizer_sha256 == digest])
            text = self._fetched[digest] = (tokenizer, TokenText(tokenizer))
        return text

    def _unserved(self, requested: str, name: str, version: str | None) -> None:
        self.check(requested)
        self._raise_if_loadable(name, version)
        raise ApiError(503, f"no worker serves model {requested!r} now (it is loading, draining or stopped); try "
                       "again", code="model_not_loaded", param="model", retry_after_s=self.config.requests.retry_after_s)

    def _raise_if_loadable(self, name: str, version: str | None) -> None:
        """The 503 of a version workers offer to load (a load started if need be); nothing when none offers it.
        ``version`` None: the promoted version where offered, else any offered."""
        if self.loader is None:
            return
        loadable = {*self.loader.cold().get(name, ()), *self.loader.loading_versions(name)}
        if version is None:
            promoted = self.state(name).promoted
            version = promoted if promoted in loadable else min(loadable, default=None)
        if version not in loadable:
            return
        retry_after_s = self.loader.want(f"{name}@{version}")
        if retry_after_s is None:
            raise ApiError(503, f"model {name}@{version} is not loaded, and every worker that may load it is busy "
                           "with its own model now (or served it within model_swap_min_idle_s); try again",
                           code="model_not_loaded", param="model", retry_after_s=self.config.requests.retry_after_s)
        raise ApiError(503, f"model {name}@{version} is loading; try again in {retry_after_s}s",
                       code="model_not_loaded", param="model", retry_after_s=retry_after_s)


def served_headers(choice) -> dict[str, str]:
    """``X-Tessera-Model: name@version``, and ``X-Tessera-Session-Moved`` when the session left its pinned version."""
    headers = {MODEL_HEADER: f"{choice.name}@{choice.version}"}
    if choice.moved_from is not None:
        headers[MOVED_HEADER] = f"{choice.name}@{choice.moved_from}"
    return headers


def session_of(services, headers, user: str | None) -> str | None:
    """The conversation a request belongs to: ``X-Session-Id``, else ``user`` with ``session_from_user_field``."""
    return headers.get(SESSION_HEADER) or (user if services.config.sessions.session_from_user_field else None)


def _draw(session: str | None) -> float:
    """A number in [0, 100): the same for every request of a session, else random."""
    if session is None:
        return random.random() * 100
    digest = hashlib.blake2b(session.encode(), digest_size=8, person=b"tessera-canary").digest()
    return int.from_bytes(digest, "little") % 10000 / 100
