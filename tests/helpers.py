"""What several test modules share, in one importable module (not a conftest: distributed
workers run in spawned processes that import functions by module name, and test modules
should not import each other).

    from tests.helpers import BASE_FLAGS, LLAMA_STYLE, flags_with, tiny_gpt_config, without

- tiny_gpt_config / LLAMA_STYLE: the model configs tests build;
- BASE_FLAGS / flags_with / without: the command line tests start from, that line with
  some values changed, and removing a flag by name;
- scalars / checkpoint_tensors / assert_identical: comparing two runs' records bit for bit;
- hold_first_snapshot: --async-save's first snapshot copied as late as it may be;
  saved_files / tensor_bytes: a checkpoint's files, and the bytes a snapshot copies of them;
  flip_a_bit_of_the_largest_record: a checkpoint file rotted where torch.load cannot tell;
- gather_tensor_parallel, reference_name, step_problems, tensor_problem: the layout
  comparisons, from megalite/layout_check.py (tools/check_cluster.py runs the same ones);
- random_batches: a layout's slice of a global batch;
- saved_activation_bytes, measured_chunk_bytes, planned_chunk_bytes: the saved-tensor
  bytes of a forward on the CPU, of each model chunk of a pipeline rank, and the memory
  planner's count of the same;
- load_tool / untracked: a tools/ script as a module, and the checkout's untracked files;
- download_objects / fault_proxy: a bucket's objects as files, by boto3 itself; and
  tests/s3_fault_proxy.py, a process in front of an S3 server that fails chosen requests.
"""

import contextlib
import importlib.util
import io
import json
import struct
import subprocess
import sys
import threading
import types
import zipfile
from pathlib import Path

import torch

from megalite import memory_estimate as me
from megalite.checkpointing.async_save import AsyncCheckpointer, HostBuffers
from megalite.checkpointing.storage import (checkpoint_values, find_checkpoint_to_load,
                                           load_tensor_file)
from megalite.config import (CheckpointConfig, Config, DistributedConfig, GPTConfig,
                             LoggingConfig, ParallelConfig, PrecisionConfig, TrainingConfig)
from megalite.network import free_port
# The layout comparisons live in the package, shared with tools/check_cluster.py.
from megalite.layout_check import (gather_tensor_parallel, reference_name,  # noqa: F401
                                   step_problems, tensor_problem)
from megalite.data.sampler import add_mtp_targets
from megalite.documents import starts_from_lengths
from megalite.model.mtp import set_mtp_loss_weights
from megalite.monitoring.memory import SavedActivations
from megalite.object_storage.local_server import wait_for_http
from megalite.pipeline_parallel.stages import rank_stages
from megalite.tensor_parallel import fp8
from megalite.tensor_parallel.weight_grad import LinearStep
from megalite.train_step import autocast
from megalite.training import build_model

ROOT = Path(__file__).resolve().parents[1]


def load_tool(name: str):
    """tools/<name>.py as a module (tools/ is not a package: the scripts run as files)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def untracked() -> set[str]:
    """The checkout's untracked files (git status), to see that a command left none."""
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"],
                         cwd=ROOT, capture_output=True, text=True)
    return set(out.stdout.splitlines()) if out.returncode == 0 else set()


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
    return checkpoint_values(find_checkpoint_to_load(save)[1])


def hold_first_snapshot(monkeypatch) -> None:
    """--async-save's first snapshot copied to host memory only once the next optimizer
    step is about to run (its pre-step hook reached), as a slow copy beside a step would
    be: its files are right only if nothing it copies changes before that hook, and if the
    step waits for the copies (the hook). Later saves copy as usual."""
    step_reached, fill, before_step = (threading.Event(), HostBuffers.fill,
                                       AsyncCheckpointer._before_step)

    def late_fill(self, *args):
        if not step_reached.is_set():  # the first save only (none follows the last)
            step_reached.wait(timeout=10)  # without the hook: after the step has run
        step_reached.set()
        fill(self, *args)

    def announcing_before_step(self, *args):
        if self.pending is not None:
            step_reached.set()
        before_step(self, *args)
    monkeypatch.setattr(HostBuffers, "fill", late_fill)
    monkeypatch.setattr(AsyncCheckpointer, "_before_step", announcing_before_step)


def saved_files(directory: Path, names=None) -> dict[str, dict]:
    """The .pt files of a checkpoint directory (those in `names`), by name."""
    paths = directory.glob("*.pt") if names is None else (directory / n for n in names)
    return {p.name: load_tensor_file(p) for p in paths}


def tensor_bytes(files: dict[str, dict]) -> int:
    """Bytes of the model's and optimizer's tensors in checkpoint files, by file name (what
    an async save holds in host buffers; less the few bytes of ranges and RNG states)."""
    def walk(value, key=""):
        if isinstance(value, dict):
            return sum(walk(v, k) for k, v in value.items())
        if torch.is_tensor(value) and key != "range":
            return value.numel() * value.element_size()
        return 0
    return sum(walk(value) for name, value in files.items() if not name.startswith("rng_"))


def flip_a_bit_of_the_largest_record(path: Path) -> None:
    """One bit of the largest record's bytes (a tensor's data) flipped, as storage rot
    does: the zip's structure stays whole, so torch.load reads the file without complaint."""
    with zipfile.ZipFile(path) as archive:
        record = max(archive.infolist(), key=lambda info: info.file_size)
    with open(path, "r+b") as f:
        f.seek(record.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", f.read(4))
        f.seek(record.header_offset + 30 + name_length + extra_length + record.file_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x10]))


