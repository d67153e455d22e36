"""GPU kernels of specserve (Triton); each subpackage owns one kernel, its reference and configs.

`triton_available` says whether Triton is installed (looked up once, not imported): every
subpackage's dispatch takes its torch reference without it.
"""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def triton_available() -> bool:
    """Whether triton is installed (looked up once, not imported)."""
    return importlib.util.find_spec("triton") is not None


__all__ = ["triton_available"]
