"""Sections `prefill` and `decode` of bench/bench_e2e.py, through the real `Engine`.

prefill: one request of T random tokens, max_tokens 1, chunks of `--chunk` tokens per engine
  step; after a warm-up as the verifier's (compiles, and on CUDA `attention.prefill_warmup.warm_up`:
  cuDNN's per-shape plans of the chunks up to the longest prompt), wall time from add_request to
  the first token, synchronised per chunk. Floors (FLOPs over this
  run's matmul rate):  issue-9 formula  2·P·T + 2·L·Hq·D·T²  (P = all parameters, as issue 9
  counts them) and a strict one  2·P_layers·T + 2·P_head + 2·L·Hq·D·T²  (the embedding is a
  gather and the LM head runs for one row).
decode: per context, greedy with ignore_eos: (1) plain AR (budget 0); (2) speculation with the
  BENCHMARK-ONLY replay drafter (bench/replay_drafter.py) replaying (1)'s output as a chain of
  `--replay-budget` tokens at a target mean commit length; if the target's greedy choice under
  the tree-verify numerics leaves the AR reference (near-tied bf16 logits), the run is repeated
  with its own output as the reference (`passes`) until it stays on it; (3) speculation with our
  DFlash drafter (random weights: it is never right, so this is the per-step cost of a DFlash
  step, drafter forward included, at commit length ≈ 1), the drafter and the engine's graphs
  for its tap layers warmed first as the services warm them (every block length, every tree
  size), so the last steps before max_tokens replay too. Decode figures skip the first
  `--warm-steps` steps (compile / warm-up); commit_len averages steps not cut by max_tokens;
  each row keeps every timed step's ms (`step_ms`), its p90 and max.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from dataclasses import dataclass, field
from functools import partial

from _e2e_common import BLOCK_SIZE, median, p90, prompt_ids, sync
from replay_drafter import ReplayDrafter

from specserve.attention import prefill_warmup
from specserve.config import EngineConfig
from specserve.drafters.dflash import DFlashDrafter
from specserve.engine.engine import Engine
from specserve.engine.warmup import warm_up_drafter
from specserve.kvcache.block_manager import pages_for
from specserve.types import SamplingParams


def make_engine(b, tokens: int, max_draft: int = 0) -> Engine:
    """An engine over the bench's target whose KV pool (from a byte budget) holds `tokens`."""
    a = b.args
    pages = pages_for(tokens, a.page_size) + 2
    cfg = EngineConfig(model_dir="/nonexistent/random-weights", dtype=a.dtype,
                       device=str(b.device), page_size=a.page_size,
                       kv_memory_bytes=pages * a.page_size * b.bytes_per_token(), max_num_seqs=1,
                       max_num_batched_tokens=a.chunk, max_model_len=tokens,
                       max_draft_tokens=max_draft)
    return Engine(cfg, model=b.target)


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    chunk_s: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    step_commit: list[int] = field(default_factory=list)
    step_cut: list[bool] = field(default_factory=list)
    fallbacks: int = 0


def generate(b, engine: Engine, rid: str, prompt: list[int], new: int, budget: int = 0,
             drafter=None, label: str = "") -> Run:
    """One greedy request to completion, every step timed (synchronised)."""
    engine.set_drafter(drafter)
    engine.add_request(rid, prompt, SamplingParams(max_tokens=new, ignore_eos=True), budget)
    run, dev = Run(), b.device
    sync(dev)
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished:
            if b.out_of_time(-b.args.overrun_s):
                raise TimeoutError(f"time budget exhausted during {label or rid}")
            ts = time.perf_counter()
            outs = engine.step()
            sync(dev)
            dt = time.perf_counter() - ts
            got = [t for o in outs for t in o.new_token_ids]
            if not run.tokens:  # still prefilling (the last chunk yields the first token)
                run.chunk_s.append(dt)
                done = len(prompt) if got else len(run.chunk_s) * b.args.chunk
                if len(run.chunk_s) % 4 == 0 or got:
                    b.log(f"  {label} prefill {min(done, len(prompt))}/{len(prompt)} tokens "
                          f"{time.perf_counter() - t0:.2f} s")
                if got:
                    run.prefill_s = time.perf_counter() - t0
                    run.tokens.extend(got)
                continue
            step = next((o.stats.step for o in outs if o.stats is not None), None)
            run.step_ms.append(dt * 1e3)
            run.step_commit.append(step.commit_len if step else len(got))
            run.step_cut.append(bool(step and step.cut))
            run.fallbacks += bool(step and step.fallback)
            run.tokens.extend(got)
    except BaseException:
        with contextlib.suppress(Exception):  # no half-run request left for the next run
            engine.abort(rid)
        raise
    return run


