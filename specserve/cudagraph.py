"""CUDA-graph helpers shared by the engine's step graphs (engine/graphs.py) and the DFlash
drafter's block graphs (drafters/dflash_graphs.py): size buckets, the packed static metadata
buffer with its pinned staging copy, planning attention for a replayable context, capture.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch

from specserve.attention.base import packed_offsets, torch_dtype

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket_of(n: int, buckets: Seq[int]) -> int | None:
    return next((b for b in buckets if b >= n), None)


class Staging:
    """Static metadata buffers of a graph: typed views packed into one device buffer and one
    (pinned, on CUDA) host staging buffer; a step fills the host views, then `push` moves them
    all in one copy."""

    def __init__(self, spec: dict[str, tuple[tuple[int, ...], type]], device) -> None:
        sizes = [int(np.prod(s)) * np.dtype(t).itemsize for s, t in spec.values()]
        offsets, total = packed_offsets(sizes)
        pin = torch.device(device).type == "cuda"
        self.host = torch.zeros(total, dtype=torch.uint8, pin_memory=pin)
        self.dev = torch.zeros(total, dtype=torch.uint8, device=device)
        hnp = self.host.numpy()
        self.views = {}  # name → (device view, host numpy view)
        for (name, (shape, dtype)), off, size in zip(spec.items(), offsets, sizes, strict=True):
            self.views[name] = (self.dev[off : off + size].view(torch_dtype(dtype)).view(shape),
                                hnp[off : off + size].view(dtype).reshape(shape))
        self.copied = torch.cuda.Event() if pin else None  # recorded after each push

    def wait(self) -> None:
        """Block until the previous push has read the host buffer (call before filling it)."""
        if self.copied is not None:
            self.copied.synchronize()

    def push(self) -> None:
        """Copy the host views to the device views (stream-ordered, one transfer)."""
        self.dev.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()


@contextmanager
def planned_for(owner, max_ctx_len: int):
    """`owner.attn_backend` planned for contexts up to `max_ctx_len` while inside (a fixed split
    count, device-side ranges: a graph captured now replays at any context up to it)."""
    backend = owner.attn_backend
    owner.attn_backend = partial(backend, max_ctx_len=max_ctx_len)
    try:
        yield
    finally:
        owner.attn_backend = backend


def capture_graph(fn, device, pool) -> tuple[object, object, object]:
    """Run `fn` once eagerly (kernels compile, launch plans are memoised outside the capture),
    then capture it as a CUDA graph in memory `pool` (None: a new pool). (graph, out, pool)."""
    fn()
    torch.cuda.synchronize(device)
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out, pool
