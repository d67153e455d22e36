"""Print the measured correctness figures behind the CPU acceptance tests (not a speed bench).

    .venv/bin/specserve bench correctness [--json out.json]
    PYTHONPATH=. .venv/bin/python bench/correctness_report.py ...   # the same (tests.helpers)

Max relative logit error vs transformers per tiny test config (two prefill chunks, then decode
steps, on shuffled pages) — the figure tests/unit/test_models.py bounds by 1e-5.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

torch.set_num_threads(1)


def logit_errors() -> dict[str, float]:
    from specserve.attention.base import AttnBatch
    from specserve.kvcache.pool import KVPool, KVShape
    from specserve.models.loader import load_model
    from tests.helpers import CONFIGS, make_checkpoint

    out = {}
    for name in sorted(CONFIGS):
        path, hf = make_checkpoint(Path(tempfile.mkdtemp()), name)
        ours = load_model(path)
        ids = torch.randint(0, hf.config.vocab_size, (1, 75),
                            generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            ref = hf(ids).logits[0]
        c = ours.config
        kv = KVPool(KVShape(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32), 64, 16)
        worst = 0.0
        for s, e in [(0, 40), (40, 61)] + [(i, i + 1) for i in range(61, 75)]:
            batch = AttnBatch.build([e - s], [s], [[5, 2, 9, 0, 7, 1]], list(range(s, e)), 16)
            with torch.no_grad():
                got = ours.logits(ours(ids[0, s:e], batch, kv)[0])
            worst = max(worst, ((got - ref[s:e]).norm() / ref[s:e].norm()).item())
        out[name] = worst
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    report = {"max_rel_logit_error_vs_transformers": logit_errors()}
    for name, err in report["max_rel_logit_error_vs_transformers"].items():
        print(f"{name:24s} max rel logit error {err:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
