"""`specserve bench NAME`: run one of the benchmark scripts in bench/ with this Python.

The script runs with the checkout's root on PYTHONPATH: some of them build their models with the
test helpers (`tests.helpers`); bench/ itself is on the script's path already (its directory).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.cli import usage

# the flag that lets a GPU benchmark run on the CPU ("": none does)
CPU_FLAG = {"kernel": "--sm120-check", "e2e": "--tiny", "prefill-attention": "", "draft": "--tiny",
            "served": "--tiny"}
BENCHES = {  # name: (script, where it runs)
    "kernel": ("bench_kernel.py", "GPU; --sm120-check on CPU"),  # tree-verify kernel vs floor
    "e2e": ("bench_e2e.py", "GPU; --tiny on CPU"),  # verify, prefill, decode vs floors / peers
    "prefill-attention": ("diag_sdpa.py", "GPU"),  # a prefill chunk: ours vs cuDNN / flash
    "draft": ("diag_draft.py", "GPU; --tiny on CPU"),  # one DFlash draft step
    "served": ("bench_served.py", "GPU; --tiny on CPU"),  # the three services vs in process
    "adaptive": ("bench_adaptive.py", "CPU or GPU"),  # adaptive vs fixed budgets vs chain vs AR
    "services": ("bench_services.py", "CPU"),  # in process vs over gRPC, per step
    "tracing": ("bench_tracing.py", "CPU"),  # tracing overhead
    "correctness": ("correctness_report.py", "CPU"),  # logit error vs transformers
}


def add(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark script (from a source checkout)",
                       formatter_class=usage.HelpFormatter,
                       description="Run one of the benchmarks in bench/ with this Python; "
                                   "arguments after the name go to the script (e.g. --out).")
    p.add_argument("name", choices=sorted(BENCHES), help="which script of bench/: " + "; ".join(
        f"{n} = {s} ({where})" for n, (s, where) in sorted(BENCHES.items())))
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="passed to the script (optional; NAME --help lists them)")
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    script = root / "bench" / BENCHES[args.name][0]
    if not script.exists():
        raise SystemExit(f"specserve bench: {script} not found (benchmarks live in a source "
                         "checkout of specserve)")
    _check_device(args.name, args.args)
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    return subprocess.call([sys.executable, str(script), *args.args],
                           env={**os.environ, "PYTHONPATH": path})


def _check_device(name: str, argv: list[str]) -> None:
    """UsageError for a GPU benchmark asked of a machine without a CUDA device (unless its CPU
    flag or --help is among `argv`)."""
    flag = CPU_FLAG.get(name)
    if flag is None or (flag and flag in argv) or {"-h", "--help"} & set(argv):
        return
    if usage.cuda_devices() == 0:
        on_cpu = f"; on the CPU pass {flag}" if flag else ""
        raise usage.UsageError(f"bench {name} needs a CUDA GPU, and torch sees none here{on_cpu}")
