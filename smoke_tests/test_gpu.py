"""The gpu tier: Paddle's own check, a few training steps on the GPU, and an all-reduce over
NCCL across two GPUs where the host has them.

Every test here is gated by the `gpu_count` fixture (imagebuild_smoke.py): on a host without a
GPU it is skipped with the reason, e.g. "no GPU visible: paddle.device.cuda.device_count() == 0".
On a GPU host `imagebuild test` requests the GPUs (`--gpus all` through the SDK) and the same
tests run unchanged.
"""
from __future__ import annotations

import pytest
from smoke_lib import all_reduce_rank_plus_one, assert_learns, train

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(180)  # the first CUDA calls may compile kernels for this GPU
def test_paddle_run_check(paddle, gpu_count, capsys):
    paddle.utils.run_check()
    out = capsys.readouterr().out
    # run_check reports problems on stdout in some versions instead of raising.
    assert "installed successfully" in out, f"paddle.utils.run_check() did not succeed:\n{out}"


@pytest.mark.timeout(180)
def test_training_steps_on_the_gpu_learn(paddle, gpu_count):
    # A convolution and a linear layer: cuDNN and cuBLAS both do real work.
    losses = train(paddle, "gpu:0", steps=10, conv=True)
    assert paddle.device.get_device().startswith("gpu"), paddle.device.get_device()
    assert_learns(losses)


@pytest.mark.timeout(300)
def test_an_all_reduce_over_nccl_across_two_gpus_sums(paddle, gpu_count):
    """Two processes, one GPU each: what multi-GPU training does on every step, over NCCL."""
    if gpu_count < 2:
        pytest.skip(f"needs 2 GPUs for a two-process all-reduce, Paddle sees {gpu_count}")
    import paddle.distributed as dist

    # spawn starts fresh interpreters (CUDA does not survive a fork); each returns its result.
    context = dist.spawn(all_reduce_rank_plus_one, nprocs=2, gpus="0,1")
    results = sorted(queue.get() for queue in context.return_queues)
    assert results == [(0, 2, 3.0), (1, 2, 3.0)], f"(rank, world size, sum) per process: {results}"
