"""Where the time of one DFlash draft step goes (host vs GPU), on the issue-9 drafter.

BENCHMARKS.md (e2e run 6): a DFlash decode step at 32k costs 15.5 ms against 6.5 ms for an AR
step, ≈ 7-9 ms of drafting at every context — the drafter (5 layers, block 16) runs eagerly.
This script times `DFlashDrafter.draft` for one request that brings one new context row per step
(as in decode), chain and DDTree (budget 16), after a context of `--ctx` rows, and profiles a few
steps: wall ms, the drafter's own forward_s / tree_s, GPU kernel ms (sum), kernel launches and
host syncs per step, top host ops and top kernels; `--graphs`: also with the block forward
replayed from CUDA graphs (drafters/dflash_graphs.py), side by side.

    python3 bench/diag_draft.py [--ctx 1024] [--out $OUT/diag_draft.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

import torch
from _e2e_common import QWEN3_8B, TINY, build_models

from services.cli.usage import int_range
from specserve.drafters.base import DraftRequest
from specserve.drafters.dflash import DFlashDrafter
from specserve.drafters.dflash_graphs import DraftGraphs

DEV, DTYPE = "cuda", torch.bfloat16
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def steps(drafter, width: int, start: int, n: int, tree: bool, gen) -> tuple[list, int]:
    """`n` draft steps, each with one new context row; per-step (wall ms, forward ms, tree ms)."""
    drafter.tree = tree
    out = []
    for _ in range(n):
        ctx = torch.randn(1, width, generator=gen).to(DEV, DTYPE)
        start += 1
        t0 = time.perf_counter()
        drafter.draft([DraftRequest("r", 7, start, 16, 16, ctx)])
        if DEV == "cuda":
            torch.cuda.synchronize()
        st = drafter.last_stats
        out.append(((time.perf_counter() - t0) * 1e3, st.forward_s * 1e3, st.tree_s * 1e3))
    return out, start


def profile(fn) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    with prof_ctx(activities=acts) as prof:
        fn()
    evs = prof.events()
    names = collections.Counter(e.name for e in evs)
    gpu = sum(float(e.time_range.elapsed_us()) for e in evs
              if str(getattr(e, "device_type", "")).endswith("CUDA"))
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                      max_name_column_width=50)
    kern = collections.Counter()
    for e in evs:
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            kern[e.name[:70]] += float(e.time_range.elapsed_us())
    return dict(gpu_ms=gpu / 1e3, launches=sum(names[k] for k in LAUNCHES),
                syncs={k: names[k] for k in SYNCS if names[k]}, cpu_table=table,
                top_kernels=kern.most_common(10))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int_range(1, 1 << 20), default=1024)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (smoke test)")
    ap.add_argument("--graphs", action="store_true", help="also time the graph-replayed block")
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "diag_draft.json"))
    a = ap.parse_args()
    global DEV, DTYPE
    if a.tiny:
        DEV, DTYPE = "cpu", torch.float32
    elif not torch.cuda.is_available():
        ap.error("times the draft step on a CUDA GPU (none here); --tiny runs it on the CPU")
    target, dmodel = build_models(dict(TINY, num_layers=12) if a.tiny else QWEN3_8B, 5, DEV, DTYPE)
    del target
    cfg = dmodel.config
    width = cfg.num_taps * cfg.hidden_size
    drafter = DFlashDrafter(dmodel, num_pages=-(-(a.ctx + 512) // 16) + 4, page_size=16,
                            graphs=False)  # the modes below set drafter.graphs
    gen = torch.Generator().manual_seed(0)
    context = torch.randn(a.ctx, width, generator=gen).to(DEV, DTYPE)
    drafter.draft([DraftRequest("r", 7, a.ctx, 0, 16, context)])  # context only
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    start, res = a.ctx, dict(ctx=a.ctx, device=name)
    modes = [("eager", None)]
    if a.graphs:  # the block forward replayed from CUDA graphs (drafters/dflash_graphs.py)
        modes.append(("graphs", DraftGraphs(drafter.model, drafter.cache)))
    for (mode, graphs), tree in [(m, t) for m in modes for t in (False, True)]:
        drafter.graphs = graphs
        name = f"{mode}_{'ddtree16' if tree else 'chain16'}"
        _, start = steps(drafter, width, start, 3, tree, gen)  # warm-up / compile
        times, start = steps(drafter, width, start, 10, tree, gen)
        med = [sorted(x[i] for x in times)[len(times) // 2] for i in range(3)]
        n_prof = 3
        box = {"start": start}

        def run(tree=tree, box=box, n_prof=n_prof):
            box["t"], box["start"] = steps(drafter, width, box["start"], n_prof, tree, gen)
        p = profile(run)
        start = box["start"]
        res[name] = dict(wall_ms=med[0], forward_ms=med[1], tree_ms=med[2],
                         gpu_ms_per_step=p["gpu_ms"] / n_prof,
                         launches_per_step=p["launches"] / n_prof,
                         syncs_per_step={k: v / n_prof for k, v in p["syncs"].items()},
                         top_kernels=p["top_kernels"], cpu_table=p["cpu_table"])
        print(f"{name}: wall {med[0]:.2f} ms (forward {med[1]:.2f}, tree {med[2]:.2f}); GPU "
              f"{p['gpu_ms'] / n_prof:.2f} ms/step, {p['launches'] / n_prof:.0f} launches, "
              f"syncs {res[name]['syncs_per_step']}", flush=True)
        print(p["cpu_table"], flush=True)
        for k, us in p["top_kernels"]:
            print(f"   {us / n_prof:8.1f} us  {k}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
