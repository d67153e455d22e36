"""What a user gets through the three services vs the same engine in process, side by side.

One run: writes a random pair of real checkpoints (default: the Qwen3-8B body — 36 layers,
hidden 4096, 32/8 heads — with the demo tokenizer's 4096-token vocabulary, full attention, and
a 5-layer DFlash drafter tapping layers 1, 9, 17, 25, 33; or `--model/--draft-model`), starts
drafter + verifier + gateway, warms an in-process Engine + DFlashDrafter built from the very
same `VerifierConfig`, then runs the same requests (predictable text cut to each context,
`--new-tokens` each, budget `--budget`) in process and through the services, once per verifier
variant (`--variants`: `auto` = same host, context ring + lane; `grpc` = everything on the
gRPC stream, rows fc-projected, i.e. what crossing hosts costs; extra verifier flags after a
colon, e.g. `auto:--keep-context=off`; `--interference 32768`: a prompt of that length sent
while 7 requests of the shortest context decode — its TTFT and their steps meanwhile). Each
case's longest prompt runs once alone first (its TTFT in the JSON: `shapes_once_ttft_ms`, what
a first prompt of that length after start-up gets). Prints
TTFT, the first decode step (where a feed stall shows), steady step p50/p90 (mean / p99 / max,
and how far apart the requests' first tokens came) and tok/s with the ratios to in process,
next to the physical floors (prefill FLOPs / this run's matmul rate; a step's weights + KV
bytes / copy bandwidth); writes JSON after every row.

    python3 bench/bench_served.py --out $OUT/served.json                  # H200
    python3 bench/bench_served.py --mps --out $OUT/served_mps.json        # under CUDA MPS
    python3 bench/bench_served.py --tiny --contexts 64,200 --out /tmp/s.json   # CPU smoke
    python3 bench/bench_served.py --device cpu --model checkpoints/demo-target \
        --draft-model checkpoints/demo-drafter --kv-memory-gb 1 --chunk 2048   # CPU, demo pair
    python3 bench/bench_served.py --variants auto --batch8-contexts= --paired 6  # drift-free ratio
    python3 bench/bench_served.py --variants auto --apart --kv-memory-gb 20  # 128k on an H100
    python3 bench/bench_served.py --variants auto,auto:--adaptive=on --paired-variants 6  # A/B
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _served_models import BODY_8B, TAPS_8B, TINY, write_pair
from _served_paired import paired
from _served_report import paired_table, table, variants_table
from _served_run import (
    Services,
    build_engine,
    choices,
    in_process,
    interference,
    profile_per_step,
    served,
    summary,
    verifier_stats,
)
from _served_variants import paired_variants, start_gateway, start_services

T0 = time.time()
TEXT = "The cat sat on the mat. "


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = ap.add_argument
    add("--out", default=str(Path(os.environ.get("OUT", ".")) / "bench_served.json"))
    add("--model"), add("--draft-model")
    add("--ckpt-dir", default=str(Path(tempfile.gettempdir()) / "specserve-bench-pair"))
    add("--tiny", action="store_true", help="a tiny random pair on the CPU (smoke test)")
    add("--device", choices=["cuda", "cpu"], default=None,
        help="where the engines run (default: cuda; cpu with --tiny)")
    add("--contexts", default="1024,32768,131072")
    add("--batch8-contexts", default="1024", help="contexts also run with 8 requests at once")
    add("--interference", default="", help="contexts of a prompt sent while 7 requests of the "
        "shortest --contexts decode (their steps meanwhile, its TTFT)")
    add("--new-tokens", type=int, default=32)
    add("--budget", type=int, default=15)
    add("--variants", default="auto,grpc")
    add("--kv-memory-gb", type=float, default=24.0)
    add("--chunk", type=int, default=8192, help="max-num-batched-tokens (prefill chunk)")
    add("--drafter-pages", type=int, default=16384)
    add("--mps", action="store_true", help="run everything under a CUDA MPS daemon")
    add("--paired", type=int, default=0, metavar="N", help="also N rounds of each batch-1 "
        "case in process and served, interleaved (the steady-step ratio without drift)")
    add("--paired-variants", type=int, default=0, metavar="N", help="also N rounds of every "
        "case through the first and the last --variants' services, interleaved")
    add("--apart", action="store_true", help="start the services only once the in-process "
        "engine is done and freed (one engine's memory at a time: two 8B engines at 128k do "
        "not fit an 80-GB GPU); not with --paired")
    args = ap.parse_args(argv)
    if args.apart and args.paired:
        ap.error("--apart keeps one engine at a time; --paired needs both at once")
    variants = args.variants.split(",")
    if args.paired_variants and (len(variants) < 2 or variants[0] == variants[-1]):
        ap.error(f"--paired-variants needs two different --variants, got {args.variants!r}")
    return args


def start_mps(tmp: Path) -> dict:
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp / "mps-pipe"),
           "CUDA_MPS_LOG_DIRECTORY": str(tmp / "mps-log")}
    for d in env.values():
        Path(d).mkdir(parents=True, exist_ok=True)
    os.environ.update(env)  # this process (the in-process engine) is an MPS client too
    subprocess.run(["nvidia-cuda-mps-control", "-d"], check=True, env={**os.environ})
    return env


def stop_mps() -> None:
    """Ask the daemon to quit once its clients are gone (this process is one: no waiting)."""
    proc = subprocess.Popen(["nvidia-cuda-mps-control"], stdin=subprocess.PIPE,
                            env={**os.environ})
    proc.stdin.write(b"quit\n")
    proc.stdin.close()


def workload(args, target: str) -> list[tuple[str, int, list[list[int]], int]]:
    """(case, context, prompts, how many of the last prompts are sent late) of each case."""
    from specserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(target)
    base = tok.encode(TEXT * 64)
    cases = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        cases.append((_k(ctx), ctx, 1))
    for ctx in (int(c) for c in args.batch8_contexts.split(",") if c):
        cases.append((_k(ctx), ctx, 8))

    def prompt(i: int, ctx: int) -> list[int]:  # request i starts i tokens into the text
        return shifted_prompt(base, i, ctx)

    out = [(f"{label} x{batch}", ctx, [prompt(i, ctx) for i in range(batch)], 0)
           for label, ctx, batch in cases]
    short = min(int(c) for c in args.contexts.split(","))
    for ctx in (int(c) for c in args.interference.split(",") if c):
        out.append((f"{_k(ctx)} into 7x{_k(short)}", ctx,
                    [prompt(i, short) for i in range(7)] + [prompt(7, ctx)], 1))
    return out


def shifted_prompt(base: list[int], i: int, ctx: int) -> list[int]:
    """`ctx` tokens of `base` repeated, request i starting i tokens into it."""
    return ((base[i:] + base) * (ctx // len(base) + 2))[:ctx]


def _k(ctx: int) -> str:
    return f"{ctx // 1024}k" if ctx >= 1024 else str(ctx)


def floors(args, ceil: dict, ctx: int, batch: int) -> dict:
    """Prefill FLOPs / matmul rate; a step's bytes (target + drafter weights, KV) / copy BW."""
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    h, layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    q, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    per_layer = h * (q * d * 2 + kv * d * 2) + 3 * h * inter
    weights = layers * per_layer + 2 * cfg["vocab_size"] * h
    draft = 5 * per_layer + len(TAPS_8B) * h * h
    flops = 2 * weights * ctx + 2 * layers * q * d * ctx * ctx  # causal QK + PV
    kv_bytes = 2 * layers * kv * d * 2 * ctx * batch
    return dict(prefill_ms=flops / (ceil["matmul_TFLOPs"] * 1e12) * 1e3,
                step_ms=(2 * (weights + draft) + kv_bytes) / (ceil["copy_GBps"] * 1e9) * 1e3)


