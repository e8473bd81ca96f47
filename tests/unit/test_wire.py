"""Wire protocol: round trips, and rejection of everything malformed or out of range, naming the field."""
import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.protocol import wire
from common.protocol.sampling_params import SamplingParams
from common.protocol.wire import (
    PROTOCOL_VERSION, DecodeRequest, KVLayoutInfo, Peers, PeerInfo, PrefillDone, Register, TokenDelta, TokenDeltas,
    WireError,
    decode, encode,
)

SAMPLES = [
    Register("w1", "prefill", 123, "m", "v1", KVLayoutInfo(30, 16, 3, 64, "float32"), 100, 2048, "zmq", b"\x00meta"),
    Peers([PeerInfo("w1", 1, "nixl", b"abc")]),
    PrefillDone("r1", "w1", 5, 42, "he", [3, 4, 5], 16, logprob=-0.5, top_logprobs=[(42, -0.5), (7, -1.0)]),
    DecodeRequest("r1", [1, 2, 3], SamplingParams(temperature=0.0, stop=["\n"]), 9, first_token=4,
                  source_worker_id="w1", source_block_ids=[1]),
    TokenDeltas([TokenDelta("r1", [5, 6], "hi", finish_reason="stop", stop_reason="\n", logprobs=[-0.1, -0.2]),
                 TokenDelta("r2", [7], " a", top_logprobs=[[(7, -0.3), (8, -1.5)]])]),
    wire.Abort("r1"),
    wire.Reregister("w1", 123, "this proxy does not know worker 'w1' epoch 123"),
    wire.PrefillRequest("r2", [1, 2], SamplingParams(), 7, 30.0,
                        trace_context={"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}),
    wire.PrefillRequest("r3", [1, 2], SamplingParams(), 7, 30.0, cache_salt=2 ** 64 - 1),  # a salt is a uint64
    wire.Tune(512),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def _frames(msg_type, body, version=PROTOCOL_VERSION):
    return [bytes([msg_type, version]), msgpack.packb(body, use_bin_type=True)]


def _body(msg) -> dict:
    return msgpack.unpackb(encode(msg)[1])


def _decode_request(**changes) -> list[bytes]:
    body = _body(SAMPLES[3])
    params = changes.pop("params", {})
    body["params"].update(params)
    body.update(changes)
    return _frames(wire.MsgType.DECODE_REQUEST, body)


@pytest.mark.parametrize("frames, message", [
    ([b"\x0d"], "frame"),
    ([b"\x0d", b""], "2-byte header"),
    ([bytes([0xff, PROTOCOL_VERSION]), b""], "unknown message type"),
    ([bytes([wire.MsgType.ABORT, PROTOCOL_VERSION]), b"\xc1"], "not msgpack"),
    (_frames(wire.MsgType.ABORT, [1, 2]), "Expected `object`"),
    (_frames(wire.MsgType.ABORT, {"request_id": "r"}, version=1), "protocol version 1"),
    (_frames(wire.MsgType.ABORT, {}), "missing required field `request_id`"),
    (_frames(wire.MsgType.ABORT, {"request_id": 5}), r"Expected `str`, got `int` - at `\$.request_id`"),
    (_frames(wire.MsgType.ABORT, {"request_id": "r", "evil": 1}), "unknown field `evil`"),
    (_frames(wire.MsgType.REREGISTER, {"worker_id": "w1", "epoch": "1"}), r"Reregister: .* at `\$.epoch`"),
    (_frames(wire.MsgType.TOKEN_DELTAS, {"deltas": [{"request_id": "r", "token_ids": [1], "text": ""},
                                                    {"request_id": "s", "token_ids": [1, "x"], "text": ""}]}),
     r"\$.deltas\[1\].token_ids\[1\]"),
    (_frames(wire.MsgType.TOKEN_DELTAS, {"deltas": [{"request_id": "r", "token_ids": [True], "text": ""}]}),
     "got `bool`"),
    (_frames(wire.MsgType.TOKEN_DELTAS, {"deltas": {"request_id": "r"}}), r"\$.deltas"),
    (_decode_request(trace_context="00-abc"), "trace_context"),
    (_frames(wire.MsgType.REGISTER, {**_body(SAMPLES[0]), "kv_layout": {"num_layers": "x"}}), r"\$.kv_layout"),
    (_frames(wire.MsgType.REGISTER, {**_body(SAMPLES[0]), "role": "boss"}), r"\$.role"),
])
def test_malformed_frames_are_rejected_with_a_reason(frames, message):
    with pytest.raises(WireError, match=message):
        decode(frames)


@pytest.mark.parametrize("changes, where", [
    ({"params": {"top_k": 2 ** 40}}, "$.params.top_k"),
    ({"params": {"seed": -1}}, "$.params.seed"),
    ({"params": {"max_tokens": -5}}, "$.params.max_tokens"),
    ({"params": {"max_tokens": 2 ** 62}}, "$.params.max_tokens"),
    ({"params": {"top_p": 5.0}}, "$.params.top_p"),
    ({"params": {"temperature": -1.0}}, "$.params.temperature"),
    ({"params": {"logprobs": 1000}}, "$.params.logprobs"),
    ({"params": {"stop_token_ids": [-3]}}, "$.params.stop_token_ids[0]"),
    ({"params": {"speculative": "warp"}}, "$.params.speculative"),
    ({"params": {"n": 0}}, "$.params.n"),
    ({"params": {"stop": [""]}}, "$.params"),
    ({"params": {"unknown": 1}}, "$.params"),
    ({"prompt_token_ids": [-1]}, "$.prompt_token_ids[0]"),
    ({"prompt_token_ids": [2 ** 40]}, "$.prompt_token_ids[0]"),
    ({"seed": 2 ** 63}, "$.seed"),
    ({"source_block_ids": [-2]}, "$.source_block_ids[0]"),
    ({"first_token": 2 ** 31}, "$.first_token"),
    ({"priority": -1}, "$.priority"),
    ({"cache_salt": -1}, "$.cache_salt"),
])
def test_out_of_range_values_are_refused_naming_the_field(changes, where):
    with pytest.raises(WireError) as caught:
        decode(_decode_request(**changes))
    assert f"`{where}`" in str(caught.value)


def test_integers_beyond_64_bits_are_refused():
    body = _body(SAMPLES[3])
    raw = msgpack.packb(body)
    # msgpack cannot carry 2**64 or more: the largest it can is uint64, which is still out of int64 bounds.
    body["seed"] = 2 ** 64 - 1
    with pytest.raises(WireError, match=r"\$.seed"):
        decode([bytes([wire.MsgType.DECODE_REQUEST, PROTOCOL_VERSION]), msgpack.packb(body)])
    assert decode([bytes([wire.MsgType.DECODE_REQUEST, PROTOCOL_VERSION]), raw]) == SAMPLES[3]


def test_ints_are_accepted_where_floats_are_declared():
    frames = _frames(wire.MsgType.PREFILL_REQUEST, {
        "request_id": "r", "prompt_token_ids": [1], "params": {}, "seed": 1, "lease_s": 30,
    })
    assert decode(frames).lease_s == 30.0


def test_sampling_params_travel_as_a_typed_struct():
    msg = decode(_decode_request(params={"top_k": -1}))
    assert isinstance(msg.params, SamplingParams)
    assert msg.params.top_k == 0  # normalised on arrival as when built
    assert SamplingParams(stop="\n").stop == ["\n"]


_json = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2 ** 63), max_value=2 ** 64 - 1) | st.floats(allow_subnormal=False)
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=20,
)
_field_names = st.sampled_from(sorted({name for cls in wire.MESSAGES.values() for name in cls.__struct_fields__}
                                      | set(SamplingParams.__struct_fields__)))


