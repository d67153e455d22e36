"""--threads (services/common/device.py): what it accepts, and the count each setting gives.

On the CPU `auto` gives a process beside a drafter service (the drafter, a verifier with one)
half the cores it may use (at least one) and the verifier a `StepThreads` that takes them all
for steps carrying prompt tokens; a verifier without a drafter gets all of them; on CUDA
torch's own count stays; a number is taken as given. Bad values are a ValueError from the
configs.
"""

from __future__ import annotations

import pytest
import torch

from services.common import device
from services.common.device import apply_threads, check_threads
from services.drafter.config import DrafterConfig
from services.verifier.config import VerifierConfig


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("value", ["auto", "1", "3", "17"])
def test_check_threads_takes_auto_and_positive_counts(value):
    check_threads(value)


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "two", ""])
def test_check_threads_refuses_the_rest(value):
    with pytest.raises(ValueError, match="threads must be auto or a positive integer"):
        check_threads(value)


@pytest.mark.parametrize("config", [lambda t: VerifierConfig(model="m", threads=t),
                                    lambda t: DrafterConfig(threads=t)])
def test_configs_check_threads(config):
    assert config("3").threads == "3"
    with pytest.raises(ValueError, match="threads must be"):
        config("0")


@pytest.fixture
def six_cores(monkeypatch):
    monkeypatch.setattr(device.os, "sched_getaffinity", lambda pid: set(range(6)))


def test_auto_on_the_cpu_beside_a_drafter_gives_half_and_all_for_prefill(six_cores):
    torch.set_num_threads(5)
    step = apply_threads("auto", "cpu", shared=True, by_step=True)
    assert torch.get_num_threads() == 3
    assert (step.prefill, step.decode) == (6, 3)
    step.use(prefill=True)
    assert torch.get_num_threads() == 6
    step.use(prefill=False)
    assert torch.get_num_threads() == 3


def test_use_sets_the_count_only_when_it_changes(six_cores, monkeypatch):
    step, calls = apply_threads("auto", "cpu", shared=True, by_step=True), []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    for prefill in (False, False, True, True, False):
        step.use(prefill)
    assert calls == [3, 6, 3]


def test_the_drafter_s_half_does_not_follow_steps(six_cores):
    torch.set_num_threads(5)
    assert apply_threads("auto", "cpu", shared=True) is None
    assert torch.get_num_threads() == 3


def test_auto_on_the_cpu_alone_takes_every_core(six_cores):
    torch.set_num_threads(2)
    assert apply_threads("auto", "cpu", shared=False, by_step=True) is None
    assert torch.get_num_threads() == 6


def test_one_core_is_never_halved(monkeypatch):
    monkeypatch.setattr(device.os, "sched_getaffinity", lambda pid: {0})
    torch.set_num_threads(2)
    assert apply_threads("auto", "cpu", shared=True, by_step=True) is None
    assert torch.get_num_threads() == 1


def test_auto_on_cuda_keeps_torch_s_count():
    torch.set_num_threads(3)
    assert apply_threads("auto", "cuda:0", shared=True, by_step=True) is None
    assert torch.get_num_threads() == 3


@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_a_number_is_taken_as_given(where, six_cores):
    torch.set_num_threads(1)
    assert apply_threads("2", where, shared=True, by_step=True) is None
    assert torch.get_num_threads() == 2


def test_a_cuda_device_this_machine_lacks_is_a_value_error(monkeypatch):
    """SPECSERVE_DEVICE=cuda (docker-compose.yml's) on a host without a GPU: the service's
    one-line error (a ValueError), not torch's 'not compiled with CUDA' traceback."""
    import torch

    from services.common.device import check_device, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(ValueError, match=f"--device {name} .*no CUDA device"):
            resolve_device(name)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match="has 2 CUDA device"):
        resolve_device("cuda:2")
    for bad in ("cuda:x", "cuda:", "gpu", "cpu:0"):
        with pytest.raises(ValueError, match="device must be auto, cpu or cuda"):
            check_device(bad)
