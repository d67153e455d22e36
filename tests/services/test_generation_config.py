"""A checkpoint whose generation_config.json asks for a setting specserve does not implement:
the gateway and the verifier refuse to start, one line naming it and `--generation-config
none`, exit 2 (what "none" loads: tests/unit/test_loader_errors.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from specserve.demo import default_pair

TARGET, _ = default_pair()
pytestmark = pytest.mark.skipif(TARGET is None, reason="the demo pair is not checked out")


@pytest.fixture
def penalised(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(TARGET, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_k": 20, "repetition_penalty": 1.05}))
    return model


@pytest.mark.parametrize("service", ["gateway", "verifier"])
def test_a_service_refuses_a_setting_it_does_not_implement(penalised, service):
    extra = ["--http-port", "off"] if service == "gateway" else ["--device", "cpu"]
    done = subprocess.run([sys.executable, "-m", "services.cli", "serve", service, "--model",
                           str(penalised), "--port", "0", "--metrics-port", "0", *extra],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GRPC_VERBOSITY": "ERROR"})
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr
    assert last.startswith(f"specserve {service}: error: ") and "repetition_penalty=1.05" in last
    assert "--generation-config none" in last and "Traceback" not in done.stderr
