"""`specserve bench NAME`: run one of the benchmark scripts in bench/ with this Python.

The script runs with the checkout's root on PYTHONPATH: some of them build their models with the
test helpers (`tests.helpers`); bench/ itself is on the script's path already (its directory).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.cli import usage

BENCHES = {
    "kernel": "bench_kernel.py",  # tree-verify kernel vs baselines and the floor (GPU)
    "e2e": "bench_e2e.py",  # issue-9 end-to-end: verify, prefill, decode vs floors/peers (GPU)
    "prefill-attention": "diag_sdpa.py",  # a prefill chunk: tree kernel vs cuDNN/flash (GPU)
    "draft": "diag_draft.py",  # one DFlash draft step: host vs GPU, eager vs graphs (GPU)
    "services": "bench_services.py",  # in process vs over gRPC, per step (CPU)
    "tracing": "bench_tracing.py",  # tracing overhead (CPU)
    "correctness": "correctness_report.py",  # logit error vs transformers (CPU)
}


def add(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark script (from a source checkout)",
                       formatter_class=usage.HelpFormatter,
                       description="Run one of the benchmarks in bench/ with this Python; "
                                   "arguments after the name go to the script (e.g. --out).")
    p.add_argument("name", choices=sorted(BENCHES), help="which script of bench/: " + ", ".join(
        f"{n} = {BENCHES[n]}" for n in sorted(BENCHES)))
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the script")
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    script = root / "bench" / BENCHES[args.name]
    if not script.exists():
        raise SystemExit(f"specserve bench: {script} not found (benchmarks live in a source "
                         "checkout of specserve)")
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    return subprocess.call([sys.executable, str(script), *args.args],
                           env={**os.environ, "PYTHONPATH": path})
