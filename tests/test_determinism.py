"""``train.deterministic`` (issue 25 item 7): :func:`kuangchao_core.hal.determinism.enable_determinism` sets what
deterministic training needs, given an environment dict, so each device's branch runs here on CPU:

- on CUDA it sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` when unset, keeps a deterministic value already set, warns
  (naming the value and the valid ones) about one that is not, and turns cuDNN's determinism on and its autotuner
  off; it logs once what it set;
- on CPU it only turns on ``torch.use_deterministic_algorithms`` (warn only), as before, and leaves the environment
  alone;
- ``auto`` follows what torch sees (CPU here, unless the machine has a GPU).
"""

from __future__ import annotations

import logging

import pytest
import torch

from kuangchao_core.hal.determinism import CUBLAS_ENV, enable_determinism


@pytest.fixture
def torch_flags():
    """Restore torch's process-wide determinism flags after the test."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]


@pytest.fixture
def records():
    """Records of the determinism logger (its own handler: the ``kuangchao`` tree may not propagate)."""
    logger = logging.getLogger("kuangchao.hal.determinism")
    seen: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = seen.append
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def test_cuda_sets_the_cublas_workspace_and_cudnn_flags_and_says_so_once(torch_flags, records):
    env = {"PATH": "/bin"}
    done = enable_determinism("cuda", env)
    assert env == {"PATH": "/bin", CUBLAS_ENV: ":4096:8"}
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic is True and torch.backends.cudnn.benchmark is False
    assert done[CUBLAS_ENV] == ":4096:8" and done["cublas_set_here"] is True
    assert [r.levelno for r in records] == [logging.INFO]
    assert ":4096:8" in records[0].getMessage() and "cudnn.benchmark" in records[0].getMessage()


@pytest.mark.parametrize("value", [":16:8", ":4096:8"])
def test_cuda_keeps_a_deterministic_workspace_already_set(torch_flags, records, value):
    env = {CUBLAS_ENV: value}
    done = enable_determinism("rocm", env)
    assert env == {CUBLAS_ENV: value} and done["cublas_set_here"] is False
    assert torch.backends.cudnn.deterministic is True
    assert not [r for r in records if r.levelno >= logging.WARNING]


def test_cuda_warns_about_a_workspace_that_is_not_deterministic_and_keeps_it(torch_flags, records):
    env = {CUBLAS_ENV: ":0:0"}
    enable_determinism("cuda", env)
    assert env == {CUBLAS_ENV: ":0:0"}  # the user's choice stays; the warning says what to do
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "':0:0'" in warnings[0] and "':4096:8'" in warnings[0] and "':16:8'" in warnings[0]
    assert torch.backends.cudnn.deterministic is True and torch.backends.cudnn.benchmark is False


def test_cpu_only_turns_on_deterministic_algorithms(torch_flags, records):
    env: dict[str, str] = {}
    done = enable_determinism("cpu", env)
    assert env == {} and done == {"use_deterministic_algorithms": "warn_only"}
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic is False and torch.backends.cudnn.benchmark is True  # untouched
    assert len(records) == 1


def test_auto_follows_what_torch_sees(torch_flags):
    env: dict[str, str] = {}
    enable_determinism("auto", env)
    assert (CUBLAS_ENV in env) == torch.cuda.is_available()
