"""Which attention backend and block size a worker serves with (common/engine/attention.py)."""
import logging

import pytest
import torch

from common.engine.attention import FLASH_BLOCK_SIZE, block_size_for, select_backend


def test_auto_on_a_gpu_with_flash_attn_takes_its_block_size_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="common.engine.attention"):
        assert block_size_for("auto", "cuda", 16, 2048, flash_attn=True) == FLASH_BLOCK_SIZE
    assert "engine.block_size 16 -> 256" in caplog.text


@pytest.mark.parametrize("backend, device, block_size, budget, flash", [
    ("auto", "cuda", 16, 2048, False),  # no flash-attn: the Triton kernel takes any block size
    ("triton", "cuda", 16, 2048, True),  # named backend: the configured size stays
    ("auto", "cpu", 16, 2048, True),
    ("auto", "cuda", 16, 128, True),  # a step's budget under one 256-token block
    ("auto", "cuda", 256, 2048, True),
])
def test_block_size_stays_otherwise(backend, device, block_size, budget, flash):
    assert block_size_for(backend, device, block_size, budget, flash_attn=flash) == block_size


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_triton_backend_named_without_a_gpu_is_refused():
    with pytest.raises(RuntimeError, match="attention_backend 'triton' needs a CUDA GPU"):
        select_backend("triton", "cpu", 16)
