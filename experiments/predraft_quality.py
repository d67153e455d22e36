"""Could a DFlash draft be made a step ahead (SSD-style), while the target still verifies?

Issue 23 item 4 names pre-drafting "the next block for the most likely accepted outcomes while
the target verifies" as a way below the serial step. A DFlash draft reads the target's hidden
states of every committed token as its context; the tokens the verify in flight will accept
(x, a_1 … a_k) and its bonus b have none yet. A draft made ahead must therefore guess the
outcome (k, b) and put those tokens into the block itself, beside context features that stop
where the last draft's did:

    serial:   context F[: start]   block [b, mask × 15]                 at start …
    ahead:    context F[: prev]    block [x, a_1 … a_k, b, mask × 15]   at prev …
    gap:      context F[: prev]    block [b, mask × 15]                 at start … (the
              accepted tokens left out: positions prev … start − 1 missing)

This script measures both halves on the committed demo pair with the `dflash` package's own
model (no cache, float32, greedy chains along the target's greedy continuation, CPU):
  accepted   the chain's accepted length of the serial draft and of the two drafts made
             ahead with the outcome guessed right, step by step on the same positions;
  hit@M      how often the true outcome (k, b) is among the M most likely under the last
             draft's own probabilities (P(k accepted) · P(b at k + 1), b ≠ the drafted token;
             all 15 accepted has no bonus in the block and counts as a miss);
and prices them with a verify time V and a drafting time D (the 8B pair's, from
experiments/overlap_bound.py, as arguments): a hit costs V, a miss V + D, each step advances
by its draft's accepted length + 1 — tok/s over the serial engine's (1 + accepted) / (V + D),
with every draft ahead free (a bound).

    PYTHONPATH=. .venv/bin/python experiments/predraft_quality.py [--ctx 192] [--new 96]
        [--prompts 4] [--v-ms 5.1] [--d-ms 2.2] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from specserve.demo import DEMO_DRAFTER, DEMO_TARGET
from specserve.demo.evaluate import novel_ids, predictable_ids
from specserve.tokenizer import Tokenizer

BLOCK = 16
HITS = (1, 4, 8, 16)


def load():
    import transformers
    from dflash.model import DFlashDraftModel

    target = transformers.AutoModelForCausalLM.from_pretrained(
        DEMO_TARGET, dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(DEMO_DRAFTER, dtype=torch.float32).eval()
    return target, draft


@torch.no_grad()
def continuation(target, prompt: list[int], new: int) -> tuple[list[int], tuple]:
    """The target's greedy continuation (prompt + it) and its hidden states, every layer."""
    ids = torch.tensor([prompt])
    out = target.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new)
    seq = out[0].tolist()
    hidden = target(out, output_hidden_states=True).hidden_states
    return seq, hidden


@torch.no_grad()
def block_logits(target, draft, feats, seq: list[int], ctx_end: int, known_from: int,
                 start: int) -> torch.Tensor:
    """Logits [15, V] of the mask positions start+1 … start+15 of a block holding seq's
    tokens known_from … start, over context features [0, ctx_end) (positions between ctx_end
    and known_from are left out)."""
    from dflash.model import _output_head, _raw_input_embeddings

    tokens = seq[known_from: start + 1] + [draft.mask_token_id] * (BLOCK - 1)
    emb = _raw_input_embeddings(target, torch.tensor([tokens]))
    pos = torch.cat([torch.arange(0, ctx_end), torch.arange(start + BLOCK - len(tokens),
                                                            start + BLOCK)])[None]
    hidden = draft(target_hidden=feats[:, :ctx_end], noise_embedding=emb, position_ids=pos)
    return draft.compute_logits(hidden[:, -(BLOCK - 1):], _output_head(target))[0]


def accepted(logits: torch.Tensor, seq: list[int], start: int) -> int:
    drafted = logits.argmax(-1).tolist()
    truth = seq[start + 1: start + BLOCK]
    n = 0
    while n < min(len(drafted), len(truth)) and drafted[n] == truth[n]:
        n += 1
    return n