def summary(run: Run, warm: int) -> dict:
    k = min(warm, max(len(run.step_ms) - 1, 0))
    ms, n = run.step_ms[k:], run.step_commit[k:]
    full = [c for c, cut in zip(run.step_commit, run.step_cut, strict=True) if not cut]
    return dict(new_tokens=len(run.tokens), steps=len(run.step_ms), timed_steps=len(ms),
                prefill_s=run.prefill_s, ms_per_step=median(ms),
                ms_per_step_mean=sum(ms) / len(ms) if ms else float("nan"),
                ms_per_step_p90=p90(ms),
                ms_per_step_max=max(ms, default=float("nan")), step_ms=[round(x, 3) for x in ms],
                tok_per_s=sum(n) / (sum(ms) / 1e3) if ms else float("nan"),
                commit_len=sum(full) / len(full) if full else float("nan"),
                fallbacks=run.fallbacks, head_tokens=run.tokens[:16])


def _try(b, sec: dict, row: dict, fn) -> dict:
    """Run one measurement; an exception (CUDA OOM, timeout) becomes the row's error."""
    try:
        row.update(fn())
    except Exception as e:  # noqa: BLE001 — record and go on
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
        b.free()
    sec["rows"].append(row)
    b.save()
    return row


def run_prefill(b) -> None:
    a, sec = b.args, b.results["prefill"]
    c, counts = b.target.config, b.counts
    vocab = c.vocab_size
    warm = min(2 * a.chunk, min(a.prefill_lens))
    try:  # compiles the chunk kernels (first chunk and one over a paged prefix)
        engine = make_engine(b, warm + 1)
        generate(b, engine, "warm", prompt_ids(vocab, warm), 1, label=f"warm-up {warm}")
        if b.device.type == "cuda":  # as the verifier's warm-up: cuDNN plans of the chunks
            t0 = time.perf_counter()
            prefill_warmup.warm_up(c.num_heads, c.num_kv_heads, c.head_dim, engine.runner.dtype,
                                   b.device, a.page_size, chunk=a.chunk,
                                   max_len=max(a.prefill_lens))
            sec["plan_warmup_s"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 — the timed runs below still try
        sec["warmup_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    engine = None
    b.free()
    prev = None
    for T in sorted(a.prefill_lens):
        row = dict(impl="ours", tokens=T, chunk=a.chunk)
        est = None if prev is None else prev[1] * (T / prev[0]) ** 1.7
        if prev is not None and prev[1] > a.prefill_skip_s:
            row["skipped"] = f"{prev[0]} tokens took {prev[1]:.0f} s > {a.prefill_skip_s:.0f} s"
        elif b.out_of_time(10 if est is None else est):
            row["skipped"] = f"time budget (estimate {est or 0:.0f} s)"
        if "skipped" in row:
            sec["rows"].append(row)
            b.log(f"prefill {T}: skipped ({row['skipped']})")
            continue

        def measure(T=T) -> dict:
            engine = make_engine(b, T + 1)
            times, first = [], None
            for rep in range(a.prefill_reps):
                if rep and (times[0] > a.prefill_rep_s or b.out_of_time(times[0] + 5)):
                    break
                run = generate(b, engine, f"p{T}-{rep}", prompt_ids(vocab, T), 1,
                               label=f"prefill {T}")
                times.append(run.prefill_s)
                first = run.tokens[0]
            s = min(times)
            issue = 2 * counts["total"] * T + b.attn_flops_per_pair() * T * T / 2
            strict = (2 * counts["layers"] * T + 2 * counts["head"]
                      + b.attn_flops_per_pair() * T * T / 2)
            rate = b.ceil["matmul_TFLOPs"] * 1e12
            return dict(s=s, runs_s=times, tok_per_s=T / s, floor_s=issue / rate,
                        x_floor=s / (issue / rate), floor_strict_s=strict / rate,
                        x_floor_strict=s / (strict / rate), first_token=first)

        row = _try(b, sec, row, measure)
        b.free()
        if "s" in row:
            prev = (T, row["s"])
            b.log(f"prefill {T}: {row['s']:.2f} s (floor {row['floor_s']:.2f} s, "
                  f"×{row['x_floor']:.2f}; strict ×{row['x_floor_strict']:.2f}) {b.mem_note()}")


def run_decode(b) -> None:
    a, sec = b.args, b.results["decode"]
    vocab, new = b.target.config.vocab_size, a.new_tokens
    max_draft = max(a.replay_budget, BLOCK_SIZE - 1)
    for ctx in a.decode_ctxs:
        if b.out_of_time(15):
            sec["rows"].append(dict(ctx=ctx, impl="ours_ar", skipped="time budget"))
            continue
        try:
            engine = make_engine(b, ctx + a.new_tokens + max_draft + 1, max_draft)
        except Exception as e:  # noqa: BLE001
            sec["rows"].append(dict(ctx=ctx, impl="ours_ar", error=f"{type(e).__name__}: {e}"))
            continue
        prompt, state = prompt_ids(vocab, ctx), {}

        def ar(ctx=ctx, engine=engine, prompt=prompt, state=state) -> dict:
            run = generate(b, engine, f"ar{ctx}", prompt, new, label=f"AR {ctx}")
            state["ref"] = run.tokens
            return summary(run, a.warm_steps)

        def replay(ctx=ctx, engine=engine, prompt=prompt, state=state) -> dict:
            drafter = ReplayDrafter(vocab, a.replay_budget, a.commit_len, a.replay_mode)
            ref, passes, rid = state["ref"], 0, f"replay{ctx}"
            while True:
                drafter.set_reference(rid, len(prompt), ref)
                drafter.reset()
                run = generate(b, engine, rid, prompt, new, a.replay_budget, drafter,
                               label=f"replay {ctx}")
                passes += 1
                off = drafter.diverged_at.get(rid)
                if off is None or passes >= a.max_passes or b.out_of_time(10):
                    break
                b.log(f"  replay {ctx}: target left the reference at output {off}; rerun "
                      f"with its own output as the reference")
                ref = run.tokens
            return dict(**summary(run, a.warm_steps), target_commit_len=a.commit_len,
                        p=drafter.p, mode=a.replay_mode, budget=a.replay_budget, passes=passes,
                        diverged_at=off, benchmark_only=True)

        def dflash(ctx=ctx, engine=engine, prompt=prompt, fused=True) -> dict:
            pages = pages_for(ctx + new + BLOCK_SIZE + 1, a.page_size) + 4
            drafter = DFlashDrafter(b.drafter, pages, a.page_size, tree=False,
                                    graphs=a.draft_graphs, fused_layers=fused)
            warm_up_drafter(drafter, min(300, ctx))  # as the drafter service does first
            if engine.runner.graphs is not None:  # the verifier's warm-up with the drafter's
                engine.runner.graphs.warm(1, drafter.target_layer_ids)  # taps: every tree size
            run = generate(b, engine, f"dflash{ctx}{'' if fused else 'u'}", prompt, new,
                           BLOCK_SIZE - 1, drafter, label=f"DFlash {ctx}")
            return dict(**summary(run, a.warm_steps), budget=BLOCK_SIZE - 1, tree="chain",
                        fused_layers=fused)

        impls = [("ours_ar", ar), ("ours_spec_replay", replay), ("ours_dflash", dflash)]
        if a.unfused_drafter:  # the same DFlash run with the block forward through modules
            impls.append(("ours_dflash_unfused", partial(dflash, fused=False)))
        for impl, fn in impls:
            why = ("no AR reference" if impl != "ours_ar" and "ref" not in state else
                   "time budget" if b.out_of_time(5) else None)
            if why:
                sec["rows"].append(dict(ctx=ctx, impl=impl, skipped=why))
                continue
            row = _try(b, sec, dict(ctx=ctx, impl=impl), fn)
            b.log(f"decode {ctx} {impl}: " + (
                f"{row['tok_per_s']:.1f} tok/s, {row['ms_per_step']:.2f} ms/step, commit "
                f"{row['commit_len']:.2f}" if "tok_per_s" in row else str(row.get("error"))))
        del engine, ar, replay, dflash, fn, impls  # the closures hold the engine (its KV pool)
        b.free()
