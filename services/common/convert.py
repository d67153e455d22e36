"""Conversions of the shared wire types (common.proto) to and from core types.

The only place (with each service's own convert.py) that touches pb2 messages.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from specserve.drafters.registry import DFLASH, NGRAM, NONE
from specserve.errors import InvalidRequest
from specserve.models.loader import DTYPES as MODEL_DTYPES
from specserve.spec.metrics import RequestSpecStats
from specserve.types import FLOAT32_TINY, FinishReason, SamplingParams
from specserve.v1 import common_pb2 as pb

_DTYPES = MODEL_DTYPES  # the wire's tensor dtypes are the models'
_ITEM_BYTES = {name: dtype.itemsize for name, dtype in _DTYPES.items()}
MAX_TENSOR_RANK = 8  # context rows are [rows, width]: anything far beyond is malformed
_FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
DRAFTER_NAMES = {pb.DRAFTER_KIND_DFLASH: DFLASH, pb.DRAFTER_KIND_NGRAM: NGRAM,
                 pb.DRAFTER_KIND_NONE: NONE, pb.DRAFTER_KIND_UNSPECIFIED: None}
# a request's stop list: strings, UTF-8 bytes in all (the verifier's bounds, the gateway's default)
MAX_STOP_STRINGS, MAX_STOP_BYTES = 16, 4096


def sampling_from_pb(msg: pb.SamplingParams, defaults=None) -> SamplingParams:
    """Raises InvalidRequest for out-of-range values (SamplingParams validates). What the
    message leaves unset (temperature, top_k, top_p) comes from `defaults` (the model's
    GenerationDefaults), else greedy / no cut."""
    temperature = defaults.temperature if defaults is not None else 0.0
    top_k = defaults.top_k if defaults is not None else None
    top_p = defaults.top_p if defaults is not None else 1.0
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else temperature,
        top_k=(msg.top_k or None) if msg.HasField("top_k") else top_k,  # 0: no cut
        top_p=msg.top_p if msg.HasField("top_p") else top_p,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos, include_stop_str_in_output=msg.include_stop_str_in_output,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


def check_stop(stop: Sequence[str], max_strings: int = MAX_STOP_STRINGS,
               max_bytes: int = MAX_STOP_BYTES, flags: tuple[str, str] | None = None) -> None:
    """Raises InvalidRequest for more than `max_strings` stop strings or more than `max_bytes`
    UTF-8 bytes of them in all; `flags` names the settings of the two limits."""
    hint = [f" ({f})" for f in flags] if flags else ["", ""]
    if len(stop) > max_strings:
        raise InvalidRequest(f"{len(stop)} stop strings; at most {max_strings} are allowed"
                             f"{hint[0]}")
    size = sum(map(len, stop))  # characters: a lower bound of the size, no copy made
    exact = size <= max_bytes
    if exact:
        size = sum(len(s.encode()) for s in stop)
    if size > max_bytes:
        raise InvalidRequest(f"stop strings of {'' if exact else 'at least '}{size} bytes "
                             f"(UTF-8); at most {max_bytes} are allowed{hint[1]}")


def sampling_to_pb(p: SamplingParams) -> pb.SamplingParams:
    """Every sampling value explicit (top_k 0: no cut), so the receiver's defaults never
    apply; a client that wants the model's defaults clears temperature / top_k / top_p."""
    msg = pb.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature,
                            top_k=p.top_k or 0, top_p=max(p.top_p, FLOAT32_TINY),
                            stop_token_ids=list(p.stop_token_ids), stop=list(p.stop),
                            ignore_eos=p.ignore_eos,
                            include_stop_str_in_output=p.include_stop_str_in_output)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    return msg


def logprobs_to_pb(logprobs, into) -> None:
    """TokenLogprobs appended to `into` (a repeated TokenLogprob field); None: nothing."""
    for t in logprobs or ():
        into.add(logprob=t.logprob, top_ids=t.top_ids, top_logprobs=t.top_logprobs)