def assert_same_files(a: Path, b: Path):
    """Two checkpoint directories: every .pt file byte for byte, the metadata equal but for
    the flags ("config", "run_file", and the checksum over them) and the launch ("run"),
    which differ between the runs compared."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if name.endswith(".json"):
            ma, mb = (json.loads((d / name).read_text()) for d in (a, b))
            for m in (ma, mb):
                del m["config"], m["run_file"], m["run"], m["checksum"]
            assert ma == mb
        else:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


def download_objects(url: str, dest: Path) -> Path:
    """Every object under `url` (s3://bucket/prefix) into `dest` by its key below the
    prefix, by boto3 itself (not megalite's client): what a bucket holds, as files."""
    import boto3
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.client("s3")
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                 Prefix=prefix + "/"):
        for item in page.get("Contents", []):
            path = dest / item["Key"][len(prefix) + 1:]
            path.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, item["Key"], str(path))
    return dest


@contextlib.contextmanager
def fault_proxy(upstream: str, *faults: str, log: Path):
    """tests/s3_fault_proxy.py in front of `upstream` with `faults`; yields its URL."""
    port = free_port()
    args = [sys.executable, str(ROOT / "tests" / "s3_fault_proxy.py"), "--upstream", upstream,
            "--port", str(port), "--log", str(log), *(a for f in faults for a in ("--fault", f))]
    process = subprocess.Popen(args)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/moto-api/", process)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


def train_in_rank(rank: int, world_size: int, flags: list[str]) -> str:
    """pretrain_gpt.py's run of `flags` on this rank of a spawn.run_distributed launch
    (megalite.training.run_training, on the CPU); what it printed."""
    from megalite.arguments import parse_args
    from megalite.parallel_state import ParallelState
    from megalite.training import run_training
    from megalite.validation import validate_args
    config = validate_args(parse_args(flags), world_size)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_training(config, ParallelState(config.parallel.grid, rank), torch.device("cpu"),
                     None)
    return out.getvalue()


def assert_identical(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


# ------------------------------------------------------------ layouts against one process

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


# ----------------------------------------------------- activations saved for backward

CPU = torch.device("cpu")

# Per sample, the lengths of its documents (the first a document's tail, the last cut at the
# sequence's end): long, short and cut ones, for runs with the document flags.
DOCUMENT_LENGTHS = ([13, 30, 21], [5, 40, 7, 12], [64], [2, 9, 11, 17, 25])


def document_starts(batch: int, seq: int) -> torch.Tensor:
    """[batch, seq] document starts of DOCUMENT_LENGTHS' samples in turn."""
    return torch.stack([starts_from_lengths(DOCUMENT_LENGTHS[i % len(DOCUMENT_LENGTHS)], seq)
                        for i in range(batch)])


def saved_activation_bytes(config, chunk, first: bool, last: bool, seq: int) -> int:
    """One micro-batch through `chunk` as the executor runs it (the step's autocast), with
    the documents of `document_starts` under the document flags:
    the distinct storages autograd saves for backward, plus what the executor holds, the
    received input and, on a stage that sends, the output and its contiguous send buffer.
    Parameters and buffers are not activations."""
    m, b = config.model, config.training.micro_batch_size
    chunk.train()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, m.vocab_size, (b, m.seq_length), generator=g)
    dtype = next(chunk.parameters()).dtype
    x = tokens if first else \
        torch.randn(seq, b, m.hidden_size, generator=g).to(dtype).requires_grad_()
    # The labels a tensor of their own, as the data loader gives them (a compiled loss keeps
    # them, where they would otherwise share the saved token ids' storage).
    starts = document_starts(b, m.seq_length) if m.uses_documents else None
    step = LinearStep()
    step.install(chunk)
    with SavedActivations(chunk) as saved, autocast(config.precision, CPU), \
            fp8.quantize_weights_once(step):  # as in a training step
        mtp = {}
        if last and m.mtp_depths:  # the loader's MTP targets, a tensor each
            targets = add_mtp_targets({"labels": tokens, "loss_mask": torch.ones(b, m.seq_length)},
                                      m.mtp_depths)
            mtp = {"mtp_targets": (targets["mtp_labels"], targets["mtp_loss_mask"])}
            set_mtp_loss_weights([chunk], torch.ones(m.mtp_depths))
        out = chunk(x, tokens.clone() if last else None, document_starts=starts, **mtp)
        for q, q_t in (copies for _, copies in step.fp8_weights.values()):
            saved.add(q.data, q_t.data)  # held for the step, whether saved or not
    if not first:
        saved.add(x)
    if not last:
        saved.add(out, out.detach().contiguous())
    return saved.nbytes


def planned_chunk_bytes(config, pp_rank: int, device: str = "cpu") -> list[int]:
    # The FP8 weight copies quantize_weights_once keeps for the step (both layouts).
    return [c.saved + c.send_forward + c.fp8_weights
            for c in me.rank_chunks(config, pp_rank, me.DEVICES[device])]


def measured_chunk_bytes(config, pp_rank: int, state=None) -> list[int]:
    par = config.parallel
    p = par.pipeline_model_parallel_size
    groups = state or types.SimpleNamespace(pp_rank=pp_rank, pp_size=p, tp_group=None,
                                            cp_group=None, ep_group=None)
    torch.manual_seed(0)
    chunks = build_model(config, groups, CPU, None)
    t = par.tensor_model_parallel_size
    seq = config.model.seq_length // (t if config.model.sequence_parallel else 1)
    return [saved_activation_bytes(config, chunk, stage.is_first, stage.is_last, seq)
            for stage, chunk in zip(rank_stages(pp_rank, p, len(chunks)), chunks)]