def add_row(results: dict, case: str, ctx: int, batch: int, path: str, timings,
            extra: dict | None = None, late: int = 0) -> None:
    s = summary(timings)
    if late:
        s["interference"] = interference(timings, late)
    base = next((r["summary"] for r in results["rows"]
                 if r["case"] == case and r["path"] == "in-process"), s)
    results["rows"].append(dict(
        case=case, ctx=ctx, batch=batch, path=path, summary=s, **(extra or {}),
        floor=floors(results["args_ns"], results["ceilings"], ctx, batch),
        ratio=dict(ttft=s["ttft_ms"] / base["ttft_ms"],
                   steady=s["steady_p50_ms"] / base["steady_p50_ms"],
                   tok_s=s["tok_s"] / base["tok_s"])))


def save(results: dict, out: str) -> None:
    data = {k: v for k, v in results.items() if k != "args_ns"}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(data, indent=1, default=str))


def run(args, results: dict, tmp: Path) -> None:
    """`measure` with services that stop with it, whether it ends, fails or is killed."""
    svc = Services(tmp)
    try:
        measure(args, results, svc)
    finally:
        svc.close()


def measure(args, results: dict, svc: Services) -> None:
    import torch  # after MPS is up: this process is a client too
    from _e2e_common import ceilings

    from services.verifier.server import VerifierConfig

    results["ceilings"] = ceilings(args.device, args.tiny)
    log(f"ceilings {results['ceilings']}")
    variants = args.variants.split(",")
    if not args.apart:  # the services warm up beside the in-process engine
        start_services(args, svc, variants[0])
    vcfg = VerifierConfig(args.model, device=args.device, draft_model=args.draft_model,
                          kv_memory_gb=args.kv_memory_gb, max_num_batched_tokens=args.chunk,
                          default_budget=args.budget, drafter="in-process")
    engine = build_engine(vcfg, args.draft_model, args.drafter_pages, warmup=args.device != "cpu")
    log("in-process engine warm")
    svc.wait()
    cases = workload(args, args.model)
    run_in_process(args, results, engine, cases)  # the services are idle meanwhile
    if args.paired:
        start_gateway(args, svc)
        results["paired"] = paired(engine, svc, cases, args.new_tokens, args.budget,
                                   args.paired, log)
        svc.stop("gateway")
        save(results, args.out)
    del engine
    gc.collect()  # CUDA graphs and pools held in cycles go now, not at some later collection
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        log(f"in-process engine freed: {torch.cuda.memory_allocated() / 2**30:.2f} GiB left")
    for i, variant in enumerate(variants):
        if i or args.apart:
            svc.close()
            start_services(args, svc, variant)
            svc.wait()
            log(f"services up: {variant}")
        run_served(args, results, svc, variant, cases)
    if args.paired_variants:
        results["paired_variants"] = paired_variants(args, svc, variants, cases, log)


