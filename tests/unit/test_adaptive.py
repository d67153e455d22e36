"""Adaptive speculation: candidate shapes against brute force and the acceptance walk, the cost
model's estimates, the policy's choices on fixed costs, and the engine skipping the drafter
(B = 0) when drafting cannot pay — with the same tokens as plain decoding."""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specserve.engine import adaptive, adaptive_state, speculative, warmup
from specserve.engine.adaptive import Adaptive
from specserve.engine.adaptive_state import EMPTY, State, choose
from specserve.engine.cost import CostModel, StepCycle, context_class, observe_step
from specserve.engine.sequence import Sequence
from specserve.engine.speculative import Ask, Planned
from specserve.spec import shapes
from specserve.spec.accept import accept
from specserve.spec.ddtree import build_ddtree, topk_logprobs
from specserve.spec.metrics import StepTimes, reason_kind
from specserve.spec.tree import DraftTree, chain_tree, verify_layout
from specserve.types import SamplingParams
from tests.fakes import RandomDDTreeDrafter
from tests.helpers import hf_config, random_prompts


def _table(seed: int, depth: int = 3, vocab: int = 5, k: int = 3, scale: float = 1.5):
    logits = torch.randn(depth, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    return logits, *topk_logprobs(logits, k)


def _closed_subsets(lp: np.ndarray, size: int):
    """Every prefix-closed set of `size` nodes of the full (depth × top-k) tree, by brute force:
    a node is a tuple of ranks, its path log-prob the sum of its ranks' log-probs."""
    depth, k = lp.shape
    nodes = [r for d in range(1, depth + 1) for r in itertools.product(range(k), repeat=d)]
    for subset in itertools.combinations(nodes, size):
        s = set(subset)
        if all(len(n) == 1 or n[:-1] in s for n in subset):
            yield sum(float(np.exp(sum(lp[i][r] for i, r in enumerate(n)))) for n in subset)


@pytest.mark.parametrize("seed", [0, 3, 11])
def test_a_ddtree_prefix_is_the_optimal_tree_of_its_size(seed):
    _, lp, ids = _table(seed, k=2)  # 14 nodes in all: every subset can be tried
    tree = build_ddtree(lp, ids, 13)
    for k in (1, 2, 4, 7):
        cut = shapes.prefix(tree, k)
        best = max(_closed_subsets(lp, k))
        assert cut.expected == pytest.approx(best, rel=1e-5)
        small = build_ddtree(lp, ids, k)
        sub = shapes.subtree(tree, cut)
        cut_layout = shapes.prefix_layout(verify_layout(tree, 3, 50), k)
        whole = verify_layout(small, 3, 50)
        for a, b in [(cut_layout.token_ids, whole.token_ids), (cut_layout.mask, whole.mask),
                     (cut_layout.positions, whole.positions)]:
            assert np.array_equal(a, b)
        assert np.array_equal(sub.token_ids, small.token_ids)
        assert np.array_equal(sub.parents, small.parents)


def test_the_chain_inside_a_tree_is_the_argmax_path():
    logits, lp, ids = _table(5, depth=4, vocab=7, k=4)
    tree = build_ddtree(lp, ids, 60)  # every top-4 prefix up to depth 3, and more
    ch = shapes.chain(tree, 10)
    sub = shapes.subtree(tree, ch)
    assert sub.token_ids.tolist() == logits.argmax(-1).tolist()
    assert sub.parents.tolist() == [0, 1, 2, 3]
    for k in (1, 3, 4):  # the chain's layout cut from the tree's is the chain's own
        part = shapes.chain(tree, k)
        cut = shapes.chain_layout(verify_layout(tree, 9, 70), part.nodes)
        whole = verify_layout(shapes.subtree(tree, part), 9, 70)
        for a, b in [(cut.token_ids, whole.token_ids), (cut.positions, whole.positions),
                     (cut.mask, whole.mask)]:
            assert np.array_equal(a, b)
    expected = np.exp(np.cumsum(torch.log_softmax(logits, -1).max(-1).values.numpy())).sum()
    assert ch.expected == pytest.approx(float(expected), rel=1e-5)
    assert len(shapes.chain(tree, 2).nodes) == 2
    assert shapes.chain(DraftTree.empty(), 5).expected == 0.0


@pytest.mark.parametrize("greedy", [True, False])
def test_realized_length_equals_the_walk_on_the_sub_tree(greedy):
    """What a shape inside the verified tree would have accepted, against accept() run on that
    shape alone with the same logits and the same generator state."""
    vocab = 6
    params = SamplingParams(max_tokens=8, temperature=0.0 if greedy else 1.0, seed=4)
    for seed in range(12):
        _, lp, ids = _table(seed, depth=4, vocab=vocab, k=3, scale=0.6)
        tree = build_ddtree(lp, ids, 20)
        g = torch.Generator().manual_seed(seed)
        target = torch.randn(tree.n + 1, vocab, generator=g) * 3  # [n+1, V]
        # make the target follow the tree for a while: its best token at a node is a child
        for node in range(tree.n):
            target[tree.parents[node], tree.token_ids[node]] += 4.0 if node % 3 == 0 else 0.0
        full = accept(target, tree, params, torch.Generator().manual_seed(9))
        cv, nodes = shapes.curves(tree), [r - 1 for r in full.rows]
        for shape in [shapes.prefix(tree, k) for k in (1, 3, 8, 20)] + [shapes.chain(tree, 9)]:
            sub = shapes.subtree(tree, shape)  # built unchecked: a checked copy must agree
            DraftTree(sub.token_ids, sub.parents, sub.depths, sub.scores)
            rows = np.concatenate([[0], shape.nodes + 1])
            alone = accept(target[rows], sub, params, torch.Generator().manual_seed(9))
            assert shapes.realized(full.rows, shape) == alone.accepted_depth
            k = len(shape.nodes)  # the all-at-once curves agree with the shape
            fast = shapes.realized_prefix(nodes, k) if shape.kind == shapes.TREE else \
                shapes.realized_chain(nodes, cv.chain_nodes, k)
            assert fast == alone.accepted_depth
            assert cv.expected(shape.kind, k) == pytest.approx(shape.expected, rel=1e-6)
            assert cv.depth(shape.kind, k) == int(tree.depths[shape.nodes].max(initial=0))


def test_a_prefix_holding_the_chain_is_chosen_over_it_whatever_the_calibration():
    """`chain_inside` against set inclusion for every k; where the prefix holds the chain it
    accepts at least as much on every verified path (so a chain calibrated above it is never
    chosen), and where it does not, the chain can still win."""
    from specserve.engine.adaptive_state import Ratios, State

    for seed in range(6):
        _, lp, ids = _table(seed, depth=4, vocab=7, k=3, scale=0.8)
        tree = build_ddtree(lp, ids, 30)
        cv = shapes.curves(tree)
        for k in range(1, tree.n + 1):
            inside = set(shapes.chain(tree, k).nodes.tolist()) <= set(range(k))
            assert cv.chain_inside(k) == inside
            if inside:  # every path the target could take: the prefix accepts at least as much
                for node in range(tree.n):
                    path, row = [], node + 1
                    while row:
                        path.append(row - 1)
                        row = int(tree.parents[row - 1])
                    accepted = path[::-1]
                    assert shapes.realized_prefix(accepted, k) >= \
                        shapes.realized_chain(accepted, cv.chain_nodes, k)
        st = State(Ratios(0.99), curve=cv)
        for k in (1, 2, 5, 12):  # a chain that accepted 3× what it was expected to
            st.own.real[(shapes.CHAIN, k)], st.own.pred[(shapes.CHAIN, k)] = 300.0, 100.0
        for k in (1, 2, 5, 12):
            gain, kind = st.gain(k, 30)
            assert kind == (shapes.TREE if cv.chain_inside(k) else shapes.CHAIN)
            assert gain >= min(cv.expected(shapes.CHAIN, k), cv.depth(shapes.CHAIN, k))


def test_cost_model_estimates_from_its_nearest_measurements():
    cost = CostModel()
    assert cost.verify_s(1, 16, 1000) is None and cost.draft_s(1, 1000) is None
    for rows, t in [(1, 4.0), (8, 5.0), (32, 9.0)]:
        cost.observe_verify(1, rows, 1000, t)
    assert cost.verify_s(1, 8, 1000) == 5.0
    assert cost.verify_s(1, 16, 1000) == pytest.approx(5.0 + 8 / 24 * 4.0)  # linear
    assert cost.verify_s(1, 64, 1000) == 9.0  # flat past the largest: optimistic
    cost.observe_verify(1, 8, 30000, 10.0)  # a long context, one rows count seen there
    assert cost.verify_s(1, 32, 30000) == pytest.approx(10.0 * 9.0 / 5.0)  # scaled by 1k's
    assert cost.verify_s(3, 8, 1000) == 5.0  # batch bucket 4: the nearest measured (1)
    for t in (10.0, 6.0, 7.0):  # a spike, then the cost moves up: the lower quartile follows
        cost.observe_verify(1, 8, 1000, t)
    assert cost.verify_s(1, 8, 1000) == 5.0
    for t in (6.5, 6.2, 6.1, 6.3, 6.4, 6.0):
        cost.observe_verify(1, 8, 1000, t)
    assert cost.verify_s(1, 8, 1000) == 6.0  # the last 8: 6.0 7.0 6.5 6.2 6.1 6.3 6.4 6.0
    spiked = CostModel()  # a first launch compiled: one entry's only sample is 8x its cost
    spiked.observe_verify(1, 4, 3000, 8.0)
    spiked.observe_verify(1, 64, 30000, 1.5)
    assert spiked.verify_s(1, 4, 3000) == 1.5  # no dearer than more rows at a longer context
    spiked.observe_verify(1, 16, 3000, 1.2)
    assert spiked.verify_s(1, 4, 3000) == 1.2  # nor than more rows at the same one
    cost.observe_draft(1, 1000, 2.0)
    assert cost.draft_s(2, 4000) == 2.0 and context_class(1000) == 10
    assert "verify n=1 rows=8 ctx<=2^10" in cost.table()


def test_a_requests_first_tree_is_not_a_steady_draft_and_a_new_draft_time_is_read():
    """The drafter takes in the prompt's context (fed during the prefill) with a request's
    first tree: that step's drafting is not booked; the steady drafts after it are, and a
    policy caching its step times sees the entry move."""
    seqs = [_seq("a", budget=15), _seq("b", budget=7, start=61)]
    drafter, cost = RandomDDTreeDrafter(50, depth=4, seed=7), CostModel()
    policy = Adaptive(cost, lambda rows: rows)
    firsts, drafts = [], []
    for draft_s in (6.0e-3, 1.5e-3, 1.7e-3):  # the first call takes in the prompts
        plans, _ = speculative.plan(seqs, drafter, 4096, 50)
        firsts.append([p.first for p in plans])
        observe_step(cost, plans, 16, 1e-3, draft_s, draft_rows=2)
        drafts.append(policy.prices(2, 61, warmup.candidates(15))[1])
    assert firsts == [[True, True], [False, False], [False, False]]
    assert drafts == [0.0, 1.5e-3, 1.5e-3]  # none booked, then the steady ones
    cost.observe_draft(2, 61, 1.1e-3)  # cheaper now: the lower quartile moves
    assert policy.prices(2, 61, warmup.candidates(15))[1] == 1.1e-3
    empty = speculative.plan([_seq("c", budget=0)], drafter, 4096, 50)[0]
    assert not empty[0].first and empty[0].seq.drafts == 0  # no tree: not a first one


def test_a_deferred_step_is_booked_by_the_next_forwards_bookings_or_dropped_by_clear():
    """The engine books a step's times late (`defer`): the policy's bookings, run while the
    next forward is on the GPU, book them; a cleared cost model forgets them too."""
    drafter, cost = RandomDDTreeDrafter(50, depth=4, seed=3), CostModel()
    policy = Adaptive(cost, lambda rows: rows)
    plans, _ = speculative.plan([_seq("a", budget=15, start=77)], drafter, 4096, 50)
    observe_step(cost, plans, 16, 2.5e-3, None, draft_rows=1, defer=True)
    assert not cost.verify and cost.pending is not None
    policy.book_pending()
    assert cost.pending is None and [s.value for s in cost.verify.values()] == [2.5e-3]
    observe_step(cost, plans, 16, 3.5e-3, None, draft_rows=1, defer=True)
    cost.clear()
    policy.book_pending()
    assert not cost.verify and cost.pending is None


def test_the_rest_of_a_steps_cycle_is_measured_across_steps_that_share_a_request():
    """From one step's end to the next one's drafts, less the drafting: the schedule, the
    policy's host work, the outputs' delivery. A wait for work between two batches (no request
    in common) is not a step's, nor is a step whose drafting was not its own."""
    def batch(*ids):
        plans = [SimpleNamespace(seq=SimpleNamespace(request_id=i)) for i in ids]
        return SimpleNamespace(plans=plans, chunks=[])

    def times(start_ms, draft_end_ms, end_ms):
        return StepTimes(*(int(t * 1e6) for t in (start_ms, draft_end_ms, end_ms, end_ms)))

    cycle = StepCycle()
    assert cycle.rest(times(0.0, 2.0, 5.0), batch("a"), 1.5e-3) is None  # no step before it
    got = cycle.rest(times(5.7, 8.1, 11.0), batch("a", "b"), 1.9e-3)
    assert got == pytest.approx((8.1 - 5.0) / 1e3 - 1.9e-3)  # 0.7 before + 0.5 beside drafting
    assert cycle.rest(times(400.0, 402.0, 405.0), batch("c"), 1.0e-3) is None  # after a wait
    assert cycle.rest(times(405.4, 407.0, 409.0), batch("c"), None) is None  # overlap's drafts
    assert cycle.rest(times(409.3, 411.0, 414.0), batch("c"), 1.2e-3) == pytest.approx(0.8e-3)


def test_every_shape_plain_decoding_too_pays_the_rest_of_the_steps_cycle():
    """The prices add the measured rest of a step's cycle to every rows count's verify time:
    through the services (the stream to the gateway between steps) a drafter that plain
    decoding beats by the margin on verify times alone is worth its call, and it is drafted."""
    seq, costs = _seq("a", budget=63), []
    for overhead_ms in (None, 5.0):
        cost = _cost(draft_ms=20.0)
        if overhead_ms is not None:
            cost.observe_overhead(1, overhead_ms / 1e3)
        costs.append(cost)
        policy = Adaptive(cost, lambda rows: rows)
        verify, draft = policy.prices(1, 40, warmup.candidates(63))
        rest = 0.0 if overhead_ms is None else overhead_ms / 1e3
        assert [t for _, t in verify] == pytest.approx(
            [cost.verify_s(1, r, 40) + rest for r, _ in verify]) and draft == 20e-3
        policy.shape([_plan(seq, 1, confident=True)])
        now, skip = policy.to_draft([seq])
        assert (skip, now) == (([seq], []) if overhead_ms is None else ([], [seq]))
    assert "overhead n=1" in costs[1].table() and costs[1].overhead_s(4) == 5e-3
    costs[1].clear(draft=False)
    assert costs[1].overhead_s(1) == 5e-3
    costs[1].clear(verify=False)  # as after the warm-up: its own loop is not the serving one
    assert costs[1].overhead_s(1) == 0.0


def _seq(rid: str, budget: int, start: int = 40) -> Sequence:
    seq = Sequence(request_id=rid, prompt_ids=list(range(1, start + 1)),
                   params=SamplingParams(max_tokens=64), stop_ids=frozenset(), max_len=4096,
                   generator=None, arrival=0, budget=budget)
    seq.num_computed = start
    return seq


def _plan(seq: Sequence, seed: int, confident: bool, ask: Ask | None = None) -> Planned:
    """A draft for `seq` as the policy asked the drafter for it (None: the request's budget):
    a DDTree of that budget, or its argmax chain with path log-probs, as DFlash drafts them."""
    budget, chain = (seq.budget, False) if ask is None else ask
    scale = 8.0 if confident else 0.3
    _, lp, ids = _table(seed, depth=15, vocab=50, k=1 if chain else min(budget, 50), scale=scale)
    tree = chain_tree(ids[:budget, 0], np.cumsum(lp[:budget, 0])) if chain else \
        build_ddtree(lp, ids, budget)
    return Planned(seq, tree, verify_layout(tree, seq.last_token, seq.num_computed), budget,
                   chain=chain)


def _cost(draft_ms: float, verify_ms=(1.0, 1.1, 1.2, 1.4, 1.8, 2.6, 2.7)) -> CostModel:
    cost = CostModel()
    for rows, t in zip((1, 2, 4, 8, 16, 32, 64), verify_ms, strict=True):
        cost.observe_verify(1, rows, 40, t / 1e3)
    cost.observe_draft(1, 40, draft_ms / 1e3)
    return cost


def test_policy_takes_big_trees_when_they_pay_and_plain_decoding_when_not():
    seq = _seq("a", budget=63)
    policy = Adaptive(_cost(draft_ms=0.3), lambda rows: rows)
    plan = _plan(seq, 1, confident=True)  # the drafter is sure: long accepted paths expected
    policy.shape([plan])
    assert plan.choice.shape in ("tree", "chain") and plan.choice.nodes >= 7
    assert plan.tree.n == plan.choice.nodes and "tok/s" in plan.choice.why
    assert policy.to_draft([seq]) == ([seq], [])  # keep drafting
    # the drafter costs ten plain steps and expects little: drafted trees are still verified
    # (the drafting is spent), then plain decoding
    slow = Adaptive(_cost(draft_ms=10.0), lambda rows: rows)
    plan = _plan(seq, 2, confident=False)
    slow.shape([plan])
    assert plan.choice.shape in ("tree", "chain")
    now, skip = slow.to_draft([seq])
    assert now == [] and skip == [seq]
    skipped = slow.skipped(seq)
    assert not skipped.drafted and skipped.tree.n == 0 and skipped.choice.shape == "off"
    assert reason_kind(skipped.choice.why) == "plain"
    assert slow.to_draft([seq])[0] == [seq]  # the probe after two skipped steps
    fresh = _seq("b", budget=63)
    assert slow.to_draft([seq, fresh])[0] == [seq, fresh]  # no curve yet: drafted
    # verifying any draft token costs five plain steps: even a drafted tree is dropped
    dear = Adaptive(_cost(draft_ms=0.1, verify_ms=(1.0, 5, 5, 5, 5, 5, 5)), lambda rows: rows)
    plan = _plan(seq, 2, confident=False)
    dear.shape([plan])
    assert plan.choice.shape == "off" and plan.tree.n == 0 and plan.layout.num_rows == 1
    assert reason_kind(plan.choice.why) == "decided"  # plain decoding, decided after drafting


def test_a_decision_to_draft_holds_its_shapes_until_redecide():
    """After a decision that drafting pays, the next steps keep each request's shape (the
    drafter asked for just the tree that holds it, only that shape booked) until `redecide`
    steps or a batch grown past the bucket it was priced for; a decision that pays only because
    the drafting is spent holds nothing."""
    seq = _seq("a", budget=63)
    policy = Adaptive(_cost(draft_ms=0.3), lambda rows: rows, redecide=3)
    first = _plan(seq, 1, confident=True)
    policy.shape([first])
    st, chosen = policy.state["a"], first.choice
    assert "held" not in chosen.why and st.cut is not None
    curve = st.curve
    for step in range(3):
        assert policy.to_draft([seq]) == ([seq], [])
        asked, nodes = policy.draft_budgets([seq])["a"], st.nodes
        plan = _plan(seq, 10 + step, True, asked)
        policy.shape([plan])
        if step < 2:  # held: the asked tree holds the shape, which is kept
            assert asked == (Ask(st.ask) if chosen.shape == "tree" or step == 1 else
                             Ask(st.nodes, chain=True))  # the hold's last: a tree, for its curve
            assert plan.choice.shape == chosen.shape
            assert plan.choice.why == f"held: {chosen.why}" and st.cut is None
            assert plan.tree.n == min(chosen.nodes, asked.budget) == plan.layout.num_rows - 1
            key = (chosen.shape, st.nodes)  # its own shape is booked, nothing else
            before = dict(st.own.real), dict(st.own.pred)
            policy.observe(plan, [1])  # one node accepted
            assert st.own.real[key] == pytest.approx(0.9 * before[0].get(key, 0.0) + 1)
            expected = float(np.exp(plan.tree.scores.astype(np.float64)).sum())
            assert st.own.pred[key] == pytest.approx(0.9 * before[1].get(key, 0.0) + expected)
            assert {k for k in st.own.real if st.own.real[k] != before[0].get(k)} == {key}
            # the hold's last step gives the next decision a curve of its own drafter
            assert (st.curve is curve) == (step == 0)
        else:  # the third step decides afresh, on a tree one class above
            assert asked == Ask(min(63, 2 * nodes + 1))
            assert "held" not in plan.choice.why and st.cut is not None
    fresh = [_seq(f"b{i}", budget=63) for i in range(3)]  # a bigger bucket ends the hold
    policy.shape([_plan(seq, 20, confident=True)])
    policy.to_draft([seq])
    assert policy.to_draft([seq, *fresh])[0] == [seq, *fresh] and not policy._fast
    slow = Adaptive(_cost(draft_ms=10.0), lambda rows: rows, redecide=8)
    slow.shape([_plan(seq, 2, confident=False)])  # verified (drafting spent), then skipped
    assert slow.to_draft([seq]) == ([], [seq])
    with pytest.raises(ValueError, match="redecide"):
        Adaptive(CostModel(), lambda rows: rows, redecide=0)


def test_deferred_bookings_are_the_immediate_ones_taken_before_the_next_shaping():
    """With `defer` a step's bookings wait for `book_pending` (the engine runs it while the next
    forward is on the GPU) yet book what that step verified, though the next step's shaping has
    already replaced the request's kept shape and curve; a decision books them first."""
    seqs = [_seq(r, budget=63) for r in "ab"]
    now, later = (Adaptive(_cost(draft_ms=0.3), lambda rows: rows, redecide=3) for _ in "12")
    held = 0
    for step, accepted in enumerate([[1, 2], [1], [1, 2, 3], [], [1, 2], [1], [1, 2, 3, 4]]):
        plans = {}
        for policy in (now, later):
            policy.to_draft(seqs)
            plans[policy] = [_plan(s, 7 * step + i, confident=step % 3 != 1)
                             for i, s in enumerate(seqs)]
            policy.shape(plans[policy])
        held += plans[later][0].choice.why.startswith("held")
        later.book_pending()  # as the engine does, during the forward
        for policy in (now, later):
            before = dict(policy.shared.real)
            policy.observe_step([(p, [r for r in accepted if r <= p.tree.n], i)
                                 for i, p in enumerate(plans[policy])], None,
                                defer=policy is later)
            assert (policy.shared.real == before) == (policy is later)
        assert now.state["a"].recent == later.state["a"].recent  # taken at once
    assert 0 < held < 7 and later._pending
    later._wide = False  # the forecast is read (not spared by a wide decision)
    later._skipping(seqs, [later.state[r] for r in "ab"])  # a decision: it books first
    assert not later._pending
    for a, b in ((now.state["a"].own, later.state["a"].own), (now.shared, later.shared)):
        assert a.real == pytest.approx(b.real) and a.pred == pytest.approx(b.pred)


def test_a_decision_made_before_the_drafter_is_timed_holds_nothing():
    """A fresh engine's cost model has no drafter time (its warm-up timed a stand-in): the
    first decisions rate drafting as free, so they are made again each step until a drafter
    call is booked; then a decision holds."""
    seq = _seq("a", budget=63)
    cost = _cost(draft_ms=1.0)
    cost.clear(verify=False)  # the verify steps timed, the drafter not
    policy = Adaptive(cost, lambda rows: rows, redecide=8)
    for step in range(3):
        plan = _plan(seq, 30 + step, confident=True)
        policy.shape([plan])
        assert "held" not in plan.choice.why and "+0.00 draft" in plan.choice.why
        assert policy.to_draft([seq]) == ([seq], []) and not policy._fast
    cost.observe_draft(1, 40, 1.0e-3)
    policy.shape([_plan(seq, 40, confident=True)])
    assert policy.to_draft([seq]) == ([seq], []) and policy._fast  # held from now on
    held = _plan(seq, 41, confident=True)
    policy.shape([held])
    assert held.choice.why.startswith("held:") and "+1.00 draft" in held.choice.why


def test_a_decision_moves_off_the_last_ones_rows_only_for_a_clear_gain():
    """Rows priced within STAY of the last decision's keep it (times a few per cent apart are
    noise); a clearly faster count, or no last decision, takes the best as priced."""
    def rated(gain):  # rows 16 and 64 at the same step time, 64 expecting `gain` × 16's tokens
        return [(1, 2.0, 1e-3), (16, 8.0, 2e-3), (64, 8.0 * gain, 2e-3)], 0.5e-3

    for gain in (1.01, 1.04):
        assert choose(rated(gain), 2, True, 1.0, 63)[0] == 64
        assert choose(rated(gain), 2, True, 1.0, 63, held=16)[0] == 16
    assert choose(rated(1.02 * adaptive_state.STAY), 2, True, 1.0, 63, held=16)[0] == 64
    assert choose(rated(0.97), 2, True, 1.0, 63, held=64)[0] == 64
    assert choose(rated(0.9), 2, True, 1.0, 63, held=64)[0] == 16


def test_a_decision_repeating_the_last_holds_twice_as_long_up_to_a_cap():
    """The same choice again doubles the hold (the policy's host work is paid rarely where the
    choice is stable), up to HOLD_GROWTH × redecide; another choice starts over at redecide."""
    seq = _seq("a", budget=63)
    policy = Adaptive(_cost(draft_ms=0.3), lambda rows: rows, redecide=2)
    decided = []  # (step, nodes chosen)
    for step in range(40):
        policy.to_draft([seq])
        plan = _plan(seq, 1, confident=True)
        policy.shape([plan])
        if not plan.choice.why.startswith("held"):
            decided.append((step, plan.choice.nodes))
        policy.observe(plan, [1])  # one node: never the deepest, the hold is not cut short
    span, last = None, None
    for (at, nodes), (then, _) in zip(decided, decided[1:], strict=False):
        span = min(2 * span, adaptive.HOLD_GROWTH * 2) if nodes == last else 2
        assert then - at == span, decided
        last = nodes
    assert span == adaptive.HOLD_GROWTH * 2  # the cap was reached: the choice settled
    assert len({nodes for _, nodes in decided}) > 1  # and a changed choice started over


def test_a_held_chain_is_drafted_as_a_chain_but_on_the_holds_last_step():
    """A held chain is asked of the drafter as a chain (its argmax path, scored: no top-k
    tables, no heap), now and in the drafts sent ahead, and kept and booked as the chain it
    holds; the hold's last step asks for the tree again (the next forecast's curve). A step
    with a chain asked books no drafting time: the decisions price a tree's."""
    seq = _seq("a", budget=63)
    cost = _cost(draft_ms=0.3, verify_ms=(1.0, 1.1, 1.2, 1.4, 4.0, 8.0, 16.0))
    policy = Adaptive(cost, lambda rows: rows, redecide=4)
    for k in (1, 3, 7, 15, 31, 63):  # chains have accepted 6 × what they were expected to
        policy.shared.book(("chain", k), 3.0, 0.5)
    policy.shape([_plan(seq, 1, confident=True)])
    st = policy.state["a"]
    assert st.kind == "chain" and 1 < st.nodes < st.ask and policy._hold == 3
    for step in range(3):
        assert policy.to_draft([seq]) == ([seq], []) and policy._fast
        asked = policy.draft_budgets([seq])["a"]
        assert asked == (Ask(st.nodes, chain=True) if step < 2 else Ask(st.ask))
        plan = _plan(seq, 10 + step, True, asked)
        policy.shape([plan])
        assert plan.choice.shape == "chain" and plan.tree.n == plan.choice.nodes <= st.nodes
        assert plan.tree.n == st.nodes or not asked.chain  # a tree's may hold less of it
        assert np.array_equal(plan.tree.depths, np.arange(1, plan.tree.n + 1))
        before = {k: list(e.recent) for k, e in cost.draft.items()}
        observe_step(cost, [plan], 0, 1e-3, 9e-3, 0)
        after = {k: list(e.recent) for k, e in cost.draft.items()}
        assert (after == before) == (step < 2)  # 9 ms booked from the tree's step only
        policy.observe(plan, [1, 2])
        assert st.own.real[("chain", st.nodes)] > 0
        ahead = policy.ahead([seq])
        assert ahead == ({"a": Ask(st.nodes, chain=True)} if step == 0 else
                         {"a": Ask(st.ask)} if step == 1 else None)


def test_a_held_decision_outlives_finished_requests_and_takes_in_new_ones():
    """A request that finishes leaves the hold standing; a new one joins it with the held
    size's DDTree prefix (the drafter asked for just that); a request that the last decision
    left out (skipped, or decided alone before it) ends it."""
    a, b, c = (_seq(r, budget=63) for r in "abc")
    policy = Adaptive(_cost(draft_ms=0.3), lambda rows: rows, redecide=8)
    policy.shape([_plan(a, 1, confident=True), _plan(b, 2, confident=True)])
    st = policy.state["a"]
    k, ask, kind = st.nodes, st.ask, st.kind
    assert 1 <= k < 63 and policy.state["b"].nodes == k
    policy.release("b")  # b finished
    assert policy.to_draft([a]) == ([a], []) and policy.draft_budgets([a]) == {"a": Ask(ask)}
    plan = _plan(a, 3, confident=True)
    policy.shape([plan])
    assert plan.choice.why.startswith("held:") and plan.choice.shape == kind
    d = _seq("d", budget=63)  # its prompt just done: the drafts sent ahead ask the held size
    assert policy.ahead([a, d]) == {"a": Ask(ask), "d": Ask(k)}
    assert policy.ahead([a, c, d]) is None  # a bigger bucket than the decision priced
    assert policy.to_draft([a, c]) == ([a, c], [])  # c is new: it joins
    assert policy.draft_budgets([a, c]) == {"a": Ask(ask), "c": Ask(k)}
    joined = _plan(c, 4, confident=True)
    policy.shape([_plan(a, 5, confident=True), joined])
    assert joined.choice.shape == "tree" and joined.tree.n == k == joined.layout.num_rows - 1
    assert joined.choice.why.startswith("held: joined:")
    assert np.array_equal(joined.tree.token_ids, _plan(c, 4, confident=True).tree.token_ids[:k])
    policy.observe(joined, [1, 2])  # its shape is booked like any held one
    assert policy.state["c"].own.real[("tree", k)] == 2
    apart = Adaptive(_cost(draft_ms=0.3), lambda rows: rows, redecide=8)
    apart.shape([_plan(a, 1, confident=True)])
    apart.shape([_plan(b, 2, confident=True)])  # a second decision, without a
    assert apart.to_draft([a, b]) == ([a, b], []) and not apart._fast
    assert apart.draft_budgets([a])["a"] == Ask(min(63, 2 * apart.state["a"].nodes + 1))


def test_a_skipping_request_is_probed_once_the_target_is_sure_of_its_plain_steps():
    """The target's top-1 probability on plain steps is read every CONFIDENCE_EVERY of them
    (one softmax and transfer each); once a chain as sure would pay, the request is drafted
    before its probe gap is up."""
    seq = _seq("a", budget=63)
    policy = Adaptive(_cost(draft_ms=1.5), lambda rows: rows)
    policy.shape([_plan(seq, 2, confident=False)])  # the drafter expected little
    st = policy.state["a"]
    assert policy.to_draft([seq]) == ([], [seq])
    st.gap = 32  # probes backed off
    gen = torch.Generator().manual_seed(9)
    flat = torch.randn(3, 50, generator=gen) * 0.1  # [rows, V]: top-1 ≈ 1/50
    sure = torch.randn(3, 50, generator=gen)
    sure[1, 17] += 30.0  # top-1 ≈ 1
    readings = []
    for step in range(1, 30):
        if step > 1 and (now := policy.to_draft([seq])[0]):
            break
        plan = policy.skipped(seq)
        before = st.confidence
        policy.observe_step([(plan, [], 0 if step == 1 else 1)], flat if step == 1 else sure)
        if st.confidence != before:
            readings.append(st.skipped)
    assert now == [seq] and step < st.gap and st.probing
    assert readings == [1 + adaptive.CONFIDENCE_EVERY * i for i in range(len(readings))]
    assert len(readings) >= 3 and readings[-1] == step - 1  # probed right after a reading


def test_one_sure_token_right_after_a_draft_does_not_call_a_probe():
    """The first reading after a draft is one token: a probe needs a second reading that
    agrees (else a drafter that just failed on text the target is sure of is probed every
    other step)."""
    seq = _seq("a", budget=63)
    policy = Adaptive(_cost(draft_ms=1.5), lambda rows: rows)
    policy.shape([_plan(seq, 2, confident=False)])
    st = policy.state["a"]
    assert policy.to_draft([seq]) == ([], [seq])
    st.gap = 32  # probes backed off
    sure = torch.randn(2, 50, generator=torch.Generator().manual_seed(4))
    sure[:, 11] += 30.0  # [rows, V]: top-1 ≈ 1
    probed_at = None
    for step in range(1, 12):
        if step > 1 and policy.to_draft([seq])[0]:
            probed_at = st.skipped
            break
        policy.observe_step([(policy.skipped(seq), [], 1)], sure)
        assert st.confidence == pytest.approx(1.0, abs=1e-6)
    assert probed_at == 1 + adaptive.CONFIDENCE_EVERY  # the second reading, not the first


def _deepest_path(tree: DraftTree) -> list[int]:
    """The verify rows, by depth, of the path to the tree's deepest node (all of it accepted)."""
    rows, row = [], int(np.argmax(tree.depths)) + 1
    while row:
        rows.append(row)
        row = int(tree.parents[row - 1])
    return rows[::-1]


def test_a_held_shape_accepted_to_its_deepest_node_is_explored_a_size_class_up():
    """When most held requests accept their held shape to its deepest node (the drafter asked
    for just that shape; the client's budget allows more), the hold ends and the next decision
    verifies a size class above it where its rates would stay, says so and holds nothing; a
    shape that stops short keeps the hold; after an exploration the decision did not follow,
    the next hold ends only at its second saturated step; a decision on drafts sent ahead for
    the hold (the served path's: no bigger tree drafted) explores nothing and holds again."""
    seq = _seq("a", budget=63)
    steep = _cost(draft_ms=0.3, verify_ms=(1.0, 1.1, 1.2, 1.4, 4.0, 8.0, 16.0))
    policy = Adaptive(steep, lambda rows: rows, redecide=8)
    policy.shape([_plan(seq, 1, confident=True)])  # 63 nodes priced, fewer chosen
    k = policy.state["a"].nodes
    assert 1 <= k < 15 and policy._hold > 0

    def held(seed: int, rows: int | None) -> None:  # a held step, `rows` of its path accepted
        assert policy.to_draft([seq]) == ([seq], []) and policy._fast
        plan = _plan(seq, seed, True, policy.draft_budgets([seq])["a"])
        policy.shape([plan])
        assert reason_kind(plan.choice.why) == "held" and plan.budget < seq.budget
        policy.observe_step([(plan, _deepest_path(plan.tree)[:rows], 0)], None)

    def decided(seed: int, rows: int | None) -> Planned:
        assert policy.to_draft([seq]) == ([seq], []) and not policy._fast
        plan = _plan(seq, seed, True, policy.draft_budgets([seq])["a"])
        policy.shape([plan])
        policy.observe_step([(plan, _deepest_path(plan.tree)[:rows], 0)], None)
        return plan

    held(2, 1)  # stopped short
    held(3, None)  # saturated: the hold ends
    assert policy.draft_budgets([seq]) == {"a": Ask(2 * k + 1)}
    explored = decided(4, 1)
    assert reason_kind(explored.choice.why) == "explore" and explored.choice.nodes > k
    assert policy._hold == 0
    stayed = decided(5, None)
    assert stayed.choice.nodes <= k and policy._hold > 0  # the exploration did not pay
    assert reason_kind(stayed.choice.why) == "decided"
    k = policy._held[1]
    held(6, None)  # saturated, but the wait has doubled
    held(7, None)
    assert policy.to_draft([seq]) == ([seq], []) and not policy._fast
    ahead = _plan(seq, 8, True, Ask(k))  # drafts sent ahead during the hold: the held size only
    policy.shape([ahead])
    assert reason_kind(ahead.choice.why) == "decided" and policy._hold > 0  # held again


def test_a_shape_never_verified_is_as_calibrated_as_its_nearest_verified_one():
    """The drafter's calibration of a shape no tree has been verified at is borrowed from the
    booked shape nearest in size (of its kind first), not the drafter's own 1: an
    under-confident drafter's bigger trees look as good as its verified ones."""
    from specserve.engine.adaptive_state import Ratios, State

    shared = Ratios(0.99)
    a, b = State(shared), State(shared)
    assert a.calibration((shapes.TREE, 31)) == 1.0  # nothing booked yet
    a.book((shapes.TREE, 7), 13, 6.5)  # accepted twice what the drafter expected
    seven = shared.ratio((shapes.TREE, 7))
    assert seven > 1.5
    for st in (a, b):  # b never verified a tree: the shared calibration is its prior
        assert st.calibration((shapes.TREE, 31)) == pytest.approx(seven)
        assert st.calibration((shapes.CHAIN, 15)) == pytest.approx(seven)  # no chain booked
    a.book((shapes.TREE, 63), 3, 4.5)
    assert b.calibration((shapes.TREE, 31)) == pytest.approx(shared.ratio((shapes.TREE, 63)))
    assert b.calibration((shapes.TREE, 15)) == pytest.approx(seven)
    a.book((shapes.CHAIN, 3), 2, 2.0)
    assert b.calibration((shapes.CHAIN, 15)) == pytest.approx(shared.ratio((shapes.CHAIN, 3)))
    assert a.calibration((shapes.TREE, 7)) != b.calibration((shapes.TREE, 7))  # a's own


def _scored_chain(probs: list[float]) -> DraftTree:
    chain = chain_tree(range(3, 3 + len(probs)))  # each node's score: its path's log-prob
    return DraftTree.unchecked(chain.token_ids, chain.parents, chain.depths,
                               np.cumsum(np.log(probs)).astype(np.float32))


def test_a_confident_probe_reaches_as_deep_as_the_drafter_has_drafted():
    """The target's confidence on plain steps prices a chain as deep as the longest chain any
    request's tree has held, not the last (shallow) tree of this request."""
    from specserve.engine.adaptive_state import Ratios, State

    shared = Ratios(0.99)
    shallow, deep = State(shared), State(shared)
    shallow.take_curve(_scored_chain([0.3, 0.2]))
    assert shared.deepest == 2
    deep.take_curve(_scored_chain([0.9] * 9))
    assert shared.deepest == 9 and len(shallow.curve.chain_nodes) == 2
    shallow.confidence = 0.95
    sure = [sum(0.95 ** d for d in range(1, n + 1)) for n in range(10)]
    assert shallow.confident_gain(7, 63)[0] == pytest.approx(sure[7])
    assert shallow.confident_gain(15, 63)[0] == pytest.approx(sure[9])  # the drafter's deepest
    assert shallow.confident_gain(15, 4)[0] == pytest.approx(sure[4])  # the client's budget


def test_before_drafting_a_request_is_forecast_at_least_what_it_has_been_accepting():
    """The skip decision before drafting reads the last tree's curve, but no less than the
    request's recent accepted length at the size it holds: one shallow tree does not turn a
    request that has been accepting long paths over to plain decoding."""
    seq = _seq("a", budget=63)
    sure = Adaptive(_cost(draft_ms=3.0), lambda rows: rows)
    plan = _plan(seq, 1, confident=True)
    sure.shape([plan])
    sure.observe(plan, [1, 2, 3, 4, 5])
    assert sure.state["a"].recent == 5

    def skipped(recent):
        policy = Adaptive(_cost(draft_ms=3.0), lambda rows: rows)
        policy.shape([_plan(seq, 2, confident=False)])  # a flat tree: little expected
        st = policy.state["a"]
        st.nodes, st.recent = 15, recent
        return policy.to_draft([seq]) == ([], [seq])

    assert skipped(None) and skipped(0.5) and not skipped(6.0)


def test_a_decision_that_drafting_wins_widely_spares_the_next_forecast(monkeypatch):
    """After a decision that found drafting WIDE × faster than plain decoding, the next steps
    that are not held draft every request that took part without reading the forecast (or
    booking), new requests with them; one that did not take part in the last decision, or a
    decision short of WIDE, reads it again."""
    seqs = [_seq(r, budget=63) for r in "ab"]
    for wide in (True, False):
        if not wide:
            monkeypatch.setattr(adaptive, "WIDE", 1e9)  # the same decision, short of WIDE
        policy = Adaptive(_cost(draft_ms=0.3), lambda rows: rows, redecide=1)
        plans = [_plan(s, 3 + i, confident=True) for i, s in enumerate(seqs)]
        policy.shape(plans)
        rated = policy._rated(seqs, [policy.state[s.request_id] for s in seqs])
        assert policy._wide == wide == (adaptive_state.advantage(rated) >= adaptive.WIDE)
        policy.observe_step([(p, [1], i) for i, p in enumerate(plans)], None, defer=True)
        reads = []
        policy._best = lambda *a, _best=policy._best, _reads=reads, **k: (
            _reads.append(1) or _best(*a, **k))
        fresh = _seq(f"new{wide}", budget=63)  # starts from the last curve: no decision yet
        batch = [*seqs, fresh]
        assert policy.to_draft(batch) == (batch, [])  # not held (redecide 1): drafting wins
        assert len(reads) == (not wide) and bool(policy._pending) == wide
        if wide:
            policy.shape([_plan(_seq("c", budget=63), 9, confident=True)])  # c alone decides
            assert policy.to_draft(seqs)[0] == seqs and len(reads) == 1


def test_requests_half_way_to_their_probe_ride_along_with_one_that_is_due():
    """Skipping requests probe in one drafter call: when one is due, those past half their
    gap are drafted with it; the others keep skipping."""
    seqs = [_seq(r, budget=63) for r in "abc"]
    slow = Adaptive(_cost(draft_ms=10.0), lambda rows: rows)
    slow.shape([_plan(s, 2 + i, confident=False) for i, s in enumerate(seqs)])
    assert slow.to_draft(seqs) == ([], seqs)
    for s, gap in zip(seqs, (4, 8, 32), strict=True):
        st = slow.state[s.request_id]
        st.skipped, st.gap = 3, gap  # a is due, b half-way, c far from it
    assert slow.to_draft(seqs) == (seqs[:2], seqs[2:])
    assert slow.state["a"].probing and slow.state["b"].probing and not slow.state["c"].probing


def test_a_skipping_batch_reads_its_forecast_again_only_when_its_inputs_move():
    """Plain decoding's steps read the forecast once: again after a draft is booked, the cost
    model moves, the batch changes or its context crosses a class; the choices are those of a
    policy that reads it every step."""
    seqs = [_seq("a", budget=63), _seq("b", budget=63, start=57)]
    policies = [Adaptive(_cost(draft_ms=10.0), lambda rows: rows) for _ in range(2)]
    reads = []
    for policy in policies:
        policy.shape([_plan(s, 2 + i, confident=False) for i, s in enumerate(seqs)])
    best, gen = policies[0]._best, torch.Generator().manual_seed(12)
    policies[0]._best = lambda *a, **k: reads.append(k.get("gain")) or best(*a, **k)

    def step(batch):
        got = [p.to_draft(batch) for p in policies]
        policies[1]._plain_at = None  # the twin reads its forecast every step
        for p in policies:
            p.observe_step([(p.skipped(s), [], i) for i, s in enumerate(batch)],
                           torch.randn(len(batch), 50, generator=gen))
        assert got[0] == got[1] and got[0][1] == batch  # the same choice: all skip
        for st in (st for p in policies for st in p.state.values()):
            st.gap = 32  # probes backed off
        return sum(g is State.forecast_gain for g in reads)

    assert [step(seqs) for _ in range(3)] == [1, 1, 1]
    policies[0].cost.observe_verify(1, 3, 40, 1e-3)  # a shape not measured before
    assert step(seqs) == 2 and step(seqs) == 2
    assert step(seqs[:1]) == 3 and step(seqs[:1]) == 3  # b finished
    seqs[0].num_computed = 2048  # a longer context class
    assert step(seqs[:1]) == 4


def test_a_new_request_starts_from_its_drafters_last_curve_and_probe_gap():
    """A drafter that has not paid (its last curve, probes backed off to every 8 steps) is not
    called for a new request at once; a request of another drafter has no such prior."""
    seq = _seq("a", budget=63)
    slow = Adaptive(_cost(draft_ms=10.0), lambda rows: rows)
    slow.shape([_plan(seq, 2, confident=False)])
    slow.state["a"].gap = 8
    fresh, other = _seq("b", budget=63), _seq("c", budget=63)
    other.drafter_kind = "ngram"
    assert slow.to_draft([fresh, other]) == ([other], [fresh])
    assert slow.state["b"].curve is slow.state["a"].curve and slow.state["c"].curve is None


def test_policy_respects_each_request_budget_and_leaves_unscored_trees():
    seq = _seq("a", budget=5)
    policy = Adaptive(_cost(draft_ms=0.01), lambda rows: rows)
    plan = _plan(seq, 3, confident=True)
    policy.shape([plan])
    assert plan.tree.n <= 5
    tree = DraftTree(plan.tree.token_ids, plan.tree.parents, plan.tree.depths)  # no scores
    bare = Planned(seq, tree, verify_layout(tree, seq.last_token, seq.num_computed), 5)
    zero = _seq("z", budget=0)
    plain = Planned(zero, DraftTree.empty(), verify_layout(DraftTree.empty(), 1, 40), 0)
    policy.shape([bare, plain])
    assert bare.tree is tree and bare.choice.nodes == tree.n  # kept, and said why
    assert "no probabilities" in bare.choice.why
    assert plain.choice.shape == "off" and "budget 0" in plain.choice.why


def test_a_request_without_a_curve_does_not_keep_the_others_drafting():
    """An n-gram request (trees without probabilities: never a curve) beside one whose drafter
    cannot pay: it is drafted, the other still skips the drafter."""
    seq, ngram = _seq("a", budget=63), _seq("n", budget=63)
    slow = Adaptive(_cost(draft_ms=10.0), lambda rows: rows)
    plan = _plan(seq, 2, confident=False)
    tree = chain_tree([5, 6, 7])
    bare = Planned(ngram, tree, verify_layout(tree, ngram.last_token, ngram.num_computed), 63)
    slow.shape([plan, bare])
    assert bare.choice.shape == "chain" and bare.tree is tree
    assert slow.to_draft([ngram, seq]) == ([ngram], [seq])
    assert slow.to_draft([seq, ngram]) == ([ngram], [seq])  # and so on, step after step


class _SlowDrafter(RandomDDTreeDrafter):
    """Random trees (so acceptance is rare) that take 40 ms a call."""

    def __init__(self, vocab: int) -> None:
        super().__init__(vocab, depth=4, seed=3)
        self.calls = 0

    def draft(self, requests):
        self.calls += 1
        time.sleep(0.04)
        return super().draft(requests)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    import transformers

    torch.manual_seed(5)
    hf = transformers.Qwen3ForCausalLM(hf_config("qwen3-gqa4-yarn", num_hidden_layers=2,
                                                 initializer_range=0.2)).eval()
    path = tmp_path_factory.mktemp("adaptive-target")
    hf.save_pretrained(path)
    return path, hf.config.vocab_size


def test_engine_stops_calling_a_drafter_that_cannot_pay(tiny_target, make_engine):
    from specserve.engine.warmup import warm_up_engine

    path, vocab = tiny_target
    prompts = random_prompts(2, vocab, [19, 33], seed=8)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = make_engine(path, max_draft_tokens=15).generate(prompts, params)
    engine = make_engine(path, max_draft_tokens=15, adaptive=True, max_num_seqs=2)
    warm_up_engine(engine)  # the verify costs, as the services measure them
    assert engine.cost.verify and not engine.cost.overhead  # its own loop's cycle: not kept
    drafter = _SlowDrafter(vocab)
    engine.set_drafter(drafter)
    steps = []
    engine.on_step = lambda rid, s: steps.append(s)
    assert engine.generate(prompts, params, budget=15) == plain
    off = [s for s in steps if s.shape == "off"]
    assert len(off) > len(steps) // 2 and all(s.tree_size == 0 for s in off)
    assert drafter.calls < len(steps) // 4  # skipped steps make no drafter call
    assert any("plain decoding" in (s.why or "") for s in off)


def test_warm_up_books_steady_verify_times_not_first_launches(tiny_target, make_engine,
                                                               monkeypatch):
    """A shape's first launch (a graph capture, a compile) takes 0.2 s here: the warm-up's
    bookings must not carry it, or the shape looks dear and is never chosen, so never timed."""
    from specserve.engine import isolation
    from specserve.engine.warmup import warm_up_engine

    path, _ = tiny_target
    engine = make_engine(path, max_draft_tokens=15, adaptive=True)
    seen, forward, slow, booked = set(), isolation.forward, [False], []

    def slow_first_launch(eng, plans, chunks, *rest):
        rows = tuple(sorted({p.layout.num_rows for p in plans}))
        slow[0] = bool(plans and not chunks and rows not in seen)
        if slow[0]:
            seen.add(rows)
            time.sleep(0.2)
        return forward(eng, plans, chunks, *rest)

    cost, observe, clear = engine.cost, engine.cost.observe_verify, engine.cost.clear
    monkeypatch.setattr(isolation, "forward", slow_first_launch)
    monkeypatch.setattr(cost, "observe_verify", lambda *a: (booked.append(slow[0]), observe(*a)))
    monkeypatch.setattr(cost, "clear", lambda verify=True, draft=True: (
        verify and booked.clear(), clear(verify=verify, draft=draft)))
    warm_up_engine(engine)
    verify = [k for k in cost.table() if k.startswith("verify")]
    assert len(seen) >= 4 and len(verify) >= 4  # plain decoding and trees of three sizes
    assert len(booked) >= len(verify) and not any(booked)  # no first launch among them


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_warm_up_times_every_tree_of_every_batch_bucket(tiny_target, make_engine, graphs):
    """With adaptive speculation the warm-up also runs the server's batches (2 requests at
    once, then 3: the largest of bucket 4 it runs) through a chain of every size class and a
    plain step, each step booked at its batch: a batch's shapes are measured, not estimated
    from the one shape its requests chose. With CUDA graphs every rows bucket's graph of each
    batch bucket is captured first (a step that captures is not booked). The stand-ins leave
    no request or page behind."""
    from specserve.engine.warmup import warm_up_engine

    path, _ = tiny_target
    engine = make_engine(path, max_draft_tokens=15, adaptive=True, max_num_seqs=3,
                         max_num_batched_tokens=256, cuda_graphs=graphs)
    warm_up_engine(engine, (1, 16))
    measured = {(n, rows) for n, rows, _ in engine.cost.verify}
    assert {(n, rows) for n in (2, 4) for rows in (1, 2, 4, 8, 16)} <= measured
    assert not any(n > 4 for n, _ in measured) and not engine.requests
    assert engine.blocks.num_used_pages == 0


def test_the_engine_books_a_steps_times_during_the_next_forward(tiny_target, make_engine):
    """Off the step's path: a decode step leaves its times pending; the next step's forward
    books them (while the GPU would verify), and leaves its own pending."""
    path, vocab = tiny_target
    engine = make_engine(path, max_draft_tokens=7, adaptive=True)
    engine.set_drafter(RandomDDTreeDrafter(vocab, depth=3, seed=4))
    engine.add_request("d", random_prompts(1, vocab, [29], seed=5)[0],
                       SamplingParams(max_tokens=20, ignore_eos=True), budget=7)
    pending = []
    while engine.has_unfinished and len(pending) < 3:
        engine.step()
        if engine.last_step is not None and not engine.last_step.prefill:
            pending.append((engine.cost.pending, sum(len(s.recent)
                                                     for s in engine.cost.verify.values())))
    assert all(p is not None for p, _ in pending)  # each decode step's own, not yet booked
    assert len({id(p) for p, _ in pending}) == 3  # a new one each step
    assert [n for _, n in pending] == [0, 1, 2]  # the one before it booked by its forward
    engine.abort("d")


def test_the_engine_books_the_rest_of_each_steps_cycle_not_its_wait_for_work(tiny_target,
                                                                             make_engine):
    path, vocab = tiny_target
    engine = make_engine(path, max_draft_tokens=7, adaptive=True)
    engine.set_drafter(RandomDDTreeDrafter(vocab, depth=3, seed=4))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.generate(random_prompts(1, vocab, [29], seed=5), params, budget=7)
    first = list(engine.cost.overhead[1].recent)
    assert first and all(0 < s < 0.2 for s in first)
    time.sleep(0.3)  # no request: the engine waits for work
    engine.generate(random_prompts(1, vocab, [31], seed=6), params, budget=7)
    recent = engine.cost.overhead[1].recent
    assert recent[-1] != first[-1] and max(recent) < 0.2
    assert engine.adaptive.prices(1, 40, warmup.candidates(7))[0][0][1] == pytest.approx(
        engine.cost.verify_s(1, 1, 40) + engine.cost.overhead_s(1))


def test_a_step_that_builds_a_cuda_graph_is_not_booked(tiny_target, make_engine):
    path, vocab = tiny_target
    engine = make_engine(path, max_draft_tokens=7, adaptive=True, cuda_graphs="on")
    engine.set_drafter(RandomDDTreeDrafter(vocab, depth=3, seed=1))
    graphs, booked = engine.runner.graphs, []
    engine.add_request("g", random_prompts(1, vocab, [23], seed=2)[0],
                       SamplingParams(max_tokens=12, ignore_eos=True), budget=7)
    while engine.has_unfinished:
        before = (graphs.builds, engine.cost.table())
        engine.step()
        if engine.last_step is not None and not engine.last_step.prefill:  # a decode step
            # its times wait for the next forward's wait on the GPU: booked here instead
            assert engine.cost.pending is not None and engine.cost.table() == before[1]
            engine.cost.book_pending()
            booked.append((graphs.builds > before[0], engine.cost.table() != before[1]))
    assert (True, False) in booked and (False, True) in booked  # both kinds of step happened
    assert (True, True) not in booked  # a step that built a graph booked nothing


def test_every_reason_outside_the_choice_has_a_kind():
    """The plans the policy did not shape say why (traced as `adaptive.why`), and each why
    has a kind for the reasons metric: trees without probabilities, budget 0, a fallback, no
    draft."""
    seq, zero = _seq("a", budget=15), _seq("z", budget=0)
    chain = chain_tree(np.array([5, 9, 2]))  # no scores: the n-gram drafter's kind of tree
    cases = [(Planned(seq, chain, verify_layout(chain, seq.last_token, seq.num_computed), 15),
              "as_drafted"),
             (Planned(zero, EMPTY, verify_layout(EMPTY, zero.last_token, 40), 0), "budget_0"),
             (Planned(seq, EMPTY, verify_layout(EMPTY, seq.last_token, 40), 15,
                      fallback="drafter_error: DrafterTimeout: no reply"), "fallback"),
             (Planned(seq, EMPTY, verify_layout(EMPTY, seq.last_token, 40), 15), "no_draft")]
    policy = Adaptive(_cost(draft_ms=0.3), lambda rows: rows)
    policy.shape([p for p, _ in cases])
    assert [reason_kind(p.choice.why) for p, _ in cases] == [kind for _, kind in cases]
    assert reason_kind("a why no kind names") == "other"
