"""Capability probes of the machine (all optional at import): peer access, the multicast attribute, the
loaded NCCL version. They use ``cuda-bindings`` and ``nccl4py`` when installed (the ``cuda`` extra) and
report ``None`` for what they cannot tell. Nothing here creates a multicast object."""
from __future__ import annotations


import torch

from tide import knobs


def multicast_allowed() -> bool:
    """Multicast (NVLS) code may run only with ``TIDE_ALLOW_MULTICAST=1``; TIDE ships none yet."""
    return knobs.get("TIDE_ALLOW_MULTICAST")


def nccl_version() -> tuple | None:
    """The libnccl loaded in this process: nccl4py when installed (it binds torch's copy), else torch."""
    try:
        import nccl.core as nccl  # nccl4py

        v = nccl.get_version().libnccl.version
        return tuple(int(x) for x in str(v).split(".")[:3])
    except Exception:  # noqa: BLE001 - optional dependency, any failure means "unknown"
        pass
    try:
        return tuple(torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001
        return None


def _driver():
    try:
        from cuda.bindings import driver  # cuda-bindings >= 12

        return driver
    except ImportError:
        return None


def device_attributes(device: int = 0) -> dict:
    """Peer access to every other visible GPU and the multicast-support attribute (read only)."""
    out: dict = {"device": device, "peer_access": {}, "multicast_supported": None}
    if not torch.cuda.is_available():
        return out
    for other in range(torch.cuda.device_count()):
        if other != device:
            out["peer_access"][other] = bool(torch.cuda.can_device_access_peer(device, other))
    drv = _driver()
    if drv is not None:
        try:
            (err,) = drv.cuInit(0)
            err, value = drv.cuDeviceGetAttribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED,
                                                  device)
            if err == drv.CUresult.CUDA_SUCCESS:
                out["multicast_supported"] = bool(value)
        except Exception:  # noqa: BLE001
            pass
    return out


def summary() -> dict:
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl_version(),
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "multicast_allowed": multicast_allowed(),
        "attributes": device_attributes() if torch.cuda.is_available() else None,
    }
