"""The DDTree top-k on the GPU: where `topk_logprobs`' time goes, and cheaper ways to the same
tables (issue 23 diagnostic).

For draft logits `[rows, V]` float32 (rows = requests × 15 block slots; V = the demo
tokenizer's 4096 and Qwen3's 151936), times with host clocks (synchronised), side by side: the
log-sum-exp alone and by chunks of V, `torch.topk` sorted / unsorted, a two-stage top-k (per
chunk of V, then over the candidates; chunks of 512 … 16384), the whole `topk_logprobs`
(top-k, log-probs, one packed host copy: since kernels/topk, its kernel from 16384 columns),
torch's formula alone, the kernel alone, and the torch formula as one CUDA graph + the copy;
a chain's costs (argmax + copy; a top-1 with its log-sum-exp) and one request's heap.
Checks each variant's ids (and log-sum-exp) equal torch's. Medians in µs; writes JSON.

    PYTHONPATH=. python3 experiments/diag_topk.py [--rows 15,120,480] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from specserve.kernels.topk.kernel import topk_logprobs_triton
from specserve.kernels.topk.ref import topk_logprobs_ref
from specserve.spec.ddtree import build_ddtree, topk_logprobs


def host_us(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def two_stage(x: torch.Tensor, k: int, chunk: int = 512):
    """Top-k per chunk of the vocabulary, then over the chunks' candidates."""
    rows, vocab = x.shape
    pad = -vocab % chunk
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
    vals, ids = x.view(rows, -1, chunk).topk(k, dim=-1)  # [rows, C, k]
    ids = ids + torch.arange(0, x.shape[1], chunk, device=x.device).view(1, -1, 1)
    top, at = vals.reshape(rows, -1).topk(k, dim=-1)
    return top, ids.reshape(rows, -1).gather(1, at)


def chunked_lse(x: torch.Tensor, chunk: int) -> torch.Tensor:  # [rows, 1]
    """Log-sum-exp per chunk of the vocabulary, then over the chunks (more programs per row)."""
    rows, vocab = x.shape
    pad = -vocab % chunk
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
    return torch.logsumexp(torch.logsumexp(x.view(rows, -1, chunk), dim=-1), dim=-1,
                           keepdim=True)


def packed(x: torch.Tensor, k: int) -> torch.Tensor:
    """topk_logprobs' device part: [rows, 2k] int32 (log-prob bits | ids)."""
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    vals, ids = x.topk(k, dim=-1)
    return torch.cat([(vals - lse).view(torch.int32), ids.to(torch.int32)], dim=1)


def measure(x: torch.Tensor, k: int, reps: int) -> dict:
    """One shape's timings (µs); asserts the graph's and the two-stage ids equal the top-k's."""
    want = (None, topk_logprobs_ref(x, k)[1].cpu().numpy())  # torch's ids
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    packed(static, k)  # warm
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = packed(static, k)
    graph.replay()
    assert (out.cpu().numpy()[:, k:] == want[1]).all(), "graph ids differ"
    assert torch.equal(topk_logprobs_triton(x, k)[1].cpu(), torch.from_numpy(want[1]))
    assert (topk_logprobs(x, k)[1] == want[1]).all(), "topk_logprobs ids differ"
    for chunk in (512, 2048, 8192, 16384):
        _, ids2 = two_stage(x, k, chunk)
        assert torch.equal(ids2.cpu(), torch.from_numpy(want[1])), "two-stage ids differ"
        lse = chunked_lse(x, chunk)
        torch.testing.assert_close(lse, torch.logsumexp(x, -1, keepdim=True))
    return dict(logsumexp=host_us(lambda: torch.logsumexp(x, -1), reps),
                topk_sorted=host_us(lambda: x.topk(k, dim=-1), reps),
                topk_unsorted=host_us(lambda: x.topk(k, dim=-1, sorted=False), reps),
                two_stage=host_us(lambda: two_stage(x, k), reps),
                topk_logprobs=host_us(lambda: topk_logprobs(x, k), reps),
                torch_ref=host_us(lambda: topk_logprobs_ref(x, k), reps),
                kernel=host_us(lambda: topk_logprobs_triton(x, k), reps),
                **{f"two_stage_{c}": host_us(lambda c=c: two_stage(x, k, c), reps)
                   for c in (2048, 8192, 16384)},
                **{f"lse_chunked_{c}": host_us(lambda c=c: chunked_lse(x, c), reps)
                   for c in (2048, 8192, 16384)},
                graph_and_copy=host_us(lambda: (graph.replay(), out.cpu()), reps),
                copy_only=host_us(lambda: out.cpu(), reps),
                **chain_and_heap(x, reps))


def top1_lse(x: torch.Tensor) -> torch.Tensor:
    """A chain's device part: each row's argmax and its log-prob, one packed host copy."""
    best, ids = x.max(dim=-1)
    lp = best - torch.logsumexp(x, dim=-1)
    return torch.stack((lp.view(torch.int32), ids.to(torch.int32))).cpu()


def chain_and_heap(x: torch.Tensor, reps: int) -> dict:
    """What a chain costs (the chain drafter's argmax + copy; a chain ask's top-1 tables) and
    the host's heap for one request's DDTree of 15 and 63 nodes (µs)."""
    rows = x[:15]  # one request's block
    lp, ids = topk_logprobs(rows, 63)
    return dict(argmax_copy=host_us(lambda: x.argmax(-1).cpu(), reps),
                topk_logprobs_k1=host_us(lambda: topk_logprobs(x, 1), reps),
                top1_lse_copy=host_us(lambda: top1_lse(x), reps),
                heap_15=host_us(lambda: build_ddtree(lp[:, :15], ids[:, :15], 15), reps),
                heap_63=host_us(lambda: build_ddtree(lp, ids, 63), reps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="15,120,480")
    ap.add_argument("--vocabs", default="4096,151936")
    ap.add_argument("--k", type=int, default=15)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "diag_topk.json"))
    a = ap.parse_args()
    res = dict(k=a.k, device=torch.cuda.get_device_name(), rows=[])
    for vocab in (int(v) for v in a.vocabs.split(",")):
        for rows in (int(r) for r in a.rows.split(",")):
            gen = torch.Generator("cuda").manual_seed(rows + vocab)
            x = torch.randn(rows, vocab, device="cuda", generator=gen) * 3  # [rows, V] float32
            row = dict(vocab=vocab, rows=rows, **measure(x, a.k, a.reps))
            res["rows"].append(row)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
