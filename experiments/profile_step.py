"""Where the time of one eager verify / decode step goes (host vs GPU), on the issue-9 model.

BENCHMARKS.md ("End to end on the H200 (issue 9), first run") measured ≈ 50 ms per verify step of
the random Qwen3-8B-shape target at batch 1 at EVERY context (1k … 128k) and 57 ms per AR decode
step, while the attention is 7–23 ms and the memory floor 3.9 ms: the step was host-bound. This
script measures the same steps (no CUDA graphs) and says why, in one run of < 3 minutes:

  [1] model step   `DecoderModel.forward` + logits + argmax over a prebuilt `AttnBatch` — what
                   bench_e2e.py's verify section times. gpu = CUDA events around the call;
                   enqueue = host time for the call to return (it never syncs). enqueue ≈ gpu
                   means the GPU waits on Python (host-bound); enqueue ≪ gpu means GPU-bound.
  [2] runner step  `ModelRunner.forward` from host lists (metadata built and copied) + the
                   argmax `.tolist()` the acceptance walk does: the engine's forward per step.
  [3] engine step  `Engine.step()` with a request already prefilled: budget 0 (AR decode) and a
                   random-tree drafter at budget 16 / 64 (verify; random tokens, so ≈ 1 token
                   committed per step): scheduling, drafting, forward, acceptance, commit.
  [4] host µs/call enqueue cost of single pieces (one decoder layer, the attention launcher,
                   one KV write, one GEMM, one trivial torch op = this host's floor per op).
  [5] profiler     torch.profiler over a few model / runner steps: top ops by self CPU time and
                   by GPU time; per step: aten ops, kernel launches, H2D copies, host syncs, and
                   GPU busy time (sum of kernel times) vs step time.
  [6] syncs        `torch.cuda.set_sync_debug_mode("warn")` over one runner step and one engine
                   step: every synchronising call, counted by the repo line that made it.

GPU:  PYTHONPATH=.:bench python3 experiments/profile_step.py --out $OUT/profile_step.json
CPU:  PYTHONPATH=.:bench python3 experiments/profile_step.py --tiny   (tiny model; CPU profiler)
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch
from _e2e_common import QWEN3_8B, TINY, _random_fill, ceilings, target_config
from _e2e_verify import random_tree

from specserve.attention import backend_for
from specserve.attention.base import AttnBatch
from specserve.config import EngineConfig
from specserve.drafters.base import Drafter
from specserve.engine.runner import ForwardInput, ModelRunner
from specserve.kvcache.block_manager import BlockManager, pages_for
from specserve.models.decoder import DecoderModel
from specserve.models.rope import Rotary
from specserve.spec.tree import DraftTree, verify_layout
from specserve.types import SamplingParams

T0 = time.time()
REPO = str(Path(__file__).resolve().parents[1])
# BENCHMARKS.md, issue-9 first H200 run (before this work): ms per step at batch 1, eager
BEFORE = {("verify", 1024, 16): 52.90, ("verify", 1024, 64): 49.40,
          ("verify", 32768, 16): 50.46, ("verify", 32768, 64): 50.15,
          ("ar", 1024, 0): 57.27, ("ar", 32768, 0): 38.33}
LAUNCH_EVENTS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
               "cudaMemcpy", "cudaStreamWaitEvent")
COPY_EVENTS = ("cudaMemcpyAsync", "cudaMemcpy")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = ap.add_argument
    add("--out", default=str(Path(os.environ.get("OUT", ".")) / "profile_step.json"))
    add("--tiny", action="store_true", help="tiny model on the CPU (smoke test)")
    add("--layers", type=int, default=None, help="override the layer count (default 36 / 2)")
    add("--device", default=None)
    add("--ctxs", default=None, help="comma-separated contexts (default 1024,32768 / 64,256)")
    add("--budgets", default="16,64")
    add("--reps", type=int, default=None)
    add("--engine-steps", type=int, default=None)
    add("--page-size", type=int, default=16)
    add("--chunk", type=int, default=None, help="engine prefill chunk (default 8192 / 128)")
    add("--budget-s", type=float, default=165.0, help="skip remaining work after this")
    add("--std", type=float, default=0.02)
    a = ap.parse_args(argv)
    a.device = a.device or ("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    a.cuda = a.device.startswith("cuda")
    a.ctxs = [int(x) for x in (a.ctxs or ("64,256" if a.tiny else "1024,32768")).split(",")]
    a.budgets = [int(x) for x in a.budgets.split(",") if x]
    a.reps = a.reps or (5 if a.tiny else 10)
    a.engine_steps = a.engine_steps or (4 if a.tiny else 10)
    a.chunk = a.chunk or (128 if a.tiny else 8192)
    if not a.cuda:
        torch.set_num_threads(1)
    return a


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def sync(dev) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def med(xs) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


class Timer:
    """Per call: gpu ms (CUDA events; wall on CPU), enqueue ms (host time to return), after a
    sync so every call starts with an idle GPU (one request's step, as in the engine)."""

    def __init__(self, dev) -> None:
        self.cuda = torch.device(dev).type == "cuda"

    def __call__(self, fn, reps: int, warmup: int = 2) -> dict:
        for _ in range(warmup):
            fn()
        gpu, enq, wall = [], [], []
        for _ in range(reps):
            if self.cuda:
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                e0.record()
                fn()
                e1.record()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                gpu.append(e0.elapsed_time(e1))
            else:
                t0 = time.perf_counter()
                fn()
                t1 = t2 = time.perf_counter()
                gpu.append((t1 - t0) * 1e3)
            enq.append((t1 - t0) * 1e3)
            wall.append((t2 - t0) * 1e3)
        return dict(gpu_ms=med(gpu), enqueue_ms=med(enq), wall_ms=med(wall),
                    gpu_ms_min=min(gpu), reps=reps)


# ---- setup ---------------------------------------------------------------------------------
def build_target(a, dtype):
    shape = dict(TINY if a.tiny else QWEN3_8B)
    if a.layers:
        shape["num_layers"] = a.layers
    cfg = target_config(shape)
    gen = torch.Generator(device=a.device).manual_seed(0)
    with torch.device("meta"):
        model = DecoderModel(cfg)
    _random_fill(model, a.device, dtype, a.std, gen)
    model.rotary = Rotary(cfg.rope, cfg.head_dim)
    model = model.to(a.device).eval()
    model.attn_backend = backend_for(a.device)
    return model, shape


def make_runner(a, model, dtype_name, tokens: int, max_draft: int = 0) -> ModelRunner:
    pages = pages_for(tokens, a.page_size) + 2
    cfg = EngineConfig(model_dir="/nonexistent/random-weights", dtype=dtype_name,
                       device=a.device, page_size=a.page_size, num_pages=pages, max_num_seqs=1,
                       max_num_batched_tokens=a.chunk, max_model_len=tokens,
                       max_draft_tokens=max_draft)
    runner = ModelRunner(cfg, model)  # fuses q/k/v and gate/up (idempotent)
    runner.blocks = BlockManager(runner.num_pages, a.page_size)  # this script's pages
    return runner


class RandomTreeDrafter(Drafter):
    """Benchmark-only: a bushy random tree of the request's budget (never right on random
    weights: ≈ one committed token per step — this measures the cost of a verify step)."""

    needs_context = False

    def __init__(self, vocab: int) -> None:
        self.vocab, self.rng = vocab, np.random.default_rng(5)

    def draft(self, requests):
        out = []
        for r in requests:
            n = min(r.budget, r.max_depth)
            out.append(random_tree(n, self.vocab, self.rng) if n > 0 else DraftTree.empty())
        return out


# ---- sections -----------------------------------------------------------------------------
def model_and_runner_steps(a, res, model, runner, timer) -> None:
    """[1] model step and [2] runner step per (ctx, budget); budget 0 = AR (one row)."""
    kv, dev = runner.kv, a.device
    vocab = model.config.vocab_size
    rid = "p"
    runner.blocks.reserve(rid, max(a.ctxs) + max(a.budgets) + 1)
    runner.blocks.ensure(rid, max(a.ctxs) + max(a.budgets) + 1)
    table = runner.blocks.page_table(rid)
    rows = res.setdefault("steps", [])
    for ctx in a.ctxs:
        for budget in [0, *a.budgets]:
            if time.time() - T0 > a.budget_s * 0.45:
                rows.append(dict(ctx=ctx, budget=budget, skipped="time budget"))
                continue
            rng = np.random.default_rng(ctx + budget)
            tree = random_tree(budget, vocab, rng) if budget else DraftTree.empty()
            lay = verify_layout(tree, int(rng.integers(vocab)), ctx)
            n = budget + 1
            batch = AttnBatch.build([n], [ctx], [table], lay.positions, a.page_size, [lay.mask],
                                    dev)
            ids = torch.as_tensor(lay.token_ids, device=dev)

            def model_step(batch=batch, ids=ids):
                hidden, _ = model(ids, batch, kv)
                return model.logits(hidden).argmax(dim=-1)

            inp = [ForwardInput(rid, lay.token_ids, lay.positions, ctx_len=ctx,
                                tree_mask=lay.mask, pages=table)]

            def runner_step(inp=inp, n=n):
                logits, _ = runner.forward(inp, range(n))
                return logits.argmax(dim=-1).tolist()

            with torch.inference_mode():
                m = timer(model_step, a.reps)
                r = timer(runner_step, a.reps)
            row = dict(ctx=ctx, budget=budget, rows=n, model=m, runner=r,
                       before_ms=BEFORE.get(("verify" if budget else "ar", ctx, budget)))
            rows.append(row)
            log(f"ctx={ctx} budget={budget}: model step gpu {m['gpu_ms']:.2f} ms (enqueue "
                f"{m['enqueue_ms']:.2f}); runner step wall {r['wall_ms']:.2f} ms")
    runner.blocks.free(rid)


def engine_steps(a, res, model, dtype_name) -> None:
    """[3] Engine.step() after prefill: AR (budget 0) and random trees (budget 16 / 64)."""
    from specserve.engine.engine import Engine

    out = res.setdefault("engine", [])
    drafter = RandomTreeDrafter(model.config.vocab_size)
    for ctx in a.ctxs:
        for budget in [0, *a.budgets]:
            if time.time() - T0 > a.budget_s * 0.75:
                out.append(dict(ctx=ctx, budget=budget, skipped="time budget"))
                continue
            new = a.engine_steps + 3
            tokens = ctx + new * (budget + 1) + budget + 2
            pages = pages_for(tokens + max(a.budgets) + 1, a.page_size) + 2  # + tree scratch
            cfg = EngineConfig(model_dir="/nonexistent/random-weights", dtype=dtype_name,
                               device=a.device, page_size=a.page_size, num_pages=pages,
                               max_num_seqs=1, max_num_batched_tokens=a.chunk,
                               max_model_len=tokens, max_draft_tokens=max(a.budgets))
            engine = Engine(cfg, model=model)
            engine.set_drafter(drafter if budget else None)
            prompt = np.random.default_rng(ctx).integers(0, model.config.vocab_size, ctx).tolist()
            engine.add_request("e", prompt, SamplingParams(max_tokens=new, ignore_eos=True),
                               budget)
            t0 = time.perf_counter()
            while engine.has_unfinished and not engine.requests["e"].output_ids:
                engine.step()
            sync(a.device)
            prefill_s = time.perf_counter() - t0
            ms, commits = [], []
            while engine.has_unfinished and len(ms) < a.engine_steps + 2:
                t0 = time.perf_counter()
                outs = engine.step()
                sync(a.device)
                ms.append((time.perf_counter() - t0) * 1e3)
                commits.append(sum(len(o.new_token_ids) for o in outs))
            if engine.has_unfinished:
                engine.abort("e")
            del engine
            if a.cuda:
                torch.cuda.empty_cache()
            ms, commits = ms[2:], commits[2:]  # first steps: compile / warm-up
            row = dict(ctx=ctx, budget=budget, prefill_s=prefill_s, steps=len(ms),
                       step_ms=med(ms), step_ms_min=min(ms) if ms else None,
                       tokens_per_step=sum(commits) / max(len(commits), 1),
                       before_ms=BEFORE.get(("ar", ctx, 0)) if budget == 0 else None)
            out.append(row)
            log(f"engine ctx={ctx} budget={budget}: {row['step_ms']:.2f} ms/step "
                f"(prefill {prefill_s:.2f} s)")


def host_costs(a, res, model, runner) -> None:
    """[4] Host µs per call (enqueue only) of single pieces at the largest context, budget 16."""
    import torch.nn.functional as F

    from specserve.models import decoder, lean

    dev, kv = a.device, runner.kv
    ctx, n = max(a.ctxs), a.budgets[0] + 1
    rid = "h"
    runner.blocks.reserve(rid, ctx + n)
    runner.blocks.ensure(rid, ctx + n)
    lay = verify_layout(random_tree(n - 1, model.config.vocab_size,
                                    np.random.default_rng(1)), 3, ctx)
    args = ([n], [ctx], [runner.blocks.page_table(rid)], lay.positions, a.page_size, [lay.mask],
            dev)
    batch = AttnBatch.build(*args)
    c = model.config
    x = torch.randn(n, c.hidden_size, device=dev, dtype=runner.dtype)
    q = torch.randn(n, c.num_heads, c.head_dim, device=dev, dtype=runner.dtype)
    k = torch.randn(n, c.num_kv_heads, c.head_dim, device=dev, dtype=runner.dtype)
    layer = model.model.layers[0]
    cos, sin = model.rotary.rolled_tables(batch.positions, runner.dtype)
    fused = model._fused[0] if getattr(model, "_fused", None) else None
    pieces = {
        "trivial op (x + 1): this host's floor per torch op": lambda: x + 1,
        "torch.empty (small)": lambda: torch.empty(n, 8, device=dev),
        "F.linear qkv (fused [hidden → (Hq+2Hkv)·D])": (
            (lambda: F.linear(x, fused.qkv_w)) if fused is not None else None),
        "rms_norm (F.rms_norm × weight)": lambda: decoder.rms_norm(
            x, layer.input_layernorm.weight, 1e-6),
        "rotary tables (once per step)": lambda: model.rotary.rolled_tables(batch.positions,
                                                                            runner.dtype),
        "KVPool.write (K and V)": lambda: kv.write(0, batch.slot_mapping, k, k),
        "attention backend (launcher + 2 kernels)": lambda: model.attn_backend(
            q, kv.k[0], kv.v[0], batch, c.head_dim**-0.5),
        "one decoder layer (inference path)": lambda: lean.layer_inference(
            layer, fused, x, cos, sin, batch, kv, model.attn_backend),
        "whole model forward (all layers)": lambda: model(
            torch.as_tensor(lay.token_ids, device=dev), batch, kv),
        "AttnBatch.build (host lists → device, 1 copy)": lambda: AttnBatch.build(*args),
    }
    out = res.setdefault("host_us", {})
    with torch.inference_mode():
        for name, fn in pieces.items():
            if fn is None:
                continue
            try:
                for _ in range(3):
                    fn()
                sync(dev)
                reps = 5 if name.startswith("whole") else 50
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                us = (time.perf_counter() - t0) / reps * 1e6
                sync(dev)
                out[name] = us
            except Exception as e:  # noqa: BLE001 — report, go on
                out[name] = f"error: {type(e).__name__}: {e}"
    if isinstance(out.get("whole model forward (all layers)"), float):
        out["per layer (whole forward / layers)"] = (
            out["whole model forward (all layers)"] / c.num_layers)
    runner.blocks.free(rid)


def profile_steps(a, res, model, runner) -> None:
    """[5] torch.profiler over model steps (verify, budget 16, largest ctx) and runner steps."""
    from torch.profiler import ProfilerActivity, profile

    dev, kv = a.device, runner.kv
    ctx, budget = max(a.ctxs), a.budgets[0]
    rid = "q"
    runner.blocks.reserve(rid, ctx + budget + 1)
    runner.blocks.ensure(rid, ctx + budget + 1)
    vocab = model.config.vocab_size
    lay = verify_layout(random_tree(budget, vocab, np.random.default_rng(2)), 3, ctx)
    batch = AttnBatch.build([budget + 1], [ctx], [runner.blocks.page_table(rid)], lay.positions,
                            a.page_size, [lay.mask], dev)
    ids = torch.as_tensor(lay.token_ids, device=dev)
    inp = [ForwardInput(rid, lay.token_ids, lay.positions, ctx_len=ctx, tree_mask=lay.mask,
                        pages=runner.blocks.page_table(rid))]
    lay1 = verify_layout(DraftTree.empty(), 3, ctx)
    inp1 = [ForwardInput(rid, lay1.token_ids, lay1.positions, ctx_len=ctx, tree_mask=lay1.mask,
                         pages=runner.blocks.page_table(rid))]
    steps = {
        f"model step verify ctx={ctx} budget={budget}": lambda: model.logits(
            model(ids, batch, kv)[0]).argmax(-1),
        f"runner step verify ctx={ctx} budget={budget}": lambda: runner.forward(
            inp, range(budget + 1))[0].argmax(-1).tolist(),
        f"runner step AR ctx={ctx}": lambda: runner.forward(inp1, [0])[0].argmax(-1).tolist(),
    }
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.cuda else [])
    out = res.setdefault("profile", {})
    n = 3
    for name, fn in steps.items():
        if time.time() - T0 > a.budget_s * 0.9:
            out[name] = {"skipped": "time budget"}
            continue
        with torch.inference_mode():
            for _ in range(2):
                fn()
            sync(dev)
            t0 = time.perf_counter()
            with profile(activities=acts, record_shapes=False) as prof:
                for _ in range(n):
                    fn()
                sync(dev)
            wall = (time.perf_counter() - t0) / n * 1e3
        out[name] = summarize(prof, n, wall, a.cuda)
        log(f"profiled {name}")
    runner.blocks.free(rid)


