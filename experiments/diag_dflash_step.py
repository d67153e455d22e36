"""Where a DFlash decode step's time goes in our engine (issue 9 decode, H200 diagnostic).

bench_e2e's decode section measures our DFlash step (random 5-layer drafter, chain of 15, so
commit ≈ 1) at 8.3 ms at 1k while the verify it contains is 4.9 ms and the drafter's GPU work
≈ 1.5 ms. This script runs the same engine, target, drafter and prompt and splits each step:

  engine phases  from `Engine.last_step` (ns stamps): schedule + draft (speculative.plan), verify
                 (scratch rows, inputs, the forward and its sync), commit (accept walk, KV
                 compaction, appends); the drafter's own split (`last_stats`: forward incl.
                 context write, tree); wall = engine.step() + a sync, as bench_e2e times it.
  timers         (a second pass) each of TIMED wrapped in synchronised timers: ms per step in
                 each (nested ones inside their callers; the syncs add a little to each);
  profiler       torch.profiler (CPU + CUDA) over --profile-steps steps: per step the GPU busy
                 time (sum of kernel times: kernels that overlap, such as a PDL-launched kernel
                 waiting on the one before it, count twice), launches, graph launches, H2D / D2H
                 copies and syncs;
                 the top CPU ops by self time and the top kernels by GPU time.

    PYTHONPATH=.:bench python3 experiments/diag_dflash_step.py [--ctxs 1024,32768] [--new 64]
        [--out $OUT/diag_dflash.json]
    PYTHONPATH=.:bench python3 experiments/diag_dflash_step.py --drafter replay --new 256
        # the replay drafter's steps
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch
from _e2e_common import BLOCK_SIZE, Bench, p90, prompt_ids, sync
from _e2e_engine import make_engine
from bench_e2e import parse_args, setup

from specserve.drafters.dflash import DFlashDrafter
from specserve.engine.warmup import warm_up_drafter
from specserve.kvcache.block_manager import pages_for
from specserve.types import SamplingParams

COUNTED = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
           "cudaGraphLaunch", "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize",
           "cudaEventSynchronize")


TIMED = [("specserve.engine.speculative", None, "plan"),
         ("specserve.engine.speculative", None, "draft_requests"),
         ("specserve.drafters.dflash", "DFlashDrafter", "_run"),
         ("specserve.drafters.dflash", "DFlashDrafter", "_write_context"),
         ("specserve.drafters.dflash", "DFlashDrafter", "_trees"),
         ("specserve.drafters.dflash_cache", "DFlashContextCache", "begin"),
         ("specserve.drafters.dflash_graphs", "DraftGraphs", "run"),
         ("specserve.drafters.dflash_graphs", "DraftGraphs", "_fill"),
         ("specserve.drafters.dflash_graphs", "DraftGraphs", "_replay"),
         ("specserve.engine.graphs", "StepGraphs", "_fill"),
         ("specserve.engine.graphs", "StepGraphs", "_replay"),
         ("specserve.engine.postprocess", None, "accept"),
         ("specserve.engine.runner", "ModelRunner", "forward"),
         ("specserve.engine.postprocess", None, "commit_trees"),
         ("specserve.engine.engine", "Engine", "commit_tokens"),
         ("specserve.engine.speculative", None, "verify_layout"),
         ("specserve.kvcache.pool", "KVPool", "copy_slots"),
         ("replay_drafter", "ReplayDrafter", "draft")]


def _timers(dev) -> tuple[dict, list]:
    """Wrap every TIMED function in a synchronised timer; returns (ms totals, undo list)."""
    import importlib

    totals: dict = collections.Counter()
    undo = []
    for mod_name, cls_name, attr in TIMED:
        owner = importlib.import_module(mod_name)
        owner = getattr(owner, cls_name) if cls_name else owner
        fn = getattr(owner, attr)
        key = f"{cls_name or mod_name.rsplit('.', 1)[1]}.{attr}"

        def timed(*a, _fn=fn, _key=key, **k):
            sync(dev)
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                sync(dev)
                totals[_key] += (time.perf_counter() - t0) * 1e3

        setattr(owner, attr, timed)
        undo.append((owner, attr, fn))
    return totals, undo


class _GcPauses:
    """Python garbage-collector pauses (gc.callbacks): ms of the ones since the last `take`."""

    def __init__(self) -> None:
        self.t0, self.ms = 0.0, []
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            self.ms.append((info["generation"], (time.perf_counter() - self.t0) * 1e3))

    def take(self) -> list:
        got, self.ms = self.ms, []
        return got


GC = _GcPauses()


def _steps(engine, drafter, dev, n: int) -> list[dict]:
    """n decode steps: wall, the engine's / drafter's phases and the GC pauses inside, ms."""
    out = []
    for _ in range(n):
        if not engine.has_unfinished:
            break
        GC.take()
        ts = time.perf_counter()
        engine.step()
        sync(dev)
        wall = (time.perf_counter() - ts) * 1e3
        pauses = GC.take()
        t, st = engine.last_step, getattr(drafter, "last_stats", None)
        out.append(dict(wall=wall, draft=(t.draft_end_ns - t.start_ns) / 1e6,
                        verify=(t.verify_end_ns - t.draft_end_ns) / 1e6,
                        commit=(t.end_ns - t.verify_end_ns) / 1e6,
                        outside=wall - (t.end_ns - t.start_ns) / 1e6,
                        gc=sum(ms for _, ms in pauses), gc_gen=max((g for g, _ in pauses),
                                                                    default=None)))
        if st is not None:
            out[-1].update(drafter_forward=st.forward_s * 1e3, drafter_tree=st.tree_s * 1e3)
    return out


def _spread(steps: list[dict]) -> tuple[dict, dict, list]:
    """(median per phase, {phase: mean / p90 / max}, the steps slower than 1.5 × the median
    wall with their index) of `_steps`' rows."""
    keys = [k for k in steps[0] if k != "gc_gen"]
    med = {k: statistics.median(s[k] for s in steps) for k in keys}
    spread = {}
    for k in keys:
        xs = [s[k] for s in steps]
        spread[k] = dict(mean=sum(xs) / len(xs), p90=p90(xs), max=max(xs))
    slow = [dict(step=i) | s for i, s in enumerate(steps) if s["wall"] > 1.5 * med["wall"]]
    return med, spread, slow


