"""The optimisation loop shared by the target and the drafter: AdamW, linear warmup then cosine
decay to 10%, gradient clipping at 1.0, and plain progress lines (no tqdm) —
`[target] step 120/600 loss 2.314 (1.9 s/it)` — whose losses are also returned as the log.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch


@dataclass
class TrainLog:
    name: str
    steps: int
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) as printed
    extras: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    seconds: float = 0.0

    def final_loss(self, last: int = 5) -> float:
        """Mean of the last `last` logged losses (the printed values)."""
        tail = [loss for _, loss in self.losses[-last:]]
        return sum(tail) / len(tail) if tail else float("nan")

    def as_dict(self) -> dict:
        return {"steps": self.steps, "seconds": round(self.seconds, 1),
                "final_loss": round(self.final_loss(), 4),
                "losses": [[s, v] for s, v in self.losses],
                "metrics": [[s, m] for s, m in self.extras]}


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Learning rate of 0-based `step`: linear warmup, cosine to 10% of `peak`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(
    name: str,
    params: Iterable[torch.nn.Parameter],
    step_fn: Callable[[int], tuple[torch.Tensor, dict[str, float]]],
    steps: int,
    lr: float,
    log_every: int,
    weight_decay: float = 0.1,
    norm_lr_mult: float = 1.0,
    out=None,
    stop_after: int | None = None,
) -> TrainLog:
    """Run `steps` optimizer steps; `step_fn(step)` returns (loss to minimise, extra metrics).

    Matrices get AdamW with `weight_decay`; vectors (the RMSNorm gains, q/k norms included) no
    decay and `norm_lr_mult` × the learning rate: under q/k RMSNorm an attention logit is bounded
    by the product of the two gains, so sharp heads (a previous-token head, an induction head)
    only appear once the gains have grown — at the matrices' rate that takes most of a short run.
    `stop_after` ends the run after that many steps, on the full run's schedule (a check that a
    run reproduces another's first logged losses).
    """
    out = out or sys.stdout
    params = [p for p in params if p.requires_grad]
    opt = _optimizer(params, lr, weight_decay, norm_lr_mult)
    warmup = max(1, round(0.04 * steps))
    log = TrainLog(name, steps)
    t_start = t_mark = time.perf_counter()
    mark_step = 0
    for step in range(steps if stop_after is None else min(steps, stop_after)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup) * group["mult"]
        loss, extra = step_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        done = step + 1
        if done == 1 or done % log_every == 0 or done == steps:
            now = time.perf_counter()
            _record(log, done, loss, extra, (now - t_mark) / max(1, done - mark_step), out)
            t_mark, mark_step = now, done
    log.seconds = time.perf_counter() - t_start
    return log


def _optimizer(params: list[torch.nn.Parameter], lr: float, weight_decay: float,
               norm_lr_mult: float) -> torch.optim.AdamW:
    """AdamW: matrices with `weight_decay`, vectors none at `norm_lr_mult` × the rate."""
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay,
               "mult": 1.0},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0,
               "mult": norm_lr_mult}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def _record(log: TrainLog, done: int, loss: torch.Tensor, extra: dict[str, float],
            per_it: float, out) -> None:
    """One logged step: into `log`, and a progress line to `out`."""
    value = round(float(loss.detach()), 4)
    log.losses.append((done, value))
    log.extras.append((done, {k: round(float(v), 4) for k, v in extra.items()}))
    shown = "".join(f" {k} {float(v):.3f}" for k, v in extra.items())
    print(f"[{log.name}] step {done}/{log.steps} loss {value:.3f}{shown} ({per_it:.2f} s/it)",
          file=out, flush=True)