def summarize(prof, n: int, wall_ms: float, cuda: bool) -> dict:
    evs = prof.events()
    counts = collections.Counter(e.name for e in evs)
    top_level = sum(1 for e in evs if e.cpu_parent is None and e.name.startswith("aten::"))
    gpu_us = 0.0
    if cuda:
        for e in evs:
            if str(getattr(e, "device_type", "")).endswith("CUDA"):  # a kernel / memcpy
                gpu_us += float(e.time_range.elapsed_us())
    cpu_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                          max_name_column_width=60)
    gpu_table = None
    if cuda:
        for key in ("self_device_time_total", "device_time_total", "cuda_time_total"):
            try:
                gpu_table = prof.key_averages().table(sort_by=key, row_limit=25,
                                                      max_name_column_width=60)
                break
            except Exception:  # noqa: BLE001 — key names differ between torch versions
                continue
    return dict(
        steps=n, wall_ms_per_step=wall_ms,
        aten_top_level_ops_per_step=top_level / n,
        kernel_launches_per_step=sum(counts[k] for k in LAUNCH_EVENTS) / n,
        h2d_d2h_copies_per_step=sum(counts[k] for k in COPY_EVENTS) / n,
        host_syncs_per_step={k: counts[k] / n for k in SYNC_EVENTS if counts[k]},
        gpu_kernel_ms_per_step=gpu_us / 1e3 / n if cuda else None,
        gpu_busy_fraction=(gpu_us / 1e3 / n) / wall_ms if cuda and wall_ms else None,
        cpu_table=cpu_table, gpu_table=gpu_table)


