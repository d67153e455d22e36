"""Drafters by name: the names requests, flags and the wire use, and how each is built.

Adding a drafter is one module with a `Drafter` subclass (drafters/base.py) and one line in
`BUILDERS`. "none" is no drafter at all (plain decoding), never built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specserve.drafters.base import Drafter

DFLASH, NGRAM, NONE = "dflash", "ngram", "none"
CONTEXT_PAGES = 16384  # DFlash context-cache pages per layer group by default (× 16 = 256k tokens)


@dataclass(frozen=True)
class DrafterSpec:
    """What building a drafter may need (each builder reads its part)."""

    draft_model: str | Path | None = None  # the drafter's checkpoint directory
    target_model: str | Path | None = None  # the target's (DFlash shares its embedding, head)
    dtype: str = "float32"
    device: str = "cpu"
    num_pages: int = CONTEXT_PAGES  # context-cache pages (DFlash)
    page_size: int = 16
    graphs: bool | None = None  # block forwards from CUDA graphs; None = on for CUDA

    def __post_init__(self) -> None:
        if self.num_pages <= 0 or self.page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got "
                             f"{self.num_pages}, {self.page_size}")


def _dflash(spec: DrafterSpec) -> Drafter:
    from specserve.drafters.dflash import DFlashDrafter
    from specserve.models.dflash import load_dflash

    if spec.draft_model is None or spec.target_model is None:
        raise ValueError("the dflash drafter needs its checkpoint and the target's "
                         "(embedding, LM head)")
    model = load_dflash(spec.draft_model, spec.target_model, spec.dtype, spec.device)
    return DFlashDrafter(model, num_pages=spec.num_pages, page_size=spec.page_size,
                         graphs=spec.graphs)


def _ngram(spec: DrafterSpec) -> Drafter:
    from specserve.drafters.ngram import NgramDrafter

    return NgramDrafter()


BUILDERS: dict[str, Callable[[DrafterSpec], Drafter]] = {DFLASH: _dflash, NGRAM: _ngram}
CHOICES = (*BUILDERS, NONE)  # what a request or a flag may name


def build(name: str, spec: DrafterSpec) -> Drafter:
    """The drafter called `name`. Raises ValueError for an unknown name (or "none")."""
    if name not in BUILDERS:
        raise ValueError(f"unknown drafter {name!r}; known: {', '.join(BUILDERS)}")
    return BUILDERS[name](spec)
