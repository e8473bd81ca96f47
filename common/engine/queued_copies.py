"""Host tensors copied to the device behind the work already queued there, without the host waiting for it.

On a GPU a copy from pageable host memory waits for everything queued on the stream before it starts: a step's
inputs prepared while the step before runs, or a kernel's argument made between two layers, would hold the host
until the device catches up. From pinned memory the copy is queued in stream order instead (torch's caching host
allocator keeps the pinned buffer until the copy is done). On the CPU it is a plain copy.
"""
from __future__ import annotations

import torch


def queued_copy(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` (a host tensor) on ``device``, queued behind the work before it on a GPU."""
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)
