"""An L2 prefetch of a weight, issued on a side stream while the GPU is latency-bound.

Owns `_l2_prefetch_kernel` and its launcher `l2_prefetch`: each lane issues one Hopper bulk
prefetch (`cp.async.bulk.prefetch.L2.global`, sm_90+) of CHUNK bytes of the tensor; the
instruction has no completion, so the kernel ends once the requests are issued and the copy
engine fills L2 while the next kernels run. It changes no value — a hint. The decoder uses it
for o_proj's weight while a short context's RoPE, attention and combine run (there DRAM is
almost idle): `specserve.models.fused_layer` does the stream fork / join.

Not CPU-interpretable (inline PTX): the CPU twin of a prefetch is doing nothing
(`kernels.fused.ref.l2_prefetch_ref`). Needs CUDA compute capability ≥ 9.0 (`supported`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 16384  # bytes per bulk prefetch (a multiple of 16, as the instruction requires)
LANES = 128  # prefetches per program (num_warps = 4)

_ASM = tl.constexpr("{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")


@triton.jit
def _l2_prefetch_kernel(Base, nbytes, Sink, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Bytes [pid·LANES·CHUNK, (pid+1)·LANES·CHUNK) of Base (a byte pointer) into L2. Sink:
    [LANES] int32 that the asm's dummy result (always 0) would be stored to if it were not —
    it keeps the result used, nothing is ever written."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * (LANES * CHUNK) + tl.arange(0, LANES).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)  # ≤ 0 past the end: no request
    done = tl.inline_asm_elementwise(_ASM, "=r,l,r", [Base + start, size], dtype=tl.int32,
                                     is_pure=False, pack=1)
    lanes = tl.arange(0, LANES)
    tl.store(Sink + lanes, done, mask=done != 0)


_SINKS: dict[torch.device, torch.Tensor] = {}  # never written (above), never reallocated


def supported(device: torch.device | str) -> bool:
    """Whether `l2_prefetch` can run on `device` (CUDA, compute capability ≥ 9.0)."""
    d = torch.device(device)
    return d.type == "cuda" and torch.cuda.get_device_capability(d)[0] >= 9


def l2_prefetch(t: torch.Tensor, nbytes: int | None = None) -> None:
    """Ask L2 for the first `nbytes` (default: all) of contiguous CUDA tensor `t`."""
    if not t.is_cuda or not t.is_contiguous():
        raise ValueError(f"l2_prefetch needs a contiguous CUDA tensor, got {t.device} "
                         f"strides {t.stride()}")
    total = t.numel() * t.element_size()
    nbytes = total if nbytes is None else nbytes
    if not 0 <= nbytes <= total or nbytes % 16 or t.data_ptr() % 16:
        raise ValueError(f"nbytes must be a multiple of 16 in [0, {total}] on a 16-byte aligned "
                         f"tensor, got {nbytes} at {t.data_ptr():#x}")
    if nbytes == 0:
        return
    sink = _SINKS.get(t.device)
    if sink is None:
        sink = _SINKS[t.device] = torch.zeros(LANES, dtype=torch.int32, device=t.device)
    grid = (triton.cdiv(nbytes, LANES * CHUNK),)
    _l2_prefetch_kernel[grid](t.view(-1).view(torch.uint8), nbytes, sink, CHUNK=CHUNK,
                              LANES=LANES, num_warps=4)
