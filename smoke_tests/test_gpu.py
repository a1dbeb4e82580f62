"""The gpu tier: Paddle's own check and a few training steps on the GPU.

Every test here is gated by the `gpu_count` fixture (imagebuild_smoke.py): on a host without a
GPU it is skipped with the reason, e.g. "no GPU visible: paddle.device.cuda.device_count() == 0".
On a GPU host `imagebuild test` requests the GPUs (`--gpus all` through the SDK) and the same
tests run unchanged.
"""
from __future__ import annotations

import pytest

from smoke_lib import assert_learns, train

pytestmark = pytest.mark.gpu


def test_paddle_run_check(paddle, gpu_count, capsys):
    paddle.utils.run_check()
    out = capsys.readouterr().out
    # run_check reports problems on stdout in some versions instead of raising.
    assert "installed successfully" in out, f"paddle.utils.run_check() did not succeed:\n{out}"


def test_training_steps_on_the_gpu_learn(paddle, gpu_count):
    # A convolution and a linear layer: cuDNN and cuBLAS both do real work.
    losses = train(paddle, "gpu:0", steps=10, conv=True)
    assert paddle.device.get_device().startswith("gpu"), paddle.device.get_device()
    assert_learns(losses)
