"""Plot one bench_e2e.py result (issue 9): verify steps vs their floors, prefill vs the FLOP floor
and HF, decode tokens/s of ours vs the peers — one PNG, three panels, every number from the JSON.

    python3 experiments/plot_e2e.py experiments/results/e2e_h200_run9_final.json [--out PATH.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _verify(ax, rows) -> None:
    """Graph-replayed verify step (batch 1) and its floor per budget, over the contexts."""
    for budget, color in ((16, "tab:blue"), (64, "tab:orange"), (256, "tab:green")):
        pts = sorted((r["ctx"], r["step_ms"], r["floor_ms"]) for r in rows
                     if r.get("batch") == 1 and r.get("budget") == budget and "step_ms" in r)
        if not pts:
            continue
        ctx, ms, floor = zip(*pts, strict=True)
        ax.plot(ctx, ms, "o-", color=color, label=f"budget {budget}")
        ax.plot(ctx, floor, "--", color=color, alpha=0.6, label=f"floor {budget}")
    ax.set_xscale("log", base=2)
    ctxs = sorted({r["ctx"] for r in rows})
    ax.set_xticks(ctxs, [f"{c // 1024}k" for c in ctxs])
    ax.set_xlabel("context tokens")
    ax.set_ylabel("verify step ms (batch 1)")
    ax.set_title("verify step vs floor")
    ax.legend(fontsize=7)


def _prefill(ax, rows) -> None:
    """Our prefill, its FLOP floor, 1.3 × floor and HF SDPA, per prompt length."""
    ours = {r["tokens"]: r for r in rows if r.get("impl") == "ours" and "s" in r}
    hf = {r["tokens"]: r["s"] for r in rows if r.get("impl") == "hf_sdpa" and "s" in r}
    lens = sorted(ours)
    xs = range(len(lens))
    w = 0.27
    ax.bar([x - w for x in xs], [ours[t]["s"] for t in lens], w, label="ours")
    ax.bar(list(xs), [ours[t]["floor_s"] for t in lens], w, label="FLOP floor")
    ax.bar([x + w for x in xs], [hf.get(t, 0) for t in lens], w, label="HF SDPA")
    for x, t in zip(xs, lens, strict=True):
        ax.hlines(1.3 * ours[t]["floor_s"], x - 1.5 * w, x + 1.5 * w, colors="k",
                  linestyles=":", label="1.3 × floor" if x == 0 else None)
    ax.set_xticks(list(xs), [f"{t // 1024}k" for t in lens])
    ax.set_yscale("log")
    ax.set_ylim(top=max(r["s"] for r in ours.values()) * 6)
    ax.set_ylabel("prefill s")
    ax.set_title("prefill")
    ax.legend(fontsize=7)


def _decode(ax, rows) -> None:
    """Tokens/s per implementation at each decode context (log scale)."""
    impls = ["ours_ar", "ours_spec_replay", "ours_dflash", "hf_generate", "dflash_generate"]
    ctxs = sorted({r["ctx"] for r in rows})
    w, top = 0.8 / len(impls), 1.0
    for i, impl in enumerate(impls):
        got = {r["ctx"]: r["tok_per_s"] for r in rows if r["impl"] == impl and "tok_per_s" in r}
        top = max([top, *got.values()])
        ax.bar([c + (i - len(impls) / 2 + 0.5) * w for c in range(len(ctxs))],
               [got.get(c, 0) for c in ctxs], w,
               label=impl.replace("ours_spec_replay", "ours_spec (replay, bench only)"))
    ax.set_xticks(range(len(ctxs)), [f"{c // 1024}k" for c in ctxs])
    ax.set_yscale("log")
    ax.set_ylim(top=top * 30)  # room for the legend above the bars
    ax.set_ylabel("tokens/s")
    ax.set_title("decode (random weights)")
    ax.legend(fontsize=7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="a bench_e2e.py result")
    ap.add_argument("--out", default=None, help="PNG path (default: the JSON's, .png)")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(args.json).read_text())
    meta = data.get("meta", {})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    _verify(axes[0], data.get("verify", {}).get("rows", []))
    _prefill(axes[1], data.get("prefill", {}).get("rows", []))
    _decode(axes[2], data.get("decode", {}).get("rows", []) + data.get("peers", {}).get("rows",
                                                                                         []))
    fig.suptitle(f"bench_e2e — {meta.get('device', '?')} — {meta.get('date', '?')[:10]} — "
                 f"Qwen3-8B shape, bf16", fontsize=10)
    fig.tight_layout()
    out = Path(args.out or Path(args.json).with_suffix(".png"))
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