def _replay_drafter(engine, vocab: int, prompt: list[int], params, budget: int):
    """The replay drafter over the target's greedy continuation (one AR run first)."""
    from replay_drafter import ReplayDrafter

    engine.add_request("ar", prompt, params, 0)
    ref = []
    while engine.has_unfinished:
        ref += [t for o in engine.step() for t in o.new_token_ids]
    drafter = ReplayDrafter(vocab, budget, 8.0)
    drafter.set_reference("r", len(prompt), ref)
    return drafter


def _profile(engine, dev, n: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            engine.step()
            sync(dev)
    counts: dict = collections.Counter()
    kernels: dict = collections.Counter()
    launches: dict = collections.Counter()
    for e in prof.events():
        if str(e.device_type).endswith("CUDA"):
            kernels[e.name[:110]] += e.device_time
            launches[e.name[:110]] += 1
        elif e.name in COUNTED:
            counts[e.name] += 1
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    top = [dict(us_per_step=us / n, launches_per_step=launches[name] / n, name=name)
           for name, us in kernels.most_common(16)]
    return dict(steps=n, gpu_busy_ms_per_step=sum(kernels.values()) / n / 1e3,
                calls_per_step={k: v / n for k, v in sorted(counts.items())}, cuda_top=top,
                cpu_table=table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctxs", default="1024,32768")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on the tiny model")
    ap.add_argument("--max-len", type=int, default=0,
                    help="the engine's max_model_len (0: the context + what the run needs)")
    ap.add_argument("--drafter", default="dflash", choices=("dflash", "replay"),
                    help="replay: the BENCHMARK-ONLY replay drafter (a chain of "
                         "--replay-budget, commit 8) over the target's own greedy continuation")
    ap.add_argument("--unfused-drafter", action="store_true",
                    help="the DFlash drafter's block forward through its modules "
                         "(fused_layers=False; default: the fused layers)")
    ap.add_argument("--replay-budget", type=int, default=BLOCK_SIZE - 1,
                    help="the replay drafter's chain length (tree budget)")
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "diag_dflash.json"))
    args = ap.parse_args()
    meta = str(Path(args.out).with_suffix(".bench.json"))  # where setup() saves its JSON
    b = Bench(parse_args(["--sections", "decode", "--out", meta] + (["--tiny"] if args.tiny
                                                                    else [])))
    setup(b)
    res = dict(device=torch.cuda.get_device_name() if b.device.type == "cuda" else "cpu",
               rows=[])
    vocab = b.target.config.vocab_size
    with torch.inference_mode():
        for ctx in (int(c) for c in args.ctxs.split(",")):
            engine = make_engine(b, max(args.max_len, ctx + args.new + 2 * BLOCK_SIZE + 1),
                                 BLOCK_SIZE)
            prompt, params = prompt_ids(vocab, ctx), SamplingParams(max_tokens=args.new,
                                                                    ignore_eos=True)
            if args.drafter == "replay":
                budget = args.replay_budget
                drafter = _replay_drafter(engine, vocab, prompt, params, budget)
            else:
                pages = pages_for(ctx + args.new + BLOCK_SIZE + 1, 16) + 4
                drafter = DFlashDrafter(b.drafter, pages, 16, tree=False,
                                        graphs=b.device.type == "cuda",
                                        fused_layers=not args.unfused_drafter)
                warm_up_drafter(drafter, min(300, ctx))  # as the drafter service does first
                budget = BLOCK_SIZE - 1
            engine.set_drafter(drafter)
            engine.add_request("r", prompt, params, budget)
            while engine.has_unfinished and not engine.step():  # prefill
                pass
            _steps(engine, drafter, b.device, 4)  # warm-up
            left = args.new - 24 - args.profile_steps if args.drafter == "dflash" else 12
            steps = _steps(engine, drafter, b.device, left)
            prof = _profile(engine, b.device, args.profile_steps)
            totals, undo = _timers(b.device)
            try:
                timed = _steps(engine, drafter, b.device, 8 if args.drafter == "dflash" else 4)
            finally:
                for owner, attr, fn in undo:
                    setattr(owner, attr, fn)
            timers = {k: v / len(timed) for k, v in sorted(totals.items())}
            med, spread, slow = _spread(steps)
            res["rows"].append(dict(ctx=ctx, budget=budget, steps=len(steps), median_ms=med,
                                    spread_ms=spread, slow_steps=slow, step_ms=steps,
                                    profile=prof, timers_ms=timers,
                                    timed_wall_ms=statistics.median(t["wall"] for t in timed)))
            print(f"ctx {ctx}: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()), flush=True)
            print(f"  wall mean {spread['wall']['mean']:.3f}, p90 {spread['wall']['p90']:.3f}, "
                  f"max {spread['wall']['max']:.3f}; {len(slow)} steps > 1.5 × median: "
                  + "; ".join(", ".join(f"{k} {v:.2f}" for k, v in s.items() if v is not None)
                              for s in slow[:6]), flush=True)
            print(f"  timers (wall {res['rows'][-1]['timed_wall_ms']:.2f}): " + ", ".join(
                f"{k} {v:.3f}" for k, v in timers.items()), flush=True)
            print(f"  GPU busy {prof['gpu_busy_ms_per_step']:.3f} ms/step; per step "
                  + ", ".join(f"{k} {v:.1f}" for k, v in prof["calls_per_step"].items()))
            print(prof["cpu_table"], flush=True)
            while engine.has_unfinished:
                engine.step()
            del engine, drafter
            b.free()
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