@settings(max_examples=400, deadline=None)
@given(kind=st.sampled_from(list(wire.MsgType)), base=st.sampled_from(SAMPLES),
       edits=st.dictionaries(_field_names, _json, max_size=4))
def test_any_body_decodes_to_a_valid_message_or_a_wire_error(kind, base, edits):
    body = {**_body(base), **edits}
    try:
        msg = decode(_frames(kind, body))
    except WireError:
        return
    assert type(msg) is wire.MESSAGES[kind]
    assert decode(encode(msg)) == msg  # what was accepted is a well-formed message


def test_a_refused_request_names_its_id_when_it_can_be_read():
    frames = _decode_request(params={"top_p": 0.0})
    with pytest.raises(WireError):
        decode(frames)
    assert wire.refused_request_id(frames) == decode(_decode_request()).request_id
    header = frames[0]
    for malformed in ([header, b"\xf6\xff"], [header, msgpack.packb({"request_id": 5})], [header],
                      [bytes([wire.MsgType.HEARTBEAT, wire.PROTOCOL_VERSION]), frames[1]]):
        assert wire.refused_request_id(malformed) is None


def test_a_string_that_is_not_utf8_is_a_wire_error():
    """msgspec raises UnicodeDecodeError, not DecodeError, for such a str: a worker's I/O thread once died of it."""
    body = b"\x81\xaarequest_id\xa2\xba\xba"  # {"request_id": <2 bytes that are no UTF-8>}
    with pytest.raises(wire.WireError, match="not msgpack"):
        wire.decode([bytes([wire.MsgType.EMBED_REQUEST, wire.PROTOCOL_VERSION]), body])


