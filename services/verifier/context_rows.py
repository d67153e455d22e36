"""What the verifier keeps of each request's context rows, and the fc projection of new ones.

Owns `RequestRows` (one request as the verifier knows it: rows seen, kept host copies for a
resend, what the drafter holds, on which connection), `New` (a call's new rows: raw, projected,
kept) and the projection over all requests' rows at once (the drafter's own grouping).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# kept chunks per request before the newer half is merged into one tensor (merging them all
# would copy a long prompt's rows every MAX_CHUNKS decode steps)
MAX_CHUNKS = 64
@dataclass(eq=False)
class RequestRows:
    """One request as the verifier knows it (engine thread only)."""

    kind: str | None  # "dflash" | "ngram" | None (the drafter's default)
    chunks: list[torch.Tensor] = field(default_factory=list)  # kept host rows [0, num_rows)
    num_rows: int = 0  # context rows seen: positions [0, num_rows)
    rows_sent: int = 0  # context rows the drafter holds
    history_sent: int = 0  # history tokens the drafter holds
    epoch: int | None = None  # the connection the drafter's copy was built on (None: none yet)
    resend: bool = False  # the drafter's copy is unknown: release it, send everything
    sent_once: bool = False
    lost: bool = False  # its rows are gone on both sides: no more DFlash drafts
    keep: bool | None = None  # whether its rows are kept here (decided at its first rows)

    def rows_since(self, start: int) -> torch.Tensor | None:
        out, pos = [], 0
        for chunk in self.chunks:
            if pos + chunk.shape[0] > start:
                out.append(chunk[max(0, start - pos):])
            pos += chunk.shape[0]
        if not out:
            return None
        return out[0] if len(out) == 1 else torch.cat(out)  # one chunk (a feed): no copy

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.chunks.append(rows)
        if len(self.chunks) > MAX_CHUNKS:  # merge the newer half: the prompt's big chunks stay
            half = len(self.chunks) // 2
            self.chunks = self.chunks[:half] + [torch.cat(self.chunks[half:])]


@dataclass(frozen=True, eq=False)
class New:
    """A request's context rows new in this call: raw taps (device) and, when computed, their
    fc projection."""

    raw: torch.Tensor  # [n, taps · hidden]
    fused: torch.Tensor | None  # [n, hidden]
    host: torch.Tensor | None = None  # the kept host copy (fused if there is a projection)


def project(projection, rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """`projection` over all requests' rows at once, split back per request."""
    weight = projection.fc.weight
    with torch.inference_mode():
        fused = projection(torch.cat(rows).to(device=weight.device, dtype=weight.dtype))
    return list(fused.split([r.shape[0] for r in rows]))