def sync_debug(a, res, model, runner, dtype_name) -> None:
    """[6] Every synchronising CUDA call in one runner step and one engine verify step."""
    if not a.cuda:
        res["syncs"] = {"note": "CUDA only"}
        return
    from specserve.engine.engine import Engine

    ctx, budget = min(a.ctxs), a.budgets[0]
    rid = "s"
    runner.blocks.reserve(rid, ctx + budget + 1)
    runner.blocks.ensure(rid, ctx + budget + 1)
    lay = verify_layout(random_tree(budget, model.config.vocab_size,
                                    np.random.default_rng(4)), 3, ctx)
    inp = [ForwardInput(rid, lay.token_ids, lay.positions, ctx_len=ctx, tree_mask=lay.mask,
                        pages=runner.blocks.page_table(rid))]
    tokens = ctx + 8 * (budget + 1) + budget + 2
    cfg = EngineConfig(model_dir="/nonexistent/random-weights", dtype=dtype_name,
                       device=a.device, page_size=a.page_size,
                       num_pages=pages_for(tokens + budget + 1, a.page_size) + 2, max_num_seqs=1,
                       max_num_batched_tokens=a.chunk, max_model_len=tokens,
                       max_draft_tokens=budget)
    engine = Engine(cfg, model=model)
    engine.set_drafter(RandomTreeDrafter(model.config.vocab_size))
    prompt = np.random.default_rng(9).integers(0, model.config.vocab_size, ctx).tolist()
    engine.add_request("s", prompt, SamplingParams(max_tokens=8, ignore_eos=True), budget)
    while not engine.requests["s"].output_ids:
        engine.step()
    engine.step()  # warm
    out = {}
    for name, fn in ((f"runner step verify ctx={ctx} budget={budget}",
                      lambda: runner.forward(inp, range(budget + 1))[0].argmax(-1).tolist()),
                     (f"engine step verify ctx={ctx} budget={budget}", engine.step)):
        with torch.inference_mode():
            fn()
        sync(a.device)
        out[name] = count_syncs(fn)
        log(f"syncs in {name}: {out[name]['total']}")
    if engine.has_unfinished:
        engine.abort("s")
    runner.blocks.free(rid)
    res["syncs"] = out