def test_embedding_messages_round_trip_and_bound_their_token_ids():
    request = wire.EmbedRequest("embd-1", [[1, 2, 3], [4]])
    assert wire.decode(wire.encode(request)) == request
    result = wire.EmbedResult("embd-1", "w", 2, b"\0" * 16, 4)
    assert wire.decode(wire.encode(result)) == result
    with pytest.raises(wire.WireError, match=r"inputs\[0\]\[0\]"):
        wire.decode([bytes([wire.MsgType.EMBED_REQUEST, wire.PROTOCOL_VERSION]),
                     msgpack.packb({"request_id": "x", "inputs": [[-1]]})])


def test_a_message_for_the_previous_version_leaves_out_what_that_version_lacks(monkeypatch):
    from common.protocol import versions
    request = wire.PrefillRequest("r1", [1, 2], SamplingParams(), 7, 30.0, cache_salt=5)
    frames = wire.encode(request, PROTOCOL_VERSION - 1)
    assert wire.frame_version(frames) == PROTOCOL_VERSION - 1 and wire.decode(frames) == request
    register = wire.Register("w", "decode", 1, "m", "v1", wire.KVLayoutInfo(2, 16, 3, 64, "float32"), 8, 512, "zmq",
                             b"", kv_events_endpoint="tcp://127.0.0.1:7000")
    monkeypatch.setitem(versions.FIELD_SINCE["Register"], "kv_events_endpoint", PROTOCOL_VERSION)  # as in its 19
    older_register = wire.encode(register, PROTOCOL_VERSION - 1)
    assert "kv_events_endpoint" not in msgpack.unpackb(older_register[1])
    assert wire.decode(older_register) == msgspec.structs.replace(register, kv_events_endpoint="")  # its default
    monkeypatch.setitem(versions.FIELD_SINCE, "PrefillRequest", {"cache_salt": PROTOCOL_VERSION})
    older = wire.encode(request, PROTOCOL_VERSION - 1)
    assert "cache_salt" not in msgpack.unpackb(older[1]) and wire.decode(older).cache_salt == 0  # its default
    assert wire.encode(request)[1] == encode(request)[1]  # this version's own: every field
    with pytest.raises(WireError, match="not in protocol version"):
        wire.encode(wire.LoadModel("w", "m@v2"), 11)  # new in 12


def test_a_newer_peers_fields_are_dropped_and_versions_two_apart_are_refused():
    delta = {"request_id": "r", "token_ids": [5], "text": "a", "from_the_future": 1}
    body = msgpack.packb({"deltas": [delta], "also_new": {"x": 1}})
    newer = [bytes([wire.MsgType.TOKEN_DELTAS, PROTOCOL_VERSION + 1]), body]
    assert wire.decode(newer) == TokenDeltas([TokenDelta("r", [5], "a")])
    with pytest.raises(WireError, match="token_ids"):  # the fields it knows are checked as ever
        delta["token_ids"] = [-1]
        wire.decode([newer[0], msgpack.packb({"deltas": [delta]})])
    for version in (PROTOCOL_VERSION - 2, PROTOCOL_VERSION + 2):
        with pytest.raises(WireError, match=f"protocol version {version}"):
            wire.decode([bytes([wire.MsgType.ABORT, version]), msgpack.packb({"request_id": "r"})])
    with pytest.raises(WireError, match="unknown field"):  # this version's own frames stay strict
        wire.decode([bytes([wire.MsgType.ABORT, PROTOCOL_VERSION]), msgpack.packb({"request_id": "r", "x": 1})])
