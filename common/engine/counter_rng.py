"""Counter-based uniforms: u = f(seed, counter, column), no generator state.

A stateful generator makes a row's draw depend on how many numbers its batch
neighbours consumed before it. Hashing the coordinates instead gives every
(seed, generation index, column) its own fixed uniform, on any device and in
any batch layout, which is what reproducible seeded sampling and speculative
decoding's re-draws need (the sampler's draw reads a column a token and one a
block of tokens, after the vocabulary; speculative decoding's acceptance test
the column right after the tokens').

The hash is SplitMix64 (Steele et al., 2014): the row key is the mixed
(seed, counter) pair, and column c reads the (c + 1)-th output of the
SplitMix64 stream started at that key. Torch has no unsigned 64-bit shifts, so
the arithmetic runs on int64 with two's-complement wrap-around and logical
right shifts are arithmetic shifts with the sign bits masked off.
``counter_uniforms`` gives float32 uniforms of 23 bits over many columns (the
sampler's race); ``counter_uniform64`` one float64 uniform of 52 bits per row
(speculative decoding's acceptance test).
"""
from __future__ import annotations

import torch

_GAMMA = 0x9E3779B97F4A7C15
_MIX_1 = 0xBF58476D1CE4E5B9
_MIX_2 = 0x94D049BB133111EB
# u = (k + 0.5) / 2**23 for a 23-bit k: k + 0.5 needs 24 significant bits,
# exactly float32's, so u is exact and never rounds to 0 or 1 (E = -log u > 0).
_UNIFORM_BITS = 23
_UNIFORM64_BITS = 52


def as_int64(value: int) -> int:
    """Any Python int as the signed int64 with the same low 64 bits."""
    return (value + 2**63) % 2**64 - 2**63


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 viewed as uint64."""
    return (z >> bits).bitwise_and_((1 << (64 - bits)) - 1)


def _mix_rounds(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's first two xor-shift-multiply rounds, in place on z."""
    z ^= _shift_right(z, 30)
    z *= as_int64(_MIX_1)
    z ^= _shift_right(z, 27)
    z *= as_int64(_MIX_2)
    return z


def _mix64(z: torch.Tensor) -> torch.Tensor:
    z = _mix_rounds(z.clone())
    return z ^ _shift_right(z, 31)


def counter_uniforms(
    seeds: torch.Tensor, counters: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    """Uniforms in (0, 1), float32, shape [len(seeds), m].

    seeds, counters: int64 [n] (one pair per row); columns: int64 [m] (the same columns for every row) or
    [n, m] (each row's own).
    """
    column_steps = (columns.long() + 1) * as_int64(_GAMMA)
    z = _mix_rounds(_row_keys(seeds, counters)[:, None]
                    + (column_steps if column_steps.dim() == 2 else column_steps[None, :]))
    # SplitMix64's last step, z ^ (z >> 31), leaves the top 31 bits unchanged,
    # so the top 23 can be read before it.
    top = _shift_right(z, 64 - _UNIFORM_BITS)
    return top.float().add_(0.5).mul_(2.0**-_UNIFORM_BITS)


def counter_uniform64(seeds: torch.Tensor, counters: torch.Tensor, column: int) -> torch.Tensor:
    """One uniform in (0, 1) per row, float64 [len(seeds)]: the top 52 bits of the row's whole SplitMix64 output
    at ``column``. (k + 0.5) / 2**52 for a 52-bit k needs 53 significant bits, float64's, so u is exact and never
    0 or 1."""
    z = _mix64(_row_keys(seeds, counters) + as_int64((column + 1) * _GAMMA))
    return _shift_right(z, 64 - _UNIFORM64_BITS).double().add_(0.5).mul_(2.0**-_UNIFORM64_BITS)


def _row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    return _mix64(_mix64(seeds.long()) + (counters.long() + 1) * as_int64(_GAMMA))
