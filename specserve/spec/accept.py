"""The acceptance walk: which draft tokens the target itself would have produced.

Lossless by construction (no draft probabilities): at each node on the walk the target's own
rule picks the next token — argmax when greedy, one sample from the request's distribution when
sampling — and the walk goes down while that token is a child. The token picked at the last
accepted node is the bonus. Every committed token is the target's choice given its true prefix,
and a sampling request consumes exactly one draw per committed token, the same as plain
autoregressive sampling with the same generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.sampling import sample_rows
from specserve.spec.tree import DraftTree, child_rows
from specserve.types import SamplingParams


@dataclass(frozen=True, slots=True)
class Acceptance:
    rows: list[int]  # verify rows of the accepted nodes, root excluded, by depth
    token_ids: list[int]  # accepted draft tokens then the bonus: len(rows) + 1 tokens

    @property
    def accepted_depth(self) -> int:
        return len(self.rows)


def accept(
    logits: torch.Tensor,  # [n+1, V] target logits at the verify rows (row 0 = root)
    tree: DraftTree,
    params: SamplingParams,
    generator: torch.Generator | None,
    argmax: list[int] | None = None,  # [n+1] the rows' argmax, when the caller has it
) -> Acceptance:
    children = child_rows(tree)
    if params.greedy:  # one argmax for all rows (the step's, or here), then a host walk
        pick = (logits.argmax(dim=-1).tolist() if argmax is None else argmax).__getitem__
    else:  # sample lazily along the walk: one draw per committed token
        def pick(row: int) -> int:
            return sample_rows(logits[row : row + 1], params, generator)[0]
    rows, tokens, row = [], [], 0
    token = pick(row)
    while token in children[row]:
        row = children[row][token]
        rows.append(row)
        tokens.append(token)
        token = pick(row)
    tokens.append(token)
    return Acceptance(rows, tokens)
