"""Turning target logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

`probs_for` gives the exact distribution a request samples from (the χ² tests compare against
it); `sample_rows` draws from it with the request's own generator, so a request's samples do not
depend on what else is in the batch.
"""

from __future__ import annotations

import os

import torch

from specserve.types import SamplingParams, TokenLogprob


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The request's private RNG (None for greedy requests, which need none)."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    return torch.Generator(device=device).manual_seed(seed)


def probs_for(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution `[..., V]` float32 of a non-greedy request from `logits [..., V]`.

    The row max is subtracted before dividing by the temperature: the top score is exactly 0,
    so no temperature, however small, overflows (the rest may go to -inf: probability 0)."""
    scores = logits.float()
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / params.temperature
    vocab = scores.shape[-1]
    if params.top_k is not None and params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_rows(
    logits: torch.Tensor,  # [N, V]
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """One token per row of `logits` for one request (argmax when greedy)."""
    if params.greedy:
        return logits.argmax(dim=-1).tolist()
    probs = probs_for(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).tolist()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's log-probability under the row of `logits` [len(tokens), V] that chose it
    (raw logits' log-softmax, in float32), with the `top` most likely tokens'."""
    logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # [k, V]
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    if top == 0:
        return [TokenLogprob(lp) for lp in chosen]
    values, ids = logp.topk(top, dim=-1)  # [k, top]
    return [TokenLogprob(lp, tuple(i), tuple(v))
            for lp, i, v in zip(chosen, ids.tolist(), values.tolist(), strict=True)]
