"""A worker's interconnect domain (``common/runtime/topology.py``): the NVLink fabric NVML reports for its GPU, or
none. The NVML call itself needs a GPU in a fabric and runs only there."""
from __future__ import annotations

import ctypes

import pytest
import torch

from common.runtime.topology import FABRIC_STATE_COMPLETED, NVML_SUCCESS, fabric_name, interconnect_domain


class FabricInfo(ctypes.Structure):
    """NVML's ``nvmlGpuFabricInfo_t``, as nvidia-ml-py declares it."""
    _fields_ = [("clusterUuid", ctypes.c_uint8 * 16), ("status", ctypes.c_uint), ("cliqueId", ctypes.c_uint32),
                ("state", ctypes.c_uint)]


def info(uuid: bytes, state: int = FABRIC_STATE_COMPLETED, status: int = NVML_SUCCESS, clique: int = 7) -> FabricInfo:
    return FabricInfo((ctypes.c_uint8 * 16)(*uuid), status, clique, state)


def test_a_completed_registration_names_its_cluster_and_clique_even_with_zero_bytes_in_the_uuid():
    uuid = bytes([0, 1, 0, 2] * 4)
    assert fabric_name(info(uuid)) == f"nvlink:{uuid.hex()}:7"
    assert fabric_name(info(uuid, clique=8)) != fabric_name(info(uuid))  # another clique: another domain


def test_no_domain_before_the_registration_completes_or_when_it_failed_or_without_a_cluster():
    uuid = bytes(range(1, 17))
    assert fabric_name(info(uuid, state=2)) == ""  # in progress
    assert fabric_name(info(uuid, status=3)) == ""  # NVML_ERROR_NOT_SUPPORTED
    assert fabric_name(info(bytes(16))) == ""


def test_a_cpu_worker_is_in_no_fabric():
    assert interconnect_domain(torch.device("cpu")) == ""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NVML answers for one)")
def test_a_gpu_answers_with_a_fabric_or_none_and_never_fails():
    domain = interconnect_domain(torch.device("cuda", 0))
    assert domain == "" or domain.startswith("nvlink:"), domain