def count_syncs(fn) -> dict:
    sites: collections.Counter = collections.Counter()
    original = warnings.showwarning

    def hook(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return original(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1]
                  if f.filename.startswith(REPO) and not f.filename.endswith("profile_step.py")]
        where = (f"{os.path.relpath(frames[-1].filename, REPO)}:{frames[-1].lineno} "
                 f"{frames[-1].line}" if frames else "(outside the repo)")
        sites[where] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.inference_mode():
                fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = original
    return dict(total=sum(sites.values()), by_site=dict(sites.most_common()))


# ---- report -------------------------------------------------------------------------------
def report(res: dict) -> str:
    m = res["meta"]
    lines = [f"== profile_step: {m['device']} | torch {m['torch']} | triton {m['triton']} | "
             f"{m['model']} | fused projections: {m.get('fused')}",
             f"   host: {m['cpu']}; weights {m.get('weight_GB', 0):.2f} GB; memory floor of a "
             f"step ≈ weights / copy BW = {m.get('floor_ms', float('nan')):.2f} ms (+ KV)"]
    lines += ["", "[1][2] per step, batch 1 (ms; median). model = DecoderModel + logits + argmax "
              "over a prebuilt batch (bench_e2e 'verify');",
              "       runner = ModelRunner.forward from host lists + argmax.tolist(). "
              "host-bound when enqueue ≈ gpu.",
              f"  {'ctx':>6} {'budget':>6} {'model gpu':>10} {'enqueue':>8} {'runner':>8} "
              f"{'before(BENCH run1)':>19}  verdict"]
    for r in res.get("steps", []):
        if "skipped" in r:
            lines.append(f"  {r['ctx']:>6} {r['budget']:>6}  skipped: {r['skipped']}")
            continue
        mm, rr = r["model"], r["runner"]
        verdict = ("HOST-BOUND" if mm["enqueue_ms"] >= 0.8 * mm["gpu_ms"] else "gpu-bound"
                   ) if res["meta"]["cuda"] else "(cpu)"
        before = f"{r['before_ms']:.2f}" if r.get("before_ms") else "-"
        lines.append(f"  {r['ctx']:>6} {r['budget']:>6} {mm['gpu_ms']:>10.2f} "
                     f"{mm['enqueue_ms']:>8.2f} {rr['wall_ms']:>8.2f} {before:>19}  {verdict}")
    lines += ["", "[3] Engine.step() after prefill (ms/step, synced; budget 0 = AR decode; "
              "random trees commit ≈ 1 token/step)"]
    for r in res.get("engine", []):
        if "skipped" in r or "error" in r:
            lines.append(f"  ctx={r['ctx']} budget={r['budget']}: "
                         f"{r.get('skipped') or r.get('error')}")
            continue
        before = f" (before: {r['before_ms']:.2f})" if r.get("before_ms") else ""
        lines.append(f"  ctx={r['ctx']:>6} budget={r['budget']:>3}: {r['step_ms']:.2f} ms/step"
                     f"{before}, {r['tokens_per_step']:.2f} tokens/step, prefill "
                     f"{r['prefill_s']:.2f} s")
    lines += ["", "[4] host µs per call (enqueue only, no sync; largest ctx, budget 16)"]
    for name, us in res.get("host_us", {}).items():
        lines.append(f"  {us:>10.1f}  {name}" if isinstance(us, float) else f"  {name}: {us}")
    lines += ["", "[5] profiler (per step): aten ops issued from Python, kernel launches, "
              "copies, host syncs, GPU busy"]
    for name, p in res.get("profile", {}).items():
        if "skipped" in p:
            lines.append(f"  {name}: skipped ({p['skipped']})")
            continue
        busy = (f"GPU kernels {p['gpu_kernel_ms_per_step']:.2f} ms = "
                f"{100 * p['gpu_busy_fraction']:.0f}% of the step"
                if p.get("gpu_kernel_ms_per_step") is not None else "GPU n/a")
        lines.append(f"  {name}: {p['wall_ms_per_step']:.2f} ms/step (profiled); aten ops "
                     f"{p['aten_top_level_ops_per_step']:.0f}; launches "
                     f"{p['kernel_launches_per_step']:.0f}; copies "
                     f"{p['h2d_d2h_copies_per_step']:.0f}; syncs {p['host_syncs_per_step']}; "
                     f"{busy}")
    for name, p in res.get("profile", {}).items():
        if "cpu_table" in p:
            lines += ["", f"  -- {name}: top 25 by self CPU time (3 steps)", p["cpu_table"]]
            if p.get("gpu_table"):
                lines += [f"  -- {name}: top 25 by GPU time (3 steps)", p["gpu_table"]]
    lines += ["", "[6] synchronising CUDA calls (set_sync_debug_mode), by the repo line that "
              "made them"]
    syncs = res.get("syncs", {})
    if "note" in syncs:
        lines.append(f"  {syncs['note']}")
    for name, s in syncs.items():
        if isinstance(s, dict) and "total" in s:
            lines.append(f"  {name}: {s['total']} sync(s)")
            lines += [f"    {c:>3} × {site}" for site, c in s["by_site"].items()]
    lines += ["", "How to read: per-step host cost ≈ 'enqueue'; when it is ≥ the GPU time the "
              "step is launch-bound and", "CUDA graphs (next step) remove it. Expected syncs: "
              "the argmax .tolist() of the acceptance walk (one per request per step)."]
    return "\n".join(lines)


