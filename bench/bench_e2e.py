"""End-to-end benchmark of issue 9 on random weights of the Qwen3-8B shape (first version: eager,
no CUDA graphs yet).

Target: 36 layers, hidden 4096, 32/8 heads, head_dim 128, intermediate 12288, vocab 151936, bf16,
N(0, 0.02) weights built directly on the GPU (no checkpoint); a 5-layer DFlash drafter of the same
width (block 16) sharing the target's embedding / LM head. The same run measures its ceilings:
copy bandwidth (1 GiB D2D copy, bytes read + written) and bf16 matmul rate (8192³).

Sections (each optional via --sections; an error in one — a CUDA OOM — is recorded in the JSON
and the others still run; the JSON is rewritten after every row; a watchdog writes it and exits
at --hard-s even if something hangs):
  verify   target forward over a tree of B + 1 rows (ancestor mask, Triton kernel) + logits, at
           contexts 1k/32k/128k × budgets 16/64/256 × batch 1/8 (a point whose KV does not fit the
           memory budget is skipped), vs max(bytes / copy BW, FLOPs / matmul rate) with bytes =
           all weights (embedding included, as issue 9's 3.9 / 5.0 / 8.5 ms floors count them) +
           KV of the prefix and tree; growth × from 1k to 128k. (bench/_e2e_verify.py)
  prefill  our chunked prefill (engine, chunks of 8192) of 32k and 128k tokens vs the FLOP floor
           (bench/_e2e_engine.py), and HF transformers SDPA at 32k (bench/_e2e_peers.py).
  decode   tokens/s at 1k and 32k: our AR; our speculation with the BENCHMARK-ONLY replay drafter
           (bench/replay_drafter.py) at mean commit length 8; our DFlash drafter's per-step cost;
           `dflash.model.dflash_generate` (if PyPI dflash is installed) and HF `generate` (1k).
Estimated H200 time (no run of this script yet; from the kernel runs and issue 9's peer figures):
start-up + weight init (8.2 B params, N(0, 0.02) in place on the GPU) + ceilings ~15-25 s;
verify ~40-90 s (15 points x 13 timed forwards, Triton compiles); prefill ~30-90 s (warm-up 16k,
32k twice, 128k once; 128k skipped if 32k took > 60 s or would not fit the section's time);
decode ~30-60 s (each 32k run re-prefills its prompt: AR, replay pass(es), DFlash); peers
~30-45 s (HF SDPA prefill 32k, HF generate 24 tokens at 1k, dflash_generate 24 tokens at 1k and
32k). Total ~3-5 min. Caps: per section --verify-s/--prefill-s/--decode-s/--peers-s
(150/150/120/90 s), no new work after --budget-s (420 s), a running generation is aborted
--overrun-s (40 s) past its cap, and the watchdog writes the JSON and exits (code 3) at --hard-s
(500 s) counted from interpreter start.

    python3 bench/bench_e2e.py --out $OUT/bench_e2e.json            # H200, everything
    python3 bench/bench_e2e.py --tiny --sections verify,decode --out /tmp/e2e.json   # CPU smoke
"""

from __future__ import annotations

import time

T_START = time.time()  # before the heavy imports: the time limits count from here

import argparse  # noqa: E402
import datetime  # noqa: E402
import faulthandler  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _e2e_common import QWEN3_8B, TINY, Bench, build_models, ceilings, param_counts  # noqa: E402
from _e2e_report import acceptance, report  # noqa: E402

SECTION_CAPS = dict(verify=150.0, prefill=150.0, decode=120.0, peers=90.0)  # seconds
FULL = dict(ctxs="1024,32768,131072", prefill_lens="32768,131072", chunk=8192,
            decode_ctxs="1024,32768", new_tokens=128, peer_new=24, hf_prefill_lens="32768",
            reps=10, warmup=3)
