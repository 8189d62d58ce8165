"""A MoE run resumes bit-exactly: the router's expert bias (a buffer, moved after every
step) is saved with the parameters and loaded back (checkpointing/saving.py
`state_buffers`), so 4 steps straight equal 2 steps, save, load, 2 steps. The bias moves
in the gradient finalisation, before the optimizer step --async-save's copies may wait
for: an asynchronous save holds the bias of the iteration it saves all the same."""

import torch

from megalite.training import pretrain

from tests.helpers import (assert_identical, assert_same_files, checkpoint_tensors, flags_with,
                           hold_first_snapshot)

FLAGS = flags_with("--disable-bias-linear", "--num-experts", "4", "--moe-ffn-hidden-size", "16",
                   "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                   "--moe-router-bias-update-rate", "0.01", "--moe-aux-loss-coeff", "0.01",
                   "--eval-iters", "0", "--num-workers", "0", "--hidden-dropout", "0.1",
                   hidden_size=32, seq_length=16, micro_batch_size=2, global_batch_size=4,
                   train_iters=2, lr="3e-3")


def test_resume_with_expert_bias_is_bit_exact(tmp_path, monkeypatch):
    """The straight run saves each step asynchronously, its first snapshot copied only
    when step 2's optimizer step is about to run (after step 2 moved the bias): its
    iteration 1 is byte for byte the synchronous save of the run that stops there."""
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    hold_first_snapshot(monkeypatch)
    assert pretrain([*FLAGS, "--save", str(straight), "--save-interval", "1",
                     "--async-save"]) == 0
    assert pretrain([*FLAGS, "--save", str(first), "--exit-interval", "1"]) == 0
    assert_same_files(first / "iter_0000001", straight / "iter_0000001")
    # After one update every bias is +-rate (0 only if the load were exactly even); a later
    # update may bring one back to 0, so the one the resume must restore is checked here.
    bias = [v for k, v in checkpoint_tensors(first).items()
            if k.endswith("mlp.router.expert_bias")]
    assert len(bias) == 2 and all(isinstance(b, torch.Tensor) and b.abs().sum() > 0
                                  for b in bias)
    assert pretrain([*FLAGS, "--save", str(resumed), "--load", str(first)]) == 0
    assert_identical(checkpoint_tensors(straight), checkpoint_tensors(resumed))
