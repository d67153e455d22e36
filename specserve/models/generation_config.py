"""What `generation_config.json` gives the requests that leave sampling unset.

Owns `GenerationDefaults` (temperature / top_p / top_k, as transformers' `generate` reads them),
`load_generation_defaults` — `--generation-config auto` uses the file, `none` does not — and the
check that refuses a file asking for a setting specserve does not implement (a penalty, `min_p`,
beams, …), which serving would otherwise drop in silence. The file's EOS ids are the model
config's (`config.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specserve.config import check_choice
from specserve.errors import ModelError


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request that leaves sampling unset gets, as transformers' `generate` reads
    `generation_config.json`: its temperature / top_p / top_k when `do_sample`, else greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")


# generation_config.json settings transformers' `generate` applies that specserve does not
# implement, with the value that does nothing (numbers compare by value; None, [] and {}
# always do nothing)
NOT_IMPLEMENTED = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0,
                   "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "min_p": 0.0,
                   "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None,
                   "bad_words_ids": None, "suppress_tokens": None,
                   "begin_suppress_tokens": None, "sequence_bias": None,
                   "forced_bos_token_id": None, "forced_eos_token_id": None, "min_length": 0,
                   "min_new_tokens": 0, "num_beams": 1, "num_beam_groups": 1,
                   "diversity_penalty": 0.0, "penalty_alpha": 0.0,
                   "exponential_decay_length_penalty": None, "guidance_scale": 1.0,
                   "dola_layers": None, "watermarking_config": None}
GENERATION_CONFIG = ("auto", "none")  # --generation-config: the file's sampling, or none


def _not_implemented(raw: dict) -> list[str]:
    """`raw`'s settings specserve does not implement that are not their neutral value."""
    def neutral(value, none) -> bool:
        if value is None or value in ([], {}):
            return True
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        return numeric and none is not None and float(value) == float(none)

    return [f"{k}={json.dumps(raw[k])[:40]}" for k, none in NOT_IMPLEMENTED.items()
            if k in raw and not neutral(raw[k], none)]


def load_generation_defaults(model_dir: str | Path, use: str = "auto") -> GenerationDefaults:
    """What requests that leave sampling unset get: `generation_config.json`'s (`use` "auto")
    or greedy ("none": the file's sampling settings are not used; its EOS ids still are).
    ModelError when the file asks for a setting specserve does not implement — serving it
    would silently differ from the model's configured generation."""
    check_choice("generation_config", use, GENERATION_CONFIG)
    path = Path(model_dir) / "generation_config.json"
    if use == "none" or not path.exists():
        return GenerationDefaults()
    try:
        raw = json.loads(path.read_text())
        if unsupported := _not_implemented(raw):
            raise ModelError(
                f"{path} sets {', '.join(unsupported)}: not implemented by specserve; serve "
                "the model without the file's sampling settings with --generation-config none "
                "(SPECSERVE_GENERATION_CONFIG=none), or remove them from the file")
        if not raw.get("do_sample", False):
            return GenerationDefaults()
        top_k = raw.get("top_k", 50)  # transformers' GenerationConfig default
        return GenerationDefaults(float(raw.get("temperature", 1.0)),
                                  float(raw.get("top_p", 1.0)),
                                  int(top_k) if top_k and int(top_k) > 0 else None)
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ModelError(f"{path} is not valid: {e}") from None
