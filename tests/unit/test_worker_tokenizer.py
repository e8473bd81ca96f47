"""A model directory the proxy was never given serves at once: the proxy fetches its tokenizer from a worker.

The hash over a directory's tokenizer files (common/text/tokenizer_files.py), the FetchTokenizer and TokenizerFiles
messages and their bounds, the worker's answer on its I/O thread (common/runtime/registration.py, worker_io.py), and the
proxy's side (proxy/cluster/tokenizer_fetch.py through proxy/cluster/served_models.py): one fetch per tokenizer, checked
by hash, kept under the cache root, asked of another worker after ``tokenizer_fetch_timeout_s``. Times are given, never
measured.
"""
from __future__ import annotations

import shutil
import time
from types import SimpleNamespace

import msgpack
import pytest
import zmq

from common.config.roles import ProxyConfig, WorkerConfig
from common.protocol import wire
from common.protocol.versions import MESSAGE_SINCE
from common.runtime.registration import tokenizer_answer, tokenizer_digest
from common.runtime.telemetry import WorkerMetrics
from common.runtime.worker_io import WorkerIO
from common.storage.registry import ModelRegistry
from common.text.tokenizer import Tokenizer
from common.text.tokenizer_files import TOKENIZER_FILES, read_tokenizer_files, tokenizer_sha256
from proxy.core.errors import ApiError
from proxy.core.metrics import ProxyMetrics
from proxy.cluster.served_models import ServedModels
from proxy.cluster.tokenizer_fetch import TokenizerFetcher
from proxy.core.workers import WorkerRegistry

LAYOUT = wire.KVLayoutInfo(2, 16, 2, 8, "float32")
TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}<<assistant>>"
TIMEOUT_S = 30.0
CHAT = [{"role": "user", "content": "hi"}]


def tokenizer_dir(path, source, template: str = TEMPLATE):
    """The tokenizer files of ``source`` with a chat template of their own, and a file Tokenizer does not read."""
    path.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    (path / "chat_template.jinja").write_text(template)
    (path / "README.md").write_text("not a tokenizer file")
    return path


@pytest.fixture
def worker_dir(tmp_path, embedded_model_dir):
    return tokenizer_dir(tmp_path / "rand1b", embedded_model_dir)


def register(worker_id: str, model: str, digest: str) -> wire.Register:
    name, _, version = model.partition("@")
    return wire.Register(worker_id, "both", 1, name, version, LAYOUT, 64, 512, "zmq", b"", max_num_seqs=8,
                         tokenizer_sha256=digest)


class Proxy:
    """ServedModels and the fetcher over a real WorkerRegistry, as the cluster wires them; what is sent is kept."""

    def __init__(self, cache, own_dir) -> None:
        self.now = 100.0
        self.config = ProxyConfig(served_model_name="", tokenizer_fetch_timeout_s=TIMEOUT_S,
                                  requests={"retry_after_s": 2}, sessions={"session_pin_max_s": 60.0})
        self.registry = WorkerRegistry(10.0)
        self.sent: list[tuple[str, object]] = []
        self.metrics = ProxyMetrics()
        self.versions: dict[str, int] = {}
        self.fetcher = TokenizerFetcher(self.config, lambda w, m: self.sent.append((w, m)), self.metrics,
                                        self.versions, cache, clock=lambda: self.now)
        self.models = ServedModels(self.config, self.registry, ModelRegistry(cache / "registry"),
                                   ("SmolLM2-135M-Instruct", "own"), Tokenizer(own_dir), own_dir, self.fetcher)

    def join(self, msg: wire.Register, version: int = wire.PROTOCOL_VERSION) -> None:
        assert self.registry.register(msg, self.now).ack.accepted
        self.versions[msg.worker_id] = version

    def refused(self, model: str) -> ApiError:
        with pytest.raises(ApiError) as raised:
            self.models.choose(model)
        assert raised.value.status == 503 and raised.value.retry_after_s == 2
        return raised.value

    def fetches(self) -> list[tuple[str, str]]:
        return [(w, m.sha256) for w, m in self.sent if isinstance(m, wire.FetchTokenizer)]

    def answer(self, worker_id: str, files: dict[str, bytes], digest: str | None = None) -> None:
        msg = wire.TokenizerFiles(worker_id, digest or tokenizer_sha256(files), files)
        self.fetcher.on_files(worker_id, wire.decode(wire.encode(msg)), self.now)