def outcome_rank(logits: torch.Tensor, k: int, bonus: int) -> int | None:
    """The rank (0 = likeliest) of outcome (k accepted, bonus) among every (k', b') under the
    draft's own probabilities; None when it cannot be guessed (all accepted)."""
    if k >= logits.shape[0]:
        return None
    probs = logits.softmax(-1)  # [15, V]
    top = probs.argmax(-1)  # [15] the drafted chain
    p_top = probs.gather(1, top[:, None])[:, 0]
    prefix = torch.cat([torch.ones(1), torch.cumprod(p_top, 0)[:-1]])  # P(first k' accepted)
    joint = prefix[:, None] * probs  # [15, V]: P(k' accepted, then b')
    joint[torch.arange(len(top)), top] = 0.0  # b' == the drafted token is an acceptance
    target_p = joint[k, bonus]
    return int((joint > target_p).sum())


def walk(target, draft, seq: list[int], hidden, start: int) -> list[dict]:
    """Steps of the serial chain engine from `start` (the bonus of the prefill) along `seq`."""
    from dflash.model import extract_context_feature

    feats = extract_context_feature(hidden, draft.target_layer_ids)
    steps, prev, prev_logits = [], None, None
    while start + BLOCK < len(seq):
        serial = block_logits(target, draft, feats, seq, start, start, start)
        acc = accepted(serial, seq, start)
        row = dict(start=start, serial=acc)
        if prev is not None:
            ahead = block_logits(target, draft, feats, seq, prev, prev, start)
            gap = block_logits(target, draft, feats, seq, prev, start, start)
            row.update(ahead=accepted(ahead, seq, start), gap=accepted(gap, seq, start),
                       rank=outcome_rank(prev_logits, start - prev - 1, seq[start]))
        steps.append(row)
        prev, prev_logits, start = start, serial, start + acc + 1
    return steps


def price(steps: list[dict], m: int, v: float, d: float) -> dict:
    """Expected tok/s of drafting ahead (M guesses, a miss drafts serially) over serial."""
    rows = [s for s in steps if "ahead" in s]
    hit = [s["rank"] is not None and s["rank"] < m for s in rows]
    toks = sum(1 + (s["ahead"] if h else s["serial"]) for s, h in zip(rows, hit, strict=True))
    secs = sum(v + (0 if h else d) for h in hit)
    serial = sum(1 + s["serial"] for s in rows) / (len(rows) * (v + d))
    return dict(hit_rate=sum(hit) / len(rows), ratio=toks / secs / serial)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=192)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--v-ms", type=float, default=5.1, help="the verify part of a step")
    ap.add_argument("--d-ms", type=float, default=2.2, help="its drafting")
    ap.add_argument("--out", default="predraft_quality.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    target, draft = load()
    tok = Tokenizer.from_dir(DEMO_TARGET)
    novel = novel_ids(tok, args.ctx * args.prompts)
    texts = {"predictable": [predictable_ids(tok, args.ctx + 3 * i)[3 * i:]
                             for i in range(args.prompts)],
             "novel": [novel[i * args.ctx:(i + 1) * args.ctx] for i in range(args.prompts)]}
    out = dict(args=vars(args), texts={})
    for name, prompts in texts.items():
        steps = []
        for p in prompts:
            seq, hidden = continuation(target, p, args.new)
            steps += walk(target, draft, seq, hidden, len(p))
        rows = [s for s in steps if "ahead" in s]
        summary = dict(steps=len(rows),
                       serial_accepted=statistics.mean(s["serial"] for s in rows),
                       ahead_accepted=statistics.mean(s["ahead"] for s in rows),
                       gap_accepted=statistics.mean(s["gap"] for s in rows),
                       **{f"hit@{m}": price(steps, m, args.v_ms, args.d_ms) for m in HITS})
        out["texts"][name] = dict(summary=summary, steps=steps)
        hits = ", ".join(f"@{m} {summary[f'hit@{m}']['hit_rate']:.2f} -> "
                         f"{summary[f'hit@{m}']['ratio']:.3f} x" for m in HITS)
        print(f"{name:12s} {len(rows)} steps: accepted serial {summary['serial_accepted']:.2f}, "
              f"ahead (outcome right) {summary['ahead_accepted']:.2f}, "
              f"bonus only {summary['gap_accepted']:.2f}; hit, tok/s over "
              f"serial: {hits}", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
