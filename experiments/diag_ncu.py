"""Runs the tree kernel at one shape and one variant a few times, eagerly, for Nsight Compute
(H200 diagnostic, issue 5): the per-kernel counters (DRAM throughput, stall reasons, occupancy)
that graph timings cannot show.

    PYTHONPATH=.:bench ncu --clock-control none --kernel-name regex:_tree_attn --launch-skip 3 \\
        --launch-count 1 --section SpeedOfLight --section WarpStateStats \\
        python experiments/diag_ncu.py \\
        --ctx 32768 --n 16 --variant "({}, 16)"
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--variant", default="({}, None)",
                    help="(launcher options, num_splits or None[, (block_m, block_n, num_warps, "
                         "num_stages)])")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    import numpy as np
    import torch
    from bench_kernel import _point

    from specserve.kernels.tree_attention.configs import Config
    from specserve.kernels.tree_attention.kernel import tree_attention_triton

    opts, splits, *cfg = eval(args.variant)  # noqa: S307 — our own CLI
    k, v, batch = _point(args.ctx, args.n, 32, 8, 16, True, 7, torch, np)[0]
    q = torch.randn(args.n, 32, 128, device="cuda", dtype=torch.bfloat16)
    for _ in range(args.reps):
        tree_attention_triton(q, k, v, batch, 128**-0.5, num_splits=splits,
                              config=Config(*cfg[0]) if cfg else None, options=opts)
    torch.cuda.synchronize()
    print("ran", args)


if __name__ == "__main__":
    main()
