"""Wire protocol: round trips and rejection of everything malformed."""
import msgpack
import pytest

from common.protocol import wire
from common.protocol.wire import (
    DecodeRequest, KVLayoutInfo, Peers, PeerInfo, PrefillDone, Register, TokenDelta, WireError, decode, encode,
)

SAMPLES = [
    Register("w1", "prefill", 123, "m", "v1", KVLayoutInfo(30, 16, 3, 64, "float32"), 100, 2048, "zmq", b"\x00meta"),
    Peers([PeerInfo("w1", 1, "nixl", b"abc")]),
    PrefillDone("r1", "w1", 5, 42, "he", [3, 4, 5], 16, logprob=-0.5, top_logprobs=[[42, -0.5], [7, -1.0]]),
    DecodeRequest("r1", [1, 2, 3], {"temperature": 0.0}, 9, first_token=4, source_worker_id="w1", source_block_ids=[1]),
    TokenDelta("r1", [5, 6], "hi", finish_reason="stop", stop_reason="\n", logprobs=[-0.1, -0.2]),
    wire.Abort("r1"),
    wire.Reregister("w1", 123, "this proxy does not know worker 'w1' epoch 123"),
    wire.PrefillRequest("r2", [1, 2], {}, 7, 30.0,
                        trace_context={"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def _frames(type_byte, body):
    return [bytes([type_byte]), msgpack.packb(body, use_bin_type=True)]


@pytest.mark.parametrize("frames, message", [
    ([b"\x0d"], "frame"),
    ([b"\xff", b""], "unknown message type"),
    ([bytes([wire.MsgType.ABORT]), b"\xc1"], "not msgpack"),
    (_frames(wire.MsgType.ABORT, [1, 2]), "not a map"),
    (_frames(wire.MsgType.ABORT, {"request_id": "r"}), "protocol version"),
    (_frames(wire.MsgType.ABORT, {"v": 99, "request_id": "r"}), "protocol version"),
    (_frames(wire.MsgType.ABORT, {"v": 1}), "missing field 'request_id'"),
    (_frames(wire.MsgType.ABORT, {"v": 1, "request_id": 5}), "expected str"),
    (_frames(wire.MsgType.ABORT, {"v": 1, "request_id": "r", "evil": 1}), "unknown fields"),
    (_frames(wire.MsgType.REREGISTER, {"v": 1, "worker_id": "w1", "epoch": "1"}), r"Reregister.epoch"),
    (_frames(wire.MsgType.TOKEN_DELTA, {"v": 1, "request_id": "r", "token_ids": [1, "x"], "text": ""}), r"token_ids\[\]"),
    (_frames(wire.MsgType.TOKEN_DELTA, {"v": 1, "request_id": "r", "token_ids": [True], "text": ""}), "bool"),
    (_frames(wire.MsgType.DECODE_REQUEST, {"v": 1, "request_id": "r", "prompt_token_ids": [1], "params": {},
                                           "seed": 1, "trace_context": "00-abc"}), "trace_context"),
    (_frames(wire.MsgType.REGISTER, {**{k: v for k, v in msgpack.unpackb(encode(SAMPLES[0])[1]).items()},
                                     "kv_layout": {"num_layers": "x"}}), "kv_layout"),
])
def test_malformed_frames_are_rejected_with_a_reason(frames, message):
    with pytest.raises(WireError, match=message):
        decode(frames)


def test_ints_are_accepted_where_floats_are_declared():
    frames = _frames(wire.MsgType.PREFILL_REQUEST, {
        "v": 1, "request_id": "r", "prompt_token_ids": [1], "params": {}, "seed": 1, "lease_s": 30,
    })
    assert decode(frames).lease_s == 30.0
