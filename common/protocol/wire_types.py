"""The types every wire message is built of: the base struct (unknown fields refused) and bounded scalars.

Declared apart from ``wire.py`` so that the messages that do not ride one request's way (``control.py``)
can share them; ``wire.py`` re-exports what its users import from it.
"""
from __future__ import annotations

from typing import Annotated

import msgspec

from common.protocol.sampling_params import INT64_MAX, TOKEN_ID_MAX

NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=TOKEN_ID_MAX)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0)]
TopLogprobs = list[tuple[TokenId, float]]  # [(token_id, logprob), ...]
Coefficient = Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]  # also refuses NaN
# The root of a request's block hashes (0: unsalted), a uint64: msgpack carries no larger int, and msgspec bounds
# only int64 ranges.
CacheSalt = Annotated[int, msgspec.Meta(ge=0)]


class WireError(ValueError):
    """A frame that is not a valid message of this protocol version."""


class _Struct(msgspec.Struct, forbid_unknown_fields=True):
    """Every message and part of one: unknown fields are refused."""