def run_in_process(args, results: dict, engine, cases) -> None:
    """Every case through the in-process engine (each case's shapes run once first)."""
    for case, ctx, prompts, late in cases:
        once = in_process(engine, prompts[-1:], 4, args.budget)  # this case's shapes once
        drafter_ms: list[float] = []
        timings = in_process(engine, prompts, args.new_tokens, args.budget, drafter_ms, late)
        add_row(results, case, ctx, len(prompts), "in-process", timings,
                dict(drafter_ms=sorted(drafter_ms)[len(drafter_ms) // 2],
                     shapes_once_ttft_ms=summary(once)["ttft_ms"]), late)
        save(results, args.out)
        log(f"in-process {case}: {results['rows'][-1]['summary']}")


def run_served(args, results: dict, svc: Services, variant: str, cases) -> None:
    """Every case through a gateway started on the running verifier and drafter."""
    start_gateway(args, svc)
    for case, ctx, prompts, late in cases:
        once = served(svc.addr("gateway"), prompts[-1:], 4, args.budget)
        before = verifier_stats(svc.addr("verifier"))
        timings = served(svc.addr("gateway"), prompts, args.new_tokens, args.budget, late)
        stats = verifier_stats(svc.addr("verifier"))
        add_row(results, case, ctx, len(prompts), f"served {variant}", timings,
                dict(verifier=stats, profile_ms=profile_per_step(before, stats),
                     shapes_once_ttft_ms=summary(once)["ttft_ms"], choices=choices(timings)),
                late)
        save(results, args.out)
        row = results["rows"][-1]
        log(f"served {variant} {case}: {row['summary']} {row['profile_ms']}")
        costs = ", ".join(f"{k} {v:.2f}" for k, v in stats["cost_ms"].items())
        for line in row["choices"][:16] + ([f"cost ms: {costs}"] if costs else []):
            log(f"  {line}")  # adaptive's first steps and why; the cost model behind them


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: the services stop too
    tmp = Path(tempfile.mkdtemp(prefix="bench-served-"))
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    if args.tiny:
        args.kv_memory_gb, args.chunk, args.drafter_pages = 0.05, 128, 256
    results = {"meta": dict(argv=sys.argv[1:], mps=args.mps, started=time.ctime()), "rows": [],
               "args_ns": args}
    mps = start_mps(tmp) if args.mps else None
    try:
        if not args.model:
            args.model, args.draft_model = map(str, write_pair(
                Path(args.ckpt_dir + ("-tiny" if args.tiny else "")),
                TINY if args.tiny else BODY_8B, (1, 3) if args.tiny else TAPS_8B,
                device=args.device, log=log))
        run(args, results, tmp)
    finally:
        if mps is not None:
            stop_mps()
        save(results, args.out)
    print(table(results["rows"]))
    if results.get("paired"):
        print("\n" + paired_table(results["paired"]))
    if results.get("paired_variants"):
        print("\n" + variants_table(results["paired_variants"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
