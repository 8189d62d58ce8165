"""What several test modules share, in one importable module (not a conftest: distributed
workers run in spawned processes that import functions by module name, and test modules
should not import each other).

    from tests.helpers import BASE_FLAGS, LLAMA_STYLE, flags_with, tiny_gpt_config, without

- tiny_gpt_config / LLAMA_STYLE: the model configs tests build;
- BASE_FLAGS / flags_with / without: the command line tests start from, that line with
  some values changed, and removing a flag by name;
- scalars / checkpoint_tensors / assert_identical: comparing two runs' records bit for bit;
- gather_tensor_parallel: a TP-sharded tensor made whole again with plain all_gather.
"""

import torch
import torch.distributed as dist

from megalite.checkpointing.storage import find_checkpoint_to_load, load_tensor_file
from megalite.config import (CheckpointConfig, Config, DistributedConfig, GPTConfig,
                             LoggingConfig, ParallelConfig, PrecisionConfig, TrainingConfig)
from megalite.tensor_parallel.params import is_embedding_copy, partition_dim, partition_stride

# ------------------------------------------------------------------------------ configs

# RoPE, RMSNorm, SwiGLU, no biases, untied output; the defaults of GPTConfig are GPT-2's
# (learned positions, LayerNorm, GeLU, biases, tied output).
LLAMA_STYLE = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                   add_bias_linear=False, untie_embeddings_and_output_weights=True)


def tiny_gpt_config(**overrides) -> GPTConfig:
    """A GPT-2-style model small enough for CPU tests: 2 layers, hidden 32, FFN 64, 4 heads
    of 8 channels, sequence 8, 64 vocabulary rows, no dropout. Unless overridden,
    num_query_groups follows num_attention_heads (no GQA) and max_position_embeddings
    follows seq_length; every other field is GPTConfig's default."""
    fields = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                  kv_channels=8, seq_length=8, padded_vocab_size=64, attention_dropout=0.0,
                  hidden_dropout=0.0)
    fields.update(overrides)
    fields.setdefault("num_query_groups", fields["num_attention_heads"])
    fields.setdefault("max_position_embeddings", fields["seq_length"])
    return GPTConfig(**fields)


def step_config(model: GPTConfig, micro_batch_size: int, num_microbatches: int = 1,
                precision: PrecisionConfig = PrecisionConfig(), check_for_nan: bool = False,
                **parallel) -> Config:
    """What a StepRunner reads of a run, around a hand-built model: `num_microbatches` per
    DP rank of `micro_batch_size` sequences, `parallel` ParallelConfig's --pipeline-schedule
    and FSDP2 fields (its sizes are the ParallelState's), no NaN check unless asked."""
    return Config(model=model, parallel=ParallelConfig(**parallel),
                  training=TrainingConfig(micro_batch_size=micro_batch_size,
                                          global_batch_size=micro_batch_size * num_microbatches,
                                          num_microbatches=num_microbatches),
                  precision=precision, logging=LoggingConfig(), distributed=DistributedConfig(),
                  checkpoint=CheckpointConfig(check_for_nan=check_for_nan))


# -------------------------------------------------------------------------------- flags

# A small valid command line every flag test starts from.
BASE_FLAGS = [
    "--mock-data", "--vocab-size", "64", "--make-vocab-size-divisible-by", "64",
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
    "--train-iters", "10", "--lr", "1e-3",
]


def flags_with(*extra: str, **values) -> list[str]:
    """BASE_FLAGS with each of `values` set (hidden_size=32: "--hidden-size 32"; None drops
    the flag), then `extra`: a test's command line written as its difference from
    BASE_FLAGS."""
    flags = list(BASE_FLAGS)
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        flags = without(flags, flag) + ([] if value is None else [flag, str(value)])
    return [*flags, *extra]


def without(flags: list[str], *names: str) -> list[str]:
    """`flags` less each flag in `names` and its values (the tokens after it up to the
    next "--"), so a value shared by another flag stays."""
    kept, dropping = [], False
    for token in flags:
        if token.startswith("--"):
            dropping = token in names
        if not dropping:
            kept.append(token)
    return kept


