"""Load HF-format checkpoints: config.json + model.safetensors or a sharded safetensors index.

Owns reading tensors by name (all of them, or only some — the drafter takes only the target's
embedding and LM head) and the strict checks that turn a wrong checkpoint into a clear
`ModelError` (missing tensor, wrong shape) instead of a silent half-loaded model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from specserve.errors import ModelError
from specserve.models.config import load_config
from specserve.models.decoder import DecoderModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def tensor_files(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the safetensors file holding it."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    single = root / "model.safetensors"
    if not single.exists():
        raise ModelError(f"no model.safetensors or model.safetensors.index.json in {root}")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def read_tensors(
    model_dir: str | Path, names: Iterable[str], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Read only `names` from a checkpoint (ModelError naming any that are absent)."""
    files = tensor_files(model_dir)
    names = list(names)
    missing = [n for n in names if n not in files]
    if missing:
        raise ModelError(f"checkpoint {model_dir} lacks tensors: {missing[:8]}")
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(files[n], []).append(n)
    for path, group in by_file.items():
        with safe_open(path, framework="pt") as f:
            for n in group:
                t = f.get_tensor(n)
                out[n] = t.to(dtype) if dtype is not None else t
    return out


def _refuse_unconsumed(model_dir, params, tied: bool) -> None:
    """A tensor this model would not read (a bias of a kind it does not build, say) is an
    error, not something to drop: only rotary `inv_freq` buffers (recomputed) and a tied
    checkpoint's copy of the LM head may be left."""
    ignorable = ("lm_head.weight",) if tied else ()
    extra = sorted(n for n in tensor_files(model_dir) if n not in params
                   and n not in ignorable and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ModelError(f"checkpoint {model_dir} has tensors this model does not use "
                         f"(unsupported layout or config): {extra[:8]}"
                         + (f" and {len(extra) - 8} more" if len(extra) > 8 else ""))


def load_model(
    model_dir: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu"
) -> DecoderModel:
    """Build a `DecoderModel` from an HF directory and load every parameter strictly."""
    cfg = load_config(model_dir)
    dtype = resolve_dtype(dtype)
    with torch.device("meta"):
        model = DecoderModel(cfg)
    params = dict(model.named_parameters())
    if cfg.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    _refuse_unconsumed(model_dir, params, cfg.tie_word_embeddings)
    tensors = read_tensors(model_dir, params, dtype)
    for name, p in params.items():
        if tuple(tensors[name].shape) != tuple(p.shape):
            raise ModelError(
                f"tensor {name} has shape {tuple(tensors[name].shape)}, expected {tuple(p.shape)}"
            )
    model.load_state_dict(tensors, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = type(model.rotary)(cfg.rope, cfg.head_dim)  # rebuild the buffer off meta
    return model.to(device).eval()
