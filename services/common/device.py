"""The --device / --dtype of the two services that run models (verifier and drafter).

The dtypes are the core loader's (`specserve.models.loader.DTYPES`) plus `auto`: bfloat16 on
CUDA, float32 on the CPU; device `auto` is CUDA when there is one.
"""

from __future__ import annotations

from typing import Any

from services.common.settings import flag_field
from specserve.models.loader import DTYPES as MODEL_DTYPES

DTYPES = ("auto", *MODEL_DTYPES)


def device_field() -> Any:
    return flag_field("--device", "SPECSERVE_DEVICE", "auto | cpu | cuda[:N]", default="auto")


def dtype_field() -> Any:
    return flag_field("--dtype", "SPECSERVE_DTYPE", " | ".join(DTYPES), default="auto")


def check_device(device: str) -> None:
    if device != "auto" and device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {device!r}")


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"