# ---------------------------------------------------------------------------- run records

def scalars(tensorboard_dir) -> dict[str, dict[int, float]]:
    """Every step's float32 lm loss and grad norm, as TensorBoard recorded them."""
    # Imported here: TensorBoard takes a second to import, and most tests never read events.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tensorboard_dir))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)}
            for tag in ("lm loss", "grad-norm")}


def checkpoint_tensors(save) -> dict[str, object]:
    """Every value of every file of the newest checkpoint, by file and key path."""
    _, directory = find_checkpoint_to_load(save)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{prefix}/{i}", item)
        else:
            flat[prefix] = value
    for path in sorted(directory.glob("*.pt")):
        walk(path.name, load_tensor_file(path))
    return flat


def assert_identical(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


# ------------------------------------------------------------------------ tensor parallel

def gather_tensor_parallel(tensor, param, group) -> torch.Tensor:
    """The full tensor of a TP-sharded parameter's `tensor` (its value or grad), gathered
    with plain dist.all_gather; replicated parameters are returned as they are. A stacked
    parameter (SwiGLU's fc1, [gate; up]) holds a block of each part on every rank: the
    full tensor is all ranks' gate blocks, then all ranks' up blocks."""
    if partition_dim(param) is None or dist.get_world_size(group) == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    dim, stride = partition_dim(param), partition_stride(param)
    blocks = [part.chunk(stride, dim=dim) for part in parts]
    return torch.cat([b[i] for i in range(stride) for b in blocks], dim=dim)


# ------------------------------------------------------------ layouts against one process

def reference_name(name: str, param) -> str:
    """A chunk parameter's name ("<chunk>.<name>") in the single-process model; a tied
    output layer on the last stage is a copy of the word embeddings."""
    name = name.split(".", 1)[1]
    return "embedding.word_embeddings.weight" if is_embedding_copy(param) else name


def step_problems(steps, ref_steps, last_stage: bool) -> list[str]:
    """Per-step (loss, grad norm) against the single-process run's, to 1e-5 relative; the
    loss only where it is computed, on the last pipeline stage."""
    problems = []
    for i, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(steps, ref_steps), start=1):
        if (last_stage and abs(loss - ref_loss) > 1e-5 * ref_loss) or \
                abs(norm - ref_norm) > 1e-5 * ref_norm:
            problems.append(f"step {i}: loss {loss} vs {ref_loss}, norm {norm} vs {ref_norm}")
    return problems


def tensor_problem(what: str, mine, param, expected, tp_group, atol: float) -> list[str]:
    """`mine` (a value or grad of `param`, TP-gathered here) against the single-process
    tensor, to rtol 1e-4 and `atol`; vocabulary padding rows (which differ with TP) are
    left out."""
    full = gather_tensor_parallel(mine, param, tp_group)
    rows = min(full.shape[0], expected.shape[0])
    if torch.allclose(full[:rows], expected[:rows], rtol=1e-4, atol=atol):
        return []
    return [f"{what}: max diff {(full[:rows] - expected[:rows]).abs().max().item():.3g}"]


def random_batches(generator, vocab: int, micro: int, seq: int, num_micro: int,
                   state=None) -> list[dict]:
    """A global batch of `num_micro` random micro-batches (tokens, labels, a loss mask that
    drops about a fifth), drawn in the same order whatever the layout; under `state` its
    DP rank's contiguous slice of them."""
    batches = [{"tokens": torch.randint(0, vocab, (micro, seq), generator=generator),
                "labels": torch.randint(0, vocab, (micro, seq), generator=generator),
                "loss_mask": (torch.rand(micro, seq, generator=generator) > 0.2).float()}
               for _ in range(num_micro)]
    if state is None:
        return batches
    per_rank = num_micro // state.dp_size
    return batches[state.dp_rank * per_rank:(state.dp_rank + 1) * per_rank]