SMALL = dict(ctxs="64,256", prefill_lens="256,1024", chunk=128, decode_ctxs="64,256",
             new_tokens=64, peer_new=8, hf_prefill_lens="256", reps=3, warmup=1)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = ap.add_argument
    add("--out", default=str(Path(os.environ.get("OUT", ".")) / "bench_e2e.json"))
    add("--tiny", action="store_true", help="tiny model (2 layers, hidden 128, vocab 512)")
    add("--device", default=None, help="default: cuda if available (cpu with --tiny)")
    add("--dtype", default=None, choices=("bfloat16", "float16", "float32"))
    add("--sections", default="verify,prefill,decode")
    add("--no-peers", action="store_true", help="skip HF and dflash_generate")
    add("--no-hf", action="store_true")
    add("--no-dflash-ref", action="store_true")
    for name in ("ctxs", "prefill_lens", "decode_ctxs", "hf_prefill_lens"):
        add("--" + name.replace("_", "-"), default=None, help="comma-separated token counts")
    add("--budgets", default="16,64,256")
    add("--batches", default="1,8")
    add("--page-size", type=int, default=16)
    add("--no-graphs", dest="graphs", action="store_false",
        help="verify: skip the CUDA-graph step (engine/graphs.py) next to the eager one")
    for name in ("chunk", "new_tokens", "peer_new", "reps", "warmup"):
        add("--" + name.replace("_", "-"), type=int, default=None)
    add("--kv-gb", type=float, default=0.0, help="verify KV budget (0: free memory - reserve)")
    add("--reserve-gb", type=float, default=12.0)
    add("--prefill-skip-s", type=float, default=60.0, help="skip longer prefills past this")
    add("--prefill-rep-s", type=float, default=30.0, help="repeat a prefill if it took less")
    add("--prefill-reps", type=int, default=2, help="runs per prefill length (the best counts)")
    add("--eager-drafter", dest="draft_graphs", action="store_false",
        help="decode: the DFlash drafter's block forward eagerly, not from its CUDA graphs "
             "(dflash_graphs.py, the default on CUDA)")
    add("--unfused-drafter", action="store_true",
        help="decode: also run the DFlash drafter with its block forward through its modules "
             "(DFlashDrafter fused_layers=False; default: the fused layers), a row beside")
    add("--replay-budget", type=int, default=15,
        help="the replay chain's length: 15 + root = 16 nodes = 64 packed rows, one full row "
             "block (H200, 32k: 1.08-1.11 × the bar vs 1.04-1.06 at 16; BENCHMARKS runs 23-27)")
    add("--commit-len", type=float, default=8.0)
    add("--replay-mode", default="geometric", choices=("geometric", "fixed"))
    add("--max-passes", type=int, default=32)
    add("--warm-steps", type=int, default=2)
    add("--std", type=float, default=0.02)
    add("--seed", type=int, default=0)
    add("--budget-s", type=float, default=420.0, help="no new work after this many seconds")
    add("--overrun-s", type=float, default=40.0, help="abort a generation this far past budget")
    add("--hard-s", type=float, default=500.0, help="watchdog: write JSON and exit")
    for name, cap in SECTION_CAPS.items():
        add(f"--{name}-s", type=float, default=cap, help=f"time cap of section {name}")
    a = ap.parse_args(argv)
    for k, v in (SMALL if a.tiny else FULL).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    for k in ("ctxs", "prefill_lens", "decode_ctxs", "hf_prefill_lens", "budgets", "batches"):
        setattr(a, k, [int(x) for x in str(getattr(a, k)).split(",") if x])
    a.sections = [s for s in a.sections.split(",") if s]
    bad = set(a.sections) - {"verify", "prefill", "decode"}
    if bad:
        ap.error(f"unknown sections {sorted(bad)}")
    if a.prefill_reps < 1:
        ap.error("--prefill-reps must be >= 1")
    a.device = a.device or ("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    a.dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    if a.tiny and a.device == "cpu":
        torch.set_num_threads(1)  # tiny ops: extra threads only add hand-off latency
    return a


def _versions() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("triton", "transformers", "dflash"):
        try:
            out[mod] = getattr(__import__(mod), "__version__", "installed")
        except Exception:  # noqa: BLE001
            out[mod] = None
    return out


def start_watchdog(b: Bench) -> None:
    def fire() -> None:
        time.sleep(max(0.0, b.args.hard_s - b.elapsed()))
        print(f"\n!! watchdog at {b.elapsed():.0f} s: writing what we have and exiting", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        b.results["status"] = f"watchdog at {b.elapsed():.0f} s"
        try:
            b.save()
            print(report(b), flush=True)
        finally:
            os._exit(3)

    threading.Thread(target=fire, daemon=True, name="watchdog").start()


def setup(b: Bench) -> None:
    a, dev = b.args, b.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    shape = TINY if a.tiny else QWEN3_8B
    now = datetime.datetime.now(datetime.timezone.utc)  # noqa: UP017 (runs on 3.10 too)
    b.results["meta"] = dict(
        date=now.isoformat(timespec="seconds"), device=name,
        command="python3 " + " ".join(sys.argv), args=vars(a), versions=_versions(),
        model=dict(shape, dtype=a.dtype, init_std=a.std, draft_layers=1 if a.tiny else 5,
                   block_size=16))
    b.log(f"{name}; torch {torch.__version__}; {b.results['meta']['versions']}")
    b.ceil = b.results["ceilings"] = ceilings(dev, a.tiny)
    b.log(f"ceilings: copy {b.ceil['copy_GBps']:.0f} GB/s, matmul "
          f"{b.ceil['matmul_TFLOPs']:.1f} TFLOP/s")
    t0 = time.time()
    b.target, b.drafter = build_models(shape, 1 if a.tiny else 5, dev, b.dtype, a.std, a.seed)
    from specserve.attention import backend_for

    b.target.attn_backend = backend_for(dev)
    b.counts = param_counts(b.target)
    own = sum(p.numel() for n, p in b.drafter.named_parameters()
              if n not in ("embed.weight", "lm_head.weight"))
    b.results["meta"].update(init_s=time.time() - t0, params=b.counts, drafter_own_params=own,
                             weight_GB=b.weight_bytes() / 1e9,
                             kv_bytes_per_token=b.bytes_per_token(),
                             attention=getattr(b.target.attn_backend, "__name__", "?"))
    b.log(f"models: target {b.counts['total'] / 1e9:.3f} B params ({b.weight_bytes() / 1e9:.2f} "
          f"GB), drafter {own / 1e9:.3f} B own, init {time.time() - t0:.1f} s; {b.mem_note()}")
    b.save()


def run_section(b: Bench, name: str, fn) -> None:
    sec = b.results.setdefault(name, {"rows": []})
    t0 = time.time()
    b.section_end = b.elapsed() + getattr(b.args, f"{name}_s")
    b.log(f"=== {name}")
    try:
        with torch.inference_mode():
            fn(b)
        sec.setdefault("status", "ok")
    except Exception as e:  # noqa: BLE001 — one section's failure must not lose the others
        sec["status"] = "error"
        sec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        traceback.print_exc()
    finally:
        sec["seconds"] = time.time() - t0
        b.section_end = float("inf")
        b.free()
        b.log(f"=== {name} done in {sec['seconds']:.1f} s ({sec['status']}) {b.mem_note()}")
        b.save()


def main(argv=None) -> int:
    args = parse_args(argv)
    b = Bench(args, T_START)
    b.results["status"] = "running"
    start_watchdog(b)
    try:
        setup(b)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        b.results["status"] = f"setup failed: {type(e).__name__}: {e}"
        b.save()
        return 2
    from _e2e_engine import run_decode, run_prefill
    from _e2e_peers import run_peers
    from _e2e_verify import run_verify

    for name, fn in (("verify", run_verify), ("prefill", run_prefill), ("decode", run_decode)):
        if name in args.sections:
            run_section(b, name, fn)
    if {"prefill", "decode"} & set(args.sections) and not args.no_peers:
        run_section(b, "peers", run_peers)
    b.results["acceptance"] = acceptance(b)
    b.results["status"] = "complete"
    b.results["elapsed_s"] = b.elapsed()
    b.save()
    print("\n" + report(b), flush=True)
    print(f"\nwrote {args.out} ({b.elapsed():.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
