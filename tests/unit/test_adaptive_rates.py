"""The drafter's tree stage priced by the size asked, and chains drafted alone as candidates:
the cost model's stage table, and the decisions it moves (engine/cost.py, adaptive_rates.py)."""

from __future__ import annotations

import pytest

from specserve.engine.adaptive import Adaptive
from specserve.engine.adaptive_rates import choose
from specserve.engine.cost import STAGE_FIXED, CostModel, StepPrices, size_class
from specserve.engine.speculative import Ask
from specserve.spec.metrics import reason_kind
from tests.unit.test_adaptive import _cost, _plan, _seq


def test_the_tree_stage_is_priced_by_the_size_asked():
    """A call's tree stage is booked under the size class asked (chains: 0) and the rest of the
    call as the drafting; a size never measured is scaled from the nearest measured one by
    (STAGE_FIXED + size) / (STAGE_FIXED + measured); nothing measured prices no stage."""
    cost = CostModel()
    assert cost.stage_s(1, 63) == 0.0 and [size_class(k) for k in (0, 1, 2, 9, 50)] == \
        [0, 1, 3, 15, 63]
    cost.observe_draft(1, 900, 1.3e-3, stage=0.6e-3, ask=50)  # budget 50: the 63 class
    assert cost.draft_s(1, 900) == pytest.approx(0.7e-3) and cost.stage_s(1, 63) == 0.6e-3
    assert cost.stage_s(1, 15) == pytest.approx(0.6e-3 * (STAGE_FIXED + 15) / (STAGE_FIXED + 63))
    assert cost.stage_s(3, 0) == pytest.approx(0.6e-3 * STAGE_FIXED / (STAGE_FIXED + 63))
    epoch = cost.epoch
    cost.observe_draft(1, 900, 0.8e-3, stage=0.05e-3, ask=0)  # chains asked alone
    assert cost.epoch > epoch and cost.stage_s(1, 0) == 0.05e-3
    assert cost.stage_s(1, 7) == pytest.approx(0.6e-3 * (STAGE_FIXED + 7) / (STAGE_FIXED + 63))
    cost.observe_draft(1, 900, 1.1e-3)  # a drafter that does not tell: the whole call
    assert "stage n=1 nodes<=63" in cost.table() and "stage n=1 nodes<=0" in cost.table()
    for rows in (1, 16, 64):
        cost.observe_verify(1, rows, 900, 1e-3 + rows * 1e-6)
    prices = StepPrices(cost, lambda rows: rows)(1, 900, (1, 16, 64))
    base = cost.draft_s(1, 900)
    assert prices[0][2:] == (0.0, 0.0)  # plain decoding drafts nothing
    assert prices[2][2:] == (base + 0.6e-3, base + 0.05e-3)  # trees of 63, chains
    assert prices[1][2] == pytest.approx(base + cost.stage_s(1, 15))


def _staged(tree_stage_ms: float, chain_stage_ms: float) -> CostModel:
    cost = _cost(draft_ms=0.3, verify_ms=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3))  # rows: cheap
    cost.observe_draft(1, 40, (0.3 + tree_stage_ms) / 1e3, stage=tree_stage_ms / 1e3, ask=63)
    cost.observe_draft(1, 40, (0.3 + chain_stage_ms) / 1e3, stage=chain_stage_ms / 1e3, ask=0)
    return cost


def test_a_costly_tree_stage_moves_the_decision_to_smaller_trees_or_chains():
    """Verify rows nearly free: with no stage the biggest tree wins; a stage that grows with
    the size asked takes a smaller tree; with chains sure and their stage cheap, chains
    drafted alone win, and the hold asks the drafter for chains."""
    seq = _seq("a", budget=63)
    free = Adaptive(_staged(0.0, 0.0), lambda rows: rows)
    plan = _plan(seq, 1, confident=True)
    free.shape([plan])
    assert plan.choice.nodes == 63 and "chains" not in plan.choice.why
    dear = Adaptive(_staged(3.0, 3.0), lambda rows: rows)
    plan = _plan(seq, 1, confident=True)
    dear.shape([plan])
    assert plan.choice.shape == "tree" and plan.choice.nodes < 63
    chains = Adaptive(_staged(3.0, 0.01), lambda rows: rows, redecide=4)
    for k in (1, 3, 7, 15, 31, 63):  # chains have accepted 6 × what they were expected to
        chains.shared.book(("chain", k), 3.0, 0.5)
    plan = _plan(seq, 1, confident=True)
    chains.shape([plan])
    assert plan.choice.shape == "chain" and " chains: " in plan.choice.why
    assert reason_kind(plan.choice.why) == "decided"
    assert chains.to_draft([seq]) == ([seq], [])
    assert chains.draft_budgets([seq]) == {"a": Ask(chains.state["a"].nodes, chain=True)}


def test_ties_go_to_more_rows_then_to_trees():
    rated = ([(1, "off", 1.0, 1e-3, 0.0), (16, "tree", 4.0, 1e-3, 1e-3),
              (16, "chain", 4.0, 1e-3, 1e-3), (8, "chain", 2.0, 0.5e-3, 0.5e-3)], 1e-3)
    assert choose(rated, 1, False, 1.0, 15)[:2] == (16, "tree")
    rows, kind, why = choose(rated, 1, True, 1.0, 15)
    assert (rows, kind) == (16, "tree") and why.startswith("step rows 16: 4.00 tok/step")