def finish_to_pb(reason: FinishReason | None) -> int:
    return _FINISH.get(reason, pb.FINISH_REASON_UNSPECIFIED)


def finish_from_pb(value: int) -> FinishReason | None:
    return next((r for r, v in _FINISH.items() if v == value), None)


def tensor_to_pb(t: torch.Tensor, into: pb.Tensor | None = None) -> pb.Tensor:
    """`t` as a Tensor message, written into `into` (a field of a message being built) when
    given: protobuf copies a submessage on CopyFrom or in a constructor, slowly (BENCHMARKS.md,
    "Context features on the drafter wire"), so large tensors are filled in place."""
    t = t.detach().contiguous().cpu()
    dtype = next(k for k, v in _DTYPES.items() if v == t.dtype)
    raw = t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t
    msg = pb.Tensor() if into is None else into
    msg.data, msg.dtype = raw.numpy().tobytes(), dtype
    msg.shape[:] = list(t.shape)
    return msg


def tensor_from_pb(msg: pb.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """The message's tensor, on `device` (default: the host). For a CUDA device the bytes go
    straight to it (one host copy fewer: a prefill chunk's context rows are 8-336 MB). Raises
    InvalidRequest, before any copy, for an unknown dtype, a rank over MAX_TENSOR_RANK, a
    negative dimension, sizes past int64 or a shape that does not describe the bytes."""
    data = msg.data  # upb hands out a new bytes object per access: take it once
    shape = _checked_shape(msg, len(data))
    dtype = _DTYPES[msg.dtype]
    arr = np.frombuffer(data, dtype=np.float32 if dtype == torch.float32 else np.int16)
    if device is not None and torch.device(device).type == "cuda":
        with warnings.catch_warnings():  # read-only bytes: read once by the copy to the device
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr).to(device)
    else:
        t = torch.from_numpy(arr.copy())
    t = t.view(shape)
    return t if dtype == torch.float32 else t.view(dtype)


def _checked_shape(msg: pb.Tensor, nbytes: int) -> tuple[int, ...]:
    """The message's shape, once it is known to describe `nbytes` of its dtype (in Python
    integers: no product overflows here)."""
    if msg.dtype not in _DTYPES:
        raise InvalidRequest(f"unsupported tensor dtype {msg.dtype[:40]!r} "
                             f"({', '.join(_DTYPES)})")
    shape, item = tuple(msg.shape), _ITEM_BYTES[msg.dtype]
    if len(shape) > MAX_TENSOR_RANK:
        raise InvalidRequest(f"tensor rank {len(shape)} is over {MAX_TENSOR_RANK}")
    if any(d < 0 for d in shape):
        raise InvalidRequest(f"tensor shape {list(shape)} has a negative dimension")
    if math.prod(max(d, 1) for d in shape) * item >= 1 << 63:  # bytes past int64 (0 dims too)
        raise InvalidRequest(f"tensor shape {list(shape)} is too large")
    if nbytes % item:
        raise InvalidRequest(f"tensor data of {nbytes} bytes is not a whole number of "
                             f"{msg.dtype} elements ({item} bytes each)")
    if math.prod(shape) != nbytes // item:
        raise InvalidRequest(f"tensor of shape {list(shape)} needs {math.prod(shape)} "
                             f"{msg.dtype} elements, its data holds {nbytes // item}")
    return shape


def spec_stats_to_pb(s: RequestSpecStats, other_s: float = 0.0) -> pb.SpecStats:
    return pb.SpecStats(
        steps=s.steps, draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens,
        committed_tokens=s.committed_tokens, mean_commit_len=s.mean_commit_len,
        commit_len_hist=dict(s.commit_len_hist),
        accepted_per_position=dict(s.accepted_per_position),
        fallbacks=dict(s.fallbacks), shapes=dict(s.shapes),
        phases=pb.PhaseTimes(prefill_s=s.prefill_s, draft_s=s.draft_s, verify_s=s.verify_s,
                             commit_s=s.commit_s, other_s=other_s),
        device=s.device,
    )
