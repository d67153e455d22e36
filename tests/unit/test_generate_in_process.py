"""`specserve generate --in-process --json`: an engine in the CLI's process; its tokens are
transformers' greedy ones, and the JSON carries usage, TTFT and wall time."""

from __future__ import annotations

import json

from services.cli import main
from tests.helpers import hf_greedy, make_checkpoint


def test_in_process_json_is_transformers_greedy(tmp_path, capsys):
    path, model = make_checkpoint(tmp_path / "m", "qwen3-gqa4-yarn", seed=3)
    prompt = [17, 4, 99, 150, 3, 61, 8]
    assert main(["generate", "--in-process", "--model", str(path), "--json", "--ignore-eos",
                 "--max-tokens", "9", "--temperature", "0", "--token-ids",
                 ",".join(map(str, prompt))]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == hf_greedy(model, prompt, 9)
    assert out["usage"] == {"prompt_tokens": 7, "completion_tokens": 9}
    assert out["finish_reason"] == "length" and 0 < out["ttft_s"] <= out["wall_s"]