def _git() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True, timeout=10).stdout
        return (head + ("+dirty" if dirty.strip() else "")) or None
    except Exception:  # noqa: BLE001 — the device copy may have no .git
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} × {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{os.cpu_count()} cores"


def save(a, res) -> None:
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1, default=str))


def main(argv=None) -> int:
    a = parse_args(argv)
    dtype_name = "bfloat16" if a.cuda else "float32"
    dtype = getattr(torch, dtype_name)
    import triton

    res: dict = {"meta": dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(  # noqa: UP017
            timespec="seconds"),
        command="python3 " + " ".join(sys.argv), git=_git(), cuda=a.cuda,
        device=torch.cuda.get_device_name() if a.cuda else "cpu", torch=torch.__version__,
        triton=triton.__version__, cpu=_cpu_name(), args=vars(a))}
    log(f"{res['meta']['device']} | {res['meta']['cpu']} | git {res['meta']['git']}")
    model, shape = build_target(a, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ceil = ceilings(a.device, a.tiny)
    res["meta"].update(model=f"{shape['num_layers']} layers, hidden {shape['hidden_size']}, "
                       f"{shape['num_heads']}/{shape['num_kv_heads']} heads × "
                       f"{shape['head_dim']}, vocab {shape['vocab_size']}, {dtype_name}",
                       weight_GB=weight_bytes / 1e9, ceilings=ceil,
                       floor_ms=weight_bytes / (ceil["copy_GBps"] * 1e9) * 1e3)
    log(f"model built: {res['meta']['model']}")
    timer = Timer(a.device)
    runner = make_runner(a, model, dtype_name, max(a.ctxs) + max(a.budgets) + 64)
    res["meta"]["fused"] = getattr(model, "_fused", None) is not None
    gen = torch.Generator(device=a.device).manual_seed(7)
    for t in runner.kv.k + runner.kv.v:  # random prefix K/V (no long prefill needed)
        t.normal_(0.0, 1.0, generator=gen)
    sections = (("steps", lambda: model_and_runner_steps(a, res, model, runner, timer)),
                ("host_us", lambda: host_costs(a, res, model, runner)),
                ("profile", lambda: profile_steps(a, res, model, runner)),
                ("syncs", lambda: sync_debug(a, res, model, runner, dtype_name)))
    for name, fn in sections:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 — one section's failure must not lose the others
            res.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        save(a, res)
    runner = None  # free its KV pool before the engines allocate theirs
    if a.cuda:
        torch.cuda.empty_cache()
    try:
        engine_steps(a, res, model, dtype_name)
    except Exception as e:  # noqa: BLE001
        res.setdefault("errors", {})["engine"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    res["elapsed_s"] = time.time() - T0
    save(a, res)
    print("\n" + report(res), flush=True)
    if res.get("errors"):
        print(f"\nERRORS: {json.dumps(res['errors'], indent=1)}", flush=True)
    print(f"\nwrote {a.out} ({res['elapsed_s']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