# -- the hash --------------------------------------------------------------------------------------------------


def test_the_hash_covers_what_the_tokenizer_reads_and_changes_with_any_of_it(tmp_path, worker_dir):
    files = read_tokenizer_files(worker_dir)
    assert set(files) == set(TOKENIZER_FILES) & {p.name for p in worker_dir.iterdir()} and "README.md" not in files
    digest = tokenizer_sha256(files)
    assert digest == tokenizer_sha256(dict(reversed(files.items())))  # name order, whatever the dict's
    assert digest == tokenizer_sha256(read_tokenizer_files(worker_dir))
    (worker_dir / "README.md").write_text("changed")
    assert tokenizer_sha256(read_tokenizer_files(worker_dir)) == digest  # not a tokenizer file
    (worker_dir / "chat_template.jinja").write_text(TEMPLATE + " ")
    assert tokenizer_sha256(read_tokenizer_files(worker_dir)) != digest
    assert tokenizer_sha256({"a": b"bc"}) != tokenizer_sha256({"ab": b"c"})  # names and bytes do not run together
    # A tokenizer loaded from those files alone is the one loaded from the whole directory.
    only = tmp_path / "only"
    only.mkdir()
    for name, content in read_tokenizer_files(worker_dir).items():
        (only / name).write_bytes(content)
    whole, alone = Tokenizer(worker_dir), Tokenizer(only)
    assert (alone.chat_template, alone.eos_token_ids, alone.special_tokens, alone.vocab_size) == \
        (whole.chat_template, whole.eos_token_ids, whole.special_tokens, whole.vocab_size)
    assert alone.apply_chat_template(CHAT) == whole.apply_chat_template(CHAT)


# -- the messages ----------------------------------------------------------------------------------------------


def frames(kind: wire.MsgType, body: dict) -> list[bytes]:
    return [bytes([kind, wire.PROTOCOL_VERSION]), msgpack.packb(body)]


