"""The --device / --dtype / --threads of the two services that run models (verifier and
drafter).

The dtypes are the core loader's (`specserve.models.loader.DTYPES`) plus `auto`: bfloat16 on
CUDA, float32 on the CPU; device `auto` is CUDA when there is one. Threads `auto` on the CPU,
where verifier and drafter take turns on one host's cores: the drafter takes half of them, and
so does the verifier for steps that only verify — a pool of every core goes cold while the
other process computes, and waking it costs more than the second half of the cores gains
(BENCHMARKS.md, "The CPU demo through the services") — while its steps that carry prompt tokens
(long, compute-bound) take them all; a verifier without a drafter service takes them all. On
CUDA `auto` leaves torch's count.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from services.common.settings import flag_field
from specserve.models.loader import DTYPES as MODEL_DTYPES

DTYPES = ("auto", *MODEL_DTYPES)


def device_field() -> Any:
    return flag_field("--device", "SPECSERVE_DEVICE", "auto | cpu | cuda[:N]", default="auto")


def dtype_field() -> Any:
    return flag_field("--dtype", "SPECSERVE_DTYPE", " | ".join(DTYPES), default="auto")


AUTO_THREADS = {  # what --threads auto means, by service
    "verifier": "on the CPU beside a drafter service half the cores, all for steps that carry "
                "prompt tokens; without a drafter all",
    "drafter": "on the CPU half the cores: the verifier beside it has the other half",
}


def threads_field(service: str) -> Any:
    return flag_field("--threads", "SPECSERVE_THREADS",
                      f"torch CPU threads of this process: N, or auto ({AUTO_THREADS[service]}; "
                      "on CUDA torch's own)", default="auto")


def check_threads(threads: str) -> None:
    if threads != "auto" and not (threads.isdigit() and int(threads) >= 1):
        raise ValueError(f"threads must be auto or a positive integer, got {threads!r}")


@dataclass
class StepThreads:
    """The verifier's torch threads by step: `prefill` (all the cores) for a step that carries
    prompt tokens, long and compute-bound; `decode` (half) for one that only verifies, taking
    turns with the drafter."""

    prefill: int
    decode: int
    now: int | None = None

    def use(self, prefill: bool) -> None:
        import torch

        n = self.prefill if prefill else self.decode
        if n != self.now:
            torch.set_num_threads(n)  # this thread's own count: call it on the engine thread
            self.now = n


def apply_threads(threads: str, device: str, shared: bool, by_step: bool = False
                  ) -> StepThreads | None:
    """Set torch's intra-op threads for this process (`shared`: verifier and drafter both
    compute on this host's cores); with `by_step` (the verifier) a `StepThreads` where the
    count should follow the step (`auto` on the CPU, shared, more than one core), else None."""
    import torch

    step = None
    if threads != "auto":
        torch.set_num_threads(int(threads))
    elif device.startswith("cpu"):
        cores = len(os.sched_getaffinity(0))
        half = max(1, cores // 2) if shared else cores
        torch.set_num_threads(half)
        step = StepThreads(cores, half) if by_step and half < cores else None
    extra = f", {step.prefill} for steps that carry prompt tokens" if step is not None else ""
    logging.getLogger(__name__).info("torch CPU threads: %d%s (--threads %s)",
                                     torch.get_num_threads(), extra, threads)
    return step


def check_device(device: str) -> None:
    if device not in ("auto", "cpu") and not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {device!r}")


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def resolve_device(device: str) -> str:
    """"auto": CUDA when there is one, else the CPU; a CUDA device this machine lacks is a
    ValueError (a service's one-line error), not torch's assertion deep in a model load."""
    import torch

    from services.cli.usage import cuda_missing

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and (missing := cuda_missing(device)):
        raise ValueError(f"--device {device} (SPECSERVE_DEVICE): {missing}")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"
