"""o_proj's weight prefetched into L2 on a side stream (issue 9): does the o GEMM then read it
from L2, and what does the verify step gain, by context?

At 1k context a verify layer's RoPE + attention + combine take ~20 µs and read ~4 MB: DRAM is
idle while they run. `fused_layer` can fork a side stream there that prefetches o_proj's 33.5 MB
weight (`kernels/fused/prefetch.py`); the o GEMM that follows (13.9 µs, 57 % of copy alone) then
finds it in L2. This script measures, on the H200:

  [1] chain: one CUDA graph of 36 × [a latency-bound kernel (torch.cuda._sleep, ~SLEEP µs on
      one SM) → o GEMM (M = 65) on its own weight copy], with the copy prefetched on the side
      stream as the sleep starts, or not; also the sleeps alone and the GEMMs alone. µs a pair.
  [2] the verify step (random Qwen3-8B-shape target, bf16, page 16: forward + logits + argmax
      in one CUDA graph) per (ctx, rows) for each `O_PREFETCH_AT` in (None, "rope", "qkv"),
      the variants alternated over rounds; logits compared bitwise with None's; per-kernel GPU
      µs of the GEMMs from torch.profiler over graph replays.

    python3 bench/diag_prefetch.py [--ctxs 1024,4096,32768,131072] [--rows 17,65]
        [--rounds 2] [--out $OUT/diag_prefetch.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _e2e_common import ceilings  # noqa: E402
from _e2e_verify import random_tree  # noqa: E402
from diag_kernel import _kernel_times  # noqa: E402
from profile_step import build_target, make_runner  # noqa: E402

from kernels.fused.prefetch import l2_prefetch  # noqa: E402
from specserve.attention.base import AttnBatch  # noqa: E402
from specserve.models import fused_layer  # noqa: E402
from specserve.spec.tree import verify_layout  # noqa: E402

VARIANTS = (None, "rope", "qkv")
LAYERS = 36


def _replay_us(fn, per: int) -> float:
    """GPU µs per unit of `fn` (which queues `per` units) replayed from a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, return_mode="median") * 1e3 / per


def chain(w: torch.Tensor, sleep_cycles: int) -> dict:
    """[1]: the sleep → o GEMM chain with and without the side-stream prefetch."""
    ws = [w.clone() for _ in range(LAYERS)]  # 36 × 33.5 MB: never in L2 from the last replay
    x = torch.randn(65, w.shape[1], device="cuda", dtype=w.dtype)
    side = torch.cuda.Stream()

    def pairs(prefetch: bool, sleep: bool = True, gemm: bool = True):
        for wc in ws:
            if prefetch:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    l2_prefetch(wc)
            if sleep:
                torch.cuda._sleep(sleep_cycles)
            if prefetch:
                torch.cuda.current_stream().wait_stream(side)
            if gemm:
                F.linear(x, wc)

    out = dict(sleep_cycles=sleep_cycles,
               sleep_us=_replay_us(lambda: pairs(False, gemm=False), LAYERS),
               gemm_us=_replay_us(lambda: pairs(False, sleep=False), LAYERS),
               pair_us=_replay_us(lambda: pairs(False), LAYERS),
               pair_prefetch_us=_replay_us(lambda: pairs(True), LAYERS),
               gemm_after_prefetch_us=_replay_us(lambda: pairs(True, sleep=False), LAYERS))
    return out


def step_point(model, kv, table, ctx: int, rows: int, rounds: int) -> dict:
    """[2] at one (ctx, rows): graph µs per variant and round, bitwise check, GEMM kernels."""
    vocab = model.config.vocab_size
    rng = np.random.default_rng(ctx + rows)
    lay = verify_layout(random_tree(rows - 1, vocab, rng), int(rng.integers(vocab)), ctx)
    batch = AttnBatch.build([rows], [ctx], [table], lay.positions, 16, [lay.mask], "cuda")
    ids = torch.as_tensor(lay.token_ids, device="cuda")
    res: dict = dict(ctx=ctx, rows=rows, ms={str(v): [] for v in VARIANTS})
    logits = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for v in VARIANTS:
                fused_layer.O_PREFETCH_AT = v
                res["ms"][str(v)].append(_replay_us(
                    lambda: model.logits(model(ids, batch, kv)[0]).argmax(-1), 1) / 1e3)
                logits[v] = model.logits(model(ids, batch, kv)[0]).float().cpu()
        res["bitwise_equal"] = {str(v): bool(torch.equal(logits[v], logits[None]))
                                for v in VARIANTS}
        res["kernels_us"] = {}
        for v in VARIANTS:
            fused_layer.O_PREFETCH_AT = v
            kt = _kernel_times([lambda: model.logits(model(ids, batch, kv)[0])], torch)
            res["kernels_us"][str(v)] = {k: round(t, 2) for k, t in kt.items()
                                         if "nvjet" in k or "prefetch" in k or "tree" in k}
    fused_layer.O_PREFETCH_AT = "rope"
    res["median_ms"] = {k: float(np.median(t)) for k, t in res["ms"].items()}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctxs", default="1024,4096,32768,131072")
    ap.add_argument("--rows", default="17,65")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sleeps", default="20000,40000", help="sleep cycles for the chain")
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "diag_prefetch.json"))
    args = ap.parse_args()
    a = argparse.Namespace(tiny=False, layers=None, device="cuda", std=0.02, page_size=16,
                           chunk=8192)
    ctxs, rows_list = [int(c) for c in args.ctxs.split(",")], [int(r) for r in args.rows.split(",")]
    res = dict(device=torch.cuda.get_device_name(), copy_GBps=ceilings("cuda", False)["copy_GBps"],
               chain=[], steps=[])
    model, _ = build_target(a, torch.bfloat16)
    w = model.model.layers[0].self_attn.o_proj.weight.detach()
    for cycles in (int(c) for c in args.sleeps.split(",")):
        res["chain"].append(c := chain(w, cycles))
        print("chain " + ", ".join(f"{k} {v:.1f}" for k, v in c.items()), flush=True)
    top = max(ctxs) + max(rows_list) + 1
    runner = make_runner(a, model, "bfloat16", top)
    runner.blocks.reserve("d", top)
    runner.blocks.ensure("d", top)
    table = runner.blocks.page_table("d")
    for ctx in ctxs:
        for rows in rows_list:
            r = step_point(model, runner.kv, table, ctx, rows, args.rounds)
            res["steps"].append(r)
            print(f"ctx {ctx} rows {rows}: " + ", ".join(
                f"{k} {v:.3f} ms" for k, v in r["median_ms"].items())
                + f" | bitwise {r['bitwise_equal']}", flush=True)
            for v, kt in r["kernels_us"].items():
                print(f"    {v}: " + ", ".join(f"{k} {t}" for k, t in sorted(kt.items())))
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
