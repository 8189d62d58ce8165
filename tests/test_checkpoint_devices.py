"""A checkpoint load puts every tensor it keeps where the run needs it (issue 13, fix 2): Adam
moments on the device and in the dtype of the tensor they belong to, the step count where
torch's AdamW keeps it. Checked on the `meta` device on a CPU (a tensor left on the host
shows up as such), and as save -> load -> step, bit-exact, on each available device."""

import types

import pytest
import torch
import torch.distributed as dist

from megalite.arguments import parse_args
from megalite.checkpointing import load_checkpoint, save_checkpoint
from megalite.validation import validate_args
from megalite.optimizer.lr_scheduler import LRScheduler
from megalite.parallel_state import ParallelState, RankGrid
from megalite.train_step import StepRunner
from megalite.training import build_model, build_optimizer

from tests.helpers import flags_with

FLAGS = flags_with("--attention-dropout", "0", "--hidden-dropout", "0", vocab_size=61,
                   make_vocab_size_divisible_by=None, hidden_size=32, seq_length=16,
                   micro_batch_size=2, global_batch_size=2, train_iters=4, lr="3e-3")
KINDS = {"fp32 Adam": [], "bf16 ZeRO-1": ["--bf16", "--use-distributed-optimizer"]}
# On a GPU the default path compiles each layer (config.compile_by_default), and inductor
# starts its compile workers: processes, so slow.
DEVICES = [pytest.param("cpu"),
           pytest.param("cuda", marks=[pytest.mark.skipif(not torch.cuda.is_available(),
                                                          reason="needs a CUDA GPU"),
                                       pytest.mark.slow])]


@pytest.fixture
def state():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield ParallelState(RankGrid(1), 0)
    dist.destroy_process_group()


def make_config(save, kind):
    return validate_args(parse_args(FLAGS + KINDS[kind] + ["--save", str(save),
                                                           "--load", str(save)]))


def build(config, state, device):
    model = build_model(config, state, torch.device(device), None)
    optimizer, grad_buffer = build_optimizer(model, config, state)
    return model, optimizer, grad_buffer, LRScheduler(optimizer, config.scheduler)


def train(config, state, device, built, steps, seed):
    model, optimizer, grad_buffer, scheduler = built
    m, t = config.model, config.training
    runner = StepRunner(model, optimizer, config, state, torch.device(device), grad_buffer)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_length + 1),
                               generator=g).to(device)
        runner.train_step([{"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                            "loss_mask": torch.ones(tokens[:, 1:].shape, device=device)}])
        scheduler.step(t.global_batch_size)


def save(config, state, built, iteration):
    model, optimizer, _, scheduler = built
    progress = types.SimpleNamespace(consumed_train_samples=0, consumed_valid_samples=0)
    save_checkpoint(config.checkpoint.save, iteration, model, optimizer, scheduler, state,
                    config, progress)


@pytest.mark.parametrize("kind", KINDS)
def test_loaded_adam_state_lies_where_torch_puts_it(tmp_path, state, kind):
    config = make_config(tmp_path, kind)
    trained = build(config, state, "cpu")
    train(config, state, "cpu", trained, 1, seed=0)
    save(config, state, trained, 1)
    # Reference: the state torch's AdamW itself creates for a model on the meta device.
    _, reference, _, _ = build(config, state, "meta")
    for s in reference.segments:
        s.main.grad = torch.zeros_like(s.main)
    reference.adam.step()
    model, loaded, _, scheduler = build(config, state, "meta")
    load_checkpoint(config.checkpoint.load, model, loaded, scheduler, state, config)
    assert len(loaded.segments) == len(reference.segments) > 0
    for s, r in zip(loaded.segments, reference.segments):
        got, want = loaded.adam.state[s.main], reference.adam.state[r.main]
        assert got.keys() == want.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in want:
            assert (got[key].device, got[key].dtype, got[key].shape) == \
                (want[key].device, want[key].dtype, want[key].shape), key
        assert s.main.device.type == s.param.device.type == "meta"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("device", DEVICES)
def test_save_load_step_is_bit_exact(tmp_path, state, kind, device):
    """Two steps straight equal one step, save, load into a fresh model, one more step."""
    config = make_config(tmp_path, kind)
    straight = build(config, state, device)
    train(config, state, device, straight, 1, seed=0)
    save(config, state, straight, 1)
    train(config, state, device, straight, 1, seed=1)
    resumed = build(config, state, device)
    model, optimizer, _, scheduler = resumed
    load_checkpoint(config.checkpoint.load, model, optimizer, scheduler, state, config)
    train(config, state, device, resumed, 1, seed=1)
    for a, b in zip(straight[0].parameters(), resumed[0].parameters()):
        assert a.device.type == device and torch.equal(a, b)
    for a, b in zip(straight[1].segments, optimizer.segments):
        assert torch.equal(a.main, b.main)
        for key, value in straight[1].adam.state[a.main].items():
            assert torch.equal(value, optimizer.adam.state[b.main][key]), key