def test_the_messages_round_trip_and_refuse_what_is_out_of_bounds():
    asked = wire.FetchTokenizer("w0", "ab" * 32)
    sent = wire.TokenizerFiles("w0", "ab" * 32, {"tokenizer.json": b"{}", "tokenizer_config.json": b"{}"})
    assert wire.decode(wire.encode(asked)) == asked and wire.decode(wire.encode(sent)) == sent
    body = {"worker_id": "w0", "sha256": "ab" * 32}
    for files, why in [({"../tokenizer.json": b""}, r"\$.files"), ({"a/b": b""}, r"\$.files"), ({}, "length"),
                       ({f"f{i}": b"" for i in range(wire.TOKENIZER_MAX_FILES + 1)}, "length"),
                       ({"a": b"x" * (wire.TOKENIZER_MAX_BYTES + 1)}, "length"),
                       ({"a": b"x" * (wire.TOKENIZER_MAX_BYTES // 2 + 1), "b": b"y" * (wire.TOKENIZER_MAX_BYTES // 2)},
                        "in all")]:
        with pytest.raises(wire.WireError, match=why):
            wire.decode(frames(wire.MsgType.TOKENIZER_FILES, {**body, "files": files}))
    for digest in ("AB" * 32, "ab" * 31, ""):
        with pytest.raises(wire.WireError, match="sha256"):
            wire.decode(frames(wire.MsgType.FETCH_TOKENIZER, {**body, "sha256": digest}))
    with pytest.raises(wire.WireError, match="tokenizer_sha256"):
        wire.decode(wire.encode(register("w0", "m@v", "not a hash")))


def test_a_peer_of_the_version_before_is_never_sent_them(tmp_path, embedded_model_dir, worker_dir):
    older = MESSAGE_SINCE["FetchTokenizer"] - 1
    with pytest.raises(wire.WireError, match="not in protocol version"):
        wire.encode(wire.FetchTokenizer("w0", "ab" * 32), older)
    digest = tokenizer_sha256(read_tokenizer_files(worker_dir))
    assert tokenizer_answer(worker_dir, wire.FetchTokenizer("w0", digest), "w0", older) is None
    proxy = Proxy(tmp_path / "cache", embedded_model_dir)
    proxy.join(register("old", "rand1b@d1", digest), version=older)
    assert "none of its workers speaks" in proxy.refused("rand1b").message
    assert proxy.sent == []


# -- the worker ------------------------------------------------------------------------------------------------


def test_the_worker_answers_with_its_files_only_when_they_are_those_asked_for(worker_dir):
    digest = tokenizer_digest(read_tokenizer_files(worker_dir))
    answer = tokenizer_answer(worker_dir, wire.FetchTokenizer("w0", digest), "w0", wire.PROTOCOL_VERSION)
    assert answer == wire.TokenizerFiles("w0", digest, read_tokenizer_files(worker_dir))
    assert tokenizer_answer(worker_dir, wire.FetchTokenizer("w0", "ab" * 32), "w0", wire.PROTOCOL_VERSION) is None
    assert tokenizer_answer(worker_dir / "gone", wire.FetchTokenizer("w0", digest), "w0", wire.PROTOCOL_VERSION) \
        is None
    assert tokenizer_digest({"tokenizer.json": b"x" * (wire.TOKENIZER_MAX_BYTES + 1)}) == ""  # too big to send


def test_the_io_thread_answers_a_fetch(worker_dir):
    context = zmq.Context()
    proxy = context.socket(zmq.ROUTER)
    port = proxy.bind_to_random_port("tcp://127.0.0.1")
    config = WorkerConfig(worker_id="w0", role="both", heartbeat_interval_s=0.05,
                          proxy_address=f"tcp://127.0.0.1:{port}", register_timeout_s=5)
    digest = tokenizer_digest(read_tokenizer_files(worker_dir))
    io = WorkerIO(config, register("w0", "rand1b@d1", digest), WorkerMetrics(config), worker_dir)
    io._thread.start()

    def receive(kind: type):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if proxy.poll(50):
                _, *got = proxy.recv_multipart()
                if isinstance(msg := wire.decode(got), kind):
                    return msg
        raise TimeoutError(f"no {kind.__name__} within 5 s")

    try:
        assert receive(wire.Register).tokenizer_sha256 == digest
        proxy.send_multipart([b"w0", *wire.encode(wire.RegisterAck("w0", True))])
        proxy.send_multipart([b"w0", *wire.encode(wire.FetchTokenizer("w0", digest))])
        sent = receive(wire.TokenizerFiles)
        assert sent.sha256 == digest and tokenizer_sha256(sent.files) == digest
        assert io.inbox.empty()  # the compute loop never saw it
    finally:
        io.stop("test over")
        proxy.close(0)
        context.term()


# -- the proxy -------------------------------------------------------------------------------------------------


def test_the_proxy_fetches_a_tokenizer_once_and_serves_every_version_of_that_hash_with_it(
        tmp_path, embedded_model_dir, worker_dir):
    proxy = Proxy(tmp_path / "cache", embedded_model_dir)
    files = read_tokenizer_files(worker_dir)
    digest = tokenizer_sha256(files)
    proxy.join(register("w0", "rand1b@d1", digest))
    proxy.join(register("w1", "rand1b@d2", digest))
    for requested in ("rand1b@d1", "rand1b@d1", "rand1b@d2"):
        assert "being fetched from worker 'w0'" in proxy.refused(requested).message
    assert proxy.fetches() == [("w0", digest)]  # once, not per request nor per version
    proxy.answer("w0", files)
    kept = tmp_path / "cache" / "tokenizers" / digest
    assert read_tokenizer_files(kept) == files and sorted(p.name for p in kept.parent.iterdir()) == [digest]
    first, second = proxy.models.choose("rand1b@d1"), proxy.models.choose("rand1b@d2")
    assert first.tokenizer is second.tokenizer and first.tokenizer.chat_template == TEMPLATE
    assert first.tokenizer.apply_chat_template(CHAT) == Tokenizer(worker_dir).apply_chat_template(CHAT)
    assert proxy.fetches() == [("w0", digest)]


def test_the_proxys_own_tokenizer_and_a_worker_of_protocol_14_need_no_fetch(tmp_path, embedded_model_dir):
    proxy = Proxy(tmp_path / "cache", embedded_model_dir)
    proxy.join(register("same", "copy@d1", tokenizer_sha256(read_tokenizer_files(embedded_model_dir))))
    proxy.join(register("old", "rand1b@d1", ""), version=14)
    assert proxy.models.choose("copy").tokenizer is proxy.models._own_text[0]  # the same files: the proxy's own
    assert "register that version in the proxy host's model registry" in proxy.refused("rand1b").message
    assert proxy.sent == []


def test_files_that_do_not_hash_to_what_was_asked_are_dropped_and_another_worker_is_asked(
        tmp_path, embedded_model_dir, worker_dir):
    proxy = Proxy(tmp_path / "cache", embedded_model_dir)
    files = read_tokenizer_files(worker_dir)
    digest = tokenizer_sha256(files)
    proxy.join(register("w0", "rand1b@d1", digest))
    proxy.join(register("w1", "rand1b@d1", digest))
    proxy.refused("rand1b")
    proxy.answer("w0", {**files, "chat_template.jinja": b"tampered"}, digest)
    assert proxy.metrics.malformed_messages._value.get() == 1
    assert not (tmp_path / "cache" / "tokenizers" / digest).exists()
    assert "being fetched from worker 'w1'" in proxy.refused("rand1b").message
    assert proxy.fetches() == [("w0", digest), ("w1", digest)]


def test_a_worker_that_does_not_answer_in_time_is_given_up_for_another(tmp_path, embedded_model_dir, worker_dir):
    proxy = Proxy(tmp_path / "cache", embedded_model_dir)
    digest = tokenizer_sha256(read_tokenizer_files(worker_dir))
    proxy.join(register("w0", "rand1b@d1", digest))
    proxy.join(register("w1", "rand1b@d1", digest))
    proxy.refused("rand1b")
    proxy.now += TIMEOUT_S
    assert "worker 'w0'" in proxy.refused("rand1b").message  # still within tokenizer_fetch_timeout_s
    proxy.now += 0.1
    assert "worker 'w1'" in proxy.refused("rand1b").message
    proxy.now += TIMEOUT_S + 0.1
    assert "worker 'w0'" in proxy.refused("rand1b").message  # each in turn
    assert proxy.fetches() == [("w0", digest), ("w1", digest), ("w0", digest)]
    proxy.answer("w1", read_tokenizer_files(worker_dir))  # a late answer is as good
    assert proxy.models.choose("rand1b").tokenizer.chat_template == TEMPLATE


def test_a_restarted_proxy_reads_the_kept_tokenizer_without_a_fetch(tmp_path, embedded_model_dir, worker_dir):
    files = read_tokenizer_files(worker_dir)
    digest = tokenizer_sha256(files)
    first = Proxy(tmp_path / "cache", embedded_model_dir)
    first.join(register("w0", "rand1b@d1", digest))
    first.refused("rand1b")
    first.answer("w0", files)
    again = Proxy(tmp_path / "cache", embedded_model_dir)
    again.join(register("w0", "rand1b@d1", digest))
    assert again.models.choose("rand1b").tokenizer.chat_template == TEMPLATE and again.sent == []
    # Files changed under the cache root no longer hash to their directory's name: fetched anew.
    (tmp_path / "cache" / "tokenizers" / digest / "chat_template.jinja").write_text("changed")
    third = Proxy(tmp_path / "cache", embedded_model_dir)
    third.join(register("w0", "rand1b@d1", digest))
    third.refused("rand1b")
    assert third.fetches() == [("w0", digest)] and not (tmp_path / "cache" / "tokenizers" / digest).exists()
