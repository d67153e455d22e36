"""The drafter's tree replies read on the verifier (`convert.trees_from_pb`): every tree the
drafter's encoder wrote comes back as sent, with or without scores and whatever its size; an
entry error stays its reason; a malformed tree (unequal lengths, a bad parent, a repeated
sibling, a positive score) fails alone with DraftTree's reason, the others of its reply are
kept."""

from __future__ import annotations

import numpy as np

from services.drafter import convert as dconv
from services.drafter.core import DraftTimes
from services.verifier import convert
from specserve.drafters.base import DraftRequest
from specserve.spec.ddtree import build_ddtree
from specserve.spec.tree import DraftTree, chain_tree
from specserve.v1 import drafter_pb2
from tests.helpers import random_tree


def ddtree(rng: np.random.Generator, depth: int, budget: int) -> DraftTree:
    lp = np.sort(np.log(rng.dirichlet(np.ones(9), size=depth)), axis=1)[:, ::-1].astype(
        np.float32)  # [depth, 9] descending
    ids = np.stack([rng.choice(700, 9, replace=False) for _ in range(depth)])  # [depth, 9]
    return build_ddtree(np.ascontiguousarray(lp), ids.astype(np.int64), budget)


def reply_of(results: list) -> drafter_pb2.TreeBatch:
    batch = convert.draft_batch(4)
    for i in range(len(results)):
        convert.add_draft_entry(batch, DraftRequest(f"r{i}", 1, 9, 15, 9), "dflash", None, [])
    wire = dconv.tree_batch_to_pb(dconv.read_batch(batch), results, DraftTimes())
    return drafter_pb2.TreeBatch.FromString(wire.SerializeToString())


def same(a: DraftTree, b: DraftTree) -> bool:
    return all((x is None and y is None) or np.array_equal(x, y) for x, y in (
        (a.token_ids, b.token_ids), (a.parents, b.parents), (a.depths, b.depths),
        (a.scores, b.scores)))


def test_trees_come_back_as_sent_and_bad_ones_fail_alone():
    rng = np.random.default_rng(11)
    sent = [ddtree(rng, 5, 15), chain_tree([4, 8, 15]), "drafter_entry_error: no context",
            ddtree(rng, 3, 7), DraftTree.empty(), random_tree(rng, 23, vocab=900),
            ddtree(rng, 15, 1)]
    got = convert.trees_from_pb(reply_of(sent))
    assert list(got) == [f"r{i}" for i in range(len(sent))]
    for i, tree in enumerate(sent):
        if isinstance(tree, str):
            assert got[f"r{i}"] == tree
        else:
            assert isinstance(got[f"r{i}"], DraftTree) and same(got[f"r{i}"], tree), i
    reply = reply_of(sent)
    reply.trees[0].parents[4] = 9  # after itself
    del reply.trees[3].depths[-1]  # unequal lengths
    parents = list(reply.trees[5].parents)
    a, b = next((i, j) for j in range(len(parents)) for i in range(j)
                if parents[i] == parents[j])  # two siblings
    reply.trees[5].token_ids[b] = reply.trees[5].token_ids[a]
    reply.trees[6].scores[0] = 0.25
    got = convert.trees_from_pb(reply)
    assert got["r0"] == "malformed tree: parents[i] must be in [0, i] (a parent precedes its child)"
    assert got["r3"].startswith("malformed tree:") and "equal lengths" in got["r3"]
    assert got["r5"] == "malformed tree: siblings must carry distinct token_ids"
    assert got["r6"] == "malformed tree: scores must be finite log-probabilities (<= 0)"
    assert same(got["r1"], sent[1]) and same(got["r4"], sent[4])
    assert got["r2"] == sent[2]
