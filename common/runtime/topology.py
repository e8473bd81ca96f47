"""Where a worker's KV pages can go without the network, as it tells the proxy at registration: its host
(``worker.host_name``), and on a GPU in a multi-node NVLink fabric, that fabric (its interconnect domain).

GPUs of one NVLink fabric (an NVL72 rack, say, several hosts on one NVSwitch fabric) reach each other's memory over
NVLink, so the proxy pairs a prefill worker with a decode worker of its host or of its fabric before one across the
network (``proxy/core/routing.py`` ``near``). NVML names the fabric: the cluster UUID and clique id of the GPU's
fabric registration (``nvmlDeviceGetGpuFabricInfo``, from the ``nvidia-ml-py`` package of the ``gpu`` extra). A GPU in
no fabric (a PCIe card, or NVLink only inside its host, which the host already covers), a CPU worker, a host
without NVML, or a fabric whose registration is not complete reports none.
"""
from __future__ import annotations

import ctypes
import logging
from functools import cache

log = logging.getLogger(__name__)
FABRIC_STATE_COMPLETED = 3  # NVML_GPU_FABRIC_STATE_COMPLETED
NVML_SUCCESS = 0


@cache
def interconnect_domain(device) -> str:
    """``"nvlink:<cluster uuid>:<clique id>"`` of the NVLink fabric ``device`` (a ``torch.device``) is in, or ""
    when it is in none that NVML reports. Asked once per device: a fabric does not change under a running process."""
    if device.type != "cuda":
        return ""
    try:
        import pynvml
        import torch
    except ImportError:
        log.info("no interconnect domain reported: the nvidia-ml-py package (pip install 'tessera[gpu]') is not "
                 "installed, so the proxy pairs this worker's pages by host only")
        return ""
    try:
        pynvml.nvmlInit()
        try:
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            info = pynvml.c_nvmlGpuFabricInfo_t()
            pynvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
            return fabric_name(info)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as error:  # NotSupported: a GPU or driver without fabric information
        log.info("no interconnect domain reported for %s: NVML says %s", device, error)
        return ""


def fabric_name(info) -> str:
    """The domain of an NVML ``c_nvmlGpuFabricInfo_t``: "" unless its registration completed successfully with a
    cluster UUID."""
    if info.state != FABRIC_STATE_COMPLETED or info.status != NVML_SUCCESS:
        return ""
    uuid = bytes(info.clusterUuid)
    if not any(uuid):
        return ""
    return f"nvlink:{uuid.hex()}:{info.cliqueId}"
