"""The commit probe's PNG: mean commit_len and the steady decode step by context, per text.

x ticks read 1k, 2k, …; the step axis starts at 0; the commit plot carries the tree's ceiling
(budget + 1 tokens a step); the title names the model, the budget and the verifier's device.
"""

from __future__ import annotations

from specserve.probe import ProbeRow


def _tick(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


def plot(rows: list[ProbeRow], path: str, budget: int | None = None, model: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    contexts = sorted({r.context for r in rows})
    for text in sorted({r.text for r in rows}):
        mine = sorted((r for r in rows if r.text == text), key=lambda r: r.context)
        xs = [r.context for r in mine]
        a.plot(xs, [r.commit_len for r in mine], marker="o", label=text)
        b.plot(xs, [r.steady_step_ms for r in mine], marker="o", label=text)
    if budget:
        a.axhline(budget + 1, color="grey", linestyle="--", label=f"ceiling (budget {budget} + 1)")
    for ax, label in ((a, "mean commit_len"), (b, "steady decode step (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [_tick(c) for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    devices = ", ".join(sorted({r.device for r in rows if r.device}))
    parts = [p for p in (model, f"budget {budget}" if budget else "", devices) if p]
    fig.suptitle("specserve commit probe" + (f" — {', '.join(parts)}" if parts else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
