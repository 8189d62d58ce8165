"""A checkpoint load puts every tensor it keeps where the run needs it (issue 13, fix 2): Adam
moments on the device and in the dtype of the tensor they belong to, the step count where
torch's AdamW keeps it. Checked on the `meta` device on a CPU (a tensor left on the host
shows up as such), and as save -> load -> step, bit-exact, on each available device. RNG
states written on another kind of device (issue #39) leave the device's generators as
seeded."""

import pytest
import torch
import torch.distributed as dist

from megalite.arguments import parse_args
from megalite.checkpointing import load_checkpoint, save_checkpoint
from megalite.checkpointing.saving import rng_file
from megalite.checkpointing.state import CheckpointState
from megalite.checkpointing.storage import load_tensor_file, save_tensor_file
from megalite.validation import validate_args
from megalite.optimizer.lr_scheduler import LRScheduler
from megalite.parallel_state import ParallelState, RankGrid
from megalite.tensor_parallel.random import build_rng_tracker
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


def save(config, state, built, iteration, rng_tracker=None):
    model, optimizer, _, scheduler = built
    save_checkpoint(config.checkpoint.save, iteration,
                    CheckpointState(model, optimizer, scheduler, state, config,
                                    rng_tracker=rng_tracker))


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
    load_checkpoint(config.checkpoint.load,
                    CheckpointState(model, loaded, scheduler, state, config))
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
    load_checkpoint(config.checkpoint.load,
                    CheckpointState(model, optimizer, scheduler, state, config))
    train(config, state, device, resumed, 1, seed=1)
    for a, b in zip(straight[0].parameters(), resumed[0].parameters()):
        assert a.device.type == device and torch.equal(a, b)
    for a, b in zip(straight[1].segments, optimizer.segments):
        assert torch.equal(a.main, b.main)
        for key, value in straight[1].adam.state[a.main].items():
            assert torch.equal(value, optimizer.adam.state[b.main][key]), key


def test_rng_states_of_another_device_kind_resume_as_seeded(tmp_path, state, capsys):
    """A checkpoint whose RNG file was written on another kind of device (a CUDA one,
    faked: its generator states are Philox's 16 bytes, where the CPU's are 5056) resumes
    (issue #39: a CPU checkpoint resumed on a GPU stopped in torch.cuda.set_rng_state):
    the host generator is restored, the device's and the tensor-parallel tracker's stay
    as seeded, and the run says so."""
    config = make_config(tmp_path, "fp32 Adam")
    built = build(config, state, "cpu")
    train(config, state, "cpu", built, 1, seed=0)
    save(config, state, built, 1, build_rng_tracker(1, 0, "cpu"))
    path = tmp_path / "iter_0000001" / rng_file(0)
    record = load_tensor_file(path)
    philox = torch.arange(16, dtype=torch.uint8)
    record.update(device="cuda", cuda=philox,
                  tracker={name: philox for name in record["tracker"]})
    save_tensor_file(record, path)
    torch.manual_seed(7)
    tracker, seeded = build_rng_tracker(1, 0, "cpu"), build_rng_tracker(1, 0, "cpu")
    model, optimizer, _, scheduler = build(config, state, "cpu")
    load_checkpoint(config.checkpoint.load, CheckpointState(model, optimizer, scheduler, state,
                                                            config, rng_tracker=tracker))
    assert torch.equal(torch.get_rng_state(), record["torch"])
    draws = []
    for t in (tracker, seeded):
        with t.fork():
            draws.append(torch.rand(8))
    assert torch.equal(*draws)
    assert "RNG states saved on cuda, running on cpu" in capsys.readouterr().out
