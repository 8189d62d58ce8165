"""Megatron-LM checkpoints in and out (megalite/megatron_checkpoint, tools/convert_checkpoint.py).

The reference is Megatron itself: tests/data/megatron_checkpoint holds a checkpoint
megatron.core wrote in both its formats and the logits its forward computed (README there).
The TP 2 Megatron checkpoint is cut here by hand the way Megatron shards (independently of
megalite's params.tp_shard): QKV rows by whole query groups, fc1 as [gate half r; up half
r], linear_proj and fc2 by columns, the vocabulary (padded to 2 x 128 rows) by rows.
"""

import argparse
import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import megalite.megatron_checkpoint.reader as reader
import megalite.megatron_checkpoint.torch_dist as torch_dist
from megalite.checkpointing.loading import SavedCheckpoint
from megalite.checkpointing.storage import find_checkpoint_to_load, read_metadata
from megalite.errors import CheckpointError
from megalite.megatron_checkpoint.convert import write_megalite_checkpoint
from megalite.model.gpt import GPTModel
from megalite.spawn import run_distributed
from megalite.training_log import parse_log

from tests.helpers import tiny_gpt_config

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "megatron_checkpoint"
REFERENCE = torch.load(DATA / "reference_logits.pt", weights_only=True)
TOOL = ROOT / "tools" / "convert_checkpoint.py"
LEGACY = "iter_0000010/mp_rank_00/model_optim_rng.pt"


def tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def convert(*flags) -> int:
    return tool().main([str(f) for f in flags])


def megalite_model(save: Path) -> GPTModel:
    """The single-process model of a megalite checkpoint, rebuilt from its files."""
    iteration, directory = find_checkpoint_to_load(save)
    meta = read_metadata(directory)
    saved = SavedCheckpoint(directory, meta)
    state = {n: saved.param(n) for n in saved.names}
    rows = state["embedding.word_embeddings.weight"].shape[0]
    model = GPTModel(tiny_gpt_config(**{**meta["model"], "padded_vocab_size": rows}), seed=0)
    model.load_state_dict(state)
    return model.eval()


def logits(model: GPTModel, tokens=REFERENCE["tokens"]) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)[..., :REFERENCE["logits"].shape[-1]]


def megatron_legacy(path: Path = DATA / "torch" / LEGACY) -> dict:
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, weights_only=True)


def assert_renamed_keys_read_the_same(data: Path, directory: Path, rename) -> None:
    """Megatron's legacy checkpoint in `data` with each key renamed by `rename` (another
    spelling Megatron writes), saved in `directory`: the reader gives the same tensors."""
    record = megatron_legacy(data / "torch" / LEGACY)
    record["model"] = {rename(k): v for k, v in record["model"].items()}
    path = directory / LEGACY
    path.parent.mkdir(parents=True)
    torch.save(record, path)
    (directory / "latest_checkpointed_iteration.txt").write_text("10")
    renamed, original = (reader.read_checkpoint(d) for d in (directory, data / "torch"))
    assert renamed.state.keys() == original.state.keys()
    for name, t in original.state.items():
        assert torch.equal(renamed.state[name], t), name


def split_like_megatron(record: dict, tp: int = 2) -> list[dict]:
    """Each TP rank's legacy file of the Megatron checkpoint, cut by hand (module doc)."""
    args = argparse.Namespace(**{**vars(record["args"]), "tensor_model_parallel_size": tp,
                                 "padded_vocab_size": 128 * tp})
    ranks = [{} for _ in range(tp)]
    for name, t in record["model"].items():
        for r in range(tp):
            if t is None or t.dim() == 1:  # extra state, norms: replicated
                piece = t
            elif "word_embeddings" in name or "output_layer" in name:
                padded = torch.cat([t, t.new_zeros(128 * tp - t.shape[0], t.shape[1])])
                piece = padded.chunk(tp)[r]
            elif "linear_qkv" in name:  # 2 groups of [q, q, k, v] x 16 rows
                piece = t.chunk(tp)[r]
            elif "linear_fc1" in name:
                gate, up = t.chunk(2)
                piece = torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
            else:  # linear_proj, linear_fc2: row-parallel, split the input columns
                piece = t.chunk(tp, dim=1)[r]
            ranks[r][name] = None if piece is None else piece.clone()
    return [{**record, "model": m, "args": args} for m in ranks]


def save_legacy_tp(out: Path, tp: int = 2) -> Path:
    for r, record in enumerate(split_like_megatron(megatron_legacy(), tp)):
        path = out / f"iter_0000010/mp_rank_{r:02d}/model_optim_rng.pt"
        path.parent.mkdir(parents=True)
        torch.save(record, path)
    (out / "latest_checkpointed_iteration.txt").write_text("10")
    return out


# --- import: Megatron's logits -------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_import_gives_megatrons_logits(tmp_path, fmt):
    assert convert("--import-megatron", DATA / fmt, "--save", tmp_path / "ckpt") == 0
    assert find_checkpoint_to_load(tmp_path / "ckpt")[0] == 10  # the iteration is kept
    torch.testing.assert_close(logits(megalite_model(tmp_path / "ckpt")), REFERENCE["logits"],
                               atol=1e-5, rtol=0)


def test_ckpt_format_forces_a_format(tmp_path, capsys):
    assert convert("--import-megatron", DATA / "torch", "--save", tmp_path / "a",
                   "--ckpt-format", "torch") == 0
    assert convert("--import-megatron", DATA / "torch", "--save", tmp_path / "b",
                   "--ckpt-format", "torch_dist") == 1
    assert "is not a --ckpt-format torch_dist checkpoint (it holds torch)" in \
        capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_megatron_tp2_checkpoint_imports_to_the_same_model(tmp_path):
    save_legacy_tp(tmp_path / "tp2")
    assert convert("--import-megatron", tmp_path / "tp2", "--save", tmp_path / "ckpt") == 0
    assert convert("--import-megatron", DATA / "torch", "--save", tmp_path / "ref") == 0
    model, ref = megalite_model(tmp_path / "ckpt"), megalite_model(tmp_path / "ref")
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b[:a.shape[0]]), name  # b: vocabulary padded for TP 2
    torch.testing.assert_close(logits(model), REFERENCE["logits"], atol=1e-5, rtol=0)


def _tp2_logits(rank, world_size, loads):
    """pretrain_gpt.py's load path (training.load_any_format) at TP 2, per Megatron
    directory: the logits of the loaded model and its iteration."""
    from megalite.arguments import parse_args
    from megalite.config import OptimizerConfig
    from megalite.model.gpt import build_model_chunks
    from megalite.optimizer.optimizer import Optimizer
    from megalite.parallel_state import ParallelState, RankGrid
    from megalite.checkpointing.state import CheckpointState
    from megalite.training import load_any_format
    from megalite.validation import validate_model_args
    state = ParallelState(RankGrid(world_size, 2, 1), rank)
    out = {}
    for load in loads:
        args = parse_args(MODEL_FLAGS + ["--tensor-model-parallel-size", "2", "--load", load,
                                         "--vocab-size", "128", "--attention-dropout", "0",
                                         "--hidden-dropout", "0", "--attention-backend", "sdpa"])
        config = validate_model_args(args, world_size)
        chunks = build_model_chunks(config.model, 1, 0, 1, 1, state.tp_group)
        optimizer = Optimizer(chunks, OptimizerConfig(lr=1e-3), None, state.tp_group,
                              state.mp_group)
        scheduler = argparse.Namespace(load_state_dict=lambda s: None)
        loaded = load_any_format(CheckpointState(chunks, optimizer, scheduler, state, config))
        adam = {n.split(".", 1)[1]: optimizer.adam.state.get(s.main, {})
                for s in optimizer.segments for n, p in chunks.named_parameters()
                if p is s.param}
        out[load] = (loaded["iteration"], logits(chunks[0].eval()),
                     {n: {k: v.view(-1) for k, v in a.items()} for n, a in adam.items()})
    return out


MODEL_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
               "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "176",
               "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-5",
               "--disable-bias-linear", "--position-embedding-type", "rope",
               "--untie-embeddings-and-output-weights", "--seq-length", "32",
               "--max-position-embeddings", "32"]


@pytest.mark.slow
def test_pretrain_load_at_tp2_gives_megatrons_logits(tmp_path):
    """One launch: both formats of the test vector, the TP 2 Megatron checkpoint, and that
    with Adam's state (carried over), loaded by megalite at TP 2 without conversion."""
    _, moments = save_legacy_tp_with_adam(tmp_path / "adam")
    loads = [str(DATA / "torch"), str(DATA / "torch_dist"), str(save_legacy_tp(tmp_path / "t2")),
             str(tmp_path / "adam")]
    for rank, rank_out in enumerate(run_distributed(2, _tp2_logits, loads)):
        for load in loads:
            iteration, got, adam = rank_out[load]
            assert iteration == 10, load
            torch.testing.assert_close(got, REFERENCE["logits"], atol=1e-5, rtol=0)
            if load != loads[-1]:  # no optimizer state: Adam starts fresh
                assert all(not a for a in adam.values()), load
                continue
            for name, state in adam.items():  # Megatron's shard r is megalite's TP rank r's
                assert int(state["step"]) == 2
                for k in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(state[k], moments[k][rank][name].reshape(-1)), (name, k)


@pytest.mark.parametrize("finetune", [False, True])
def test_pretrain_continues_a_megatron_run(capsys, finetune):
    """pretrain_gpt.py --load on Megatron's directory: iteration 10 continues at 11 (or
    --finetune starts at 1), and the missing optimizer state is said, not hidden."""
    from megalite.training import pretrain
    flags = [*MODEL_FLAGS, "--mock-data", "--vocab-size", "128", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--lr", "1e-4", "--log-interval", "1",
             "--eval-iters", "0", "--num-workers", "0", "--attention-dropout", "0",
             "--hidden-dropout", "0", "--load", str(DATA / "torch"),
             "--train-iters", "1" if finetune else "11", *["--finetune"] * finetune]
    assert pretrain(flags) == 0
    out = capsys.readouterr().out
    first = re.search(r"iteration +(\d+)/", out)
    assert first and int(first.group(1)) == (1 if finetune else 11), out
    assert ("optimizer starts fresh" in out) != finetune


def test_pretrain_load_under_fsdp2_and_zero1_gives_the_plain_loads_losses(tmp_path, capsys):
    """pretrain_gpt.py --load on a Megatron directory with Adam's state, under FSDP2 and
    ZeRO-1 (each also with offload) as under plain AdamW: the same loss at iteration 11 (the
    loaded weights) and 12 (a step from the loaded moments: without them it differs)."""
    from megalite.training import pretrain
    save_legacy_tp_with_adam(tmp_path / "adam", tp=1)
    flags = [*MODEL_FLAGS, "--mock-data", "--vocab-size", "128", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--lr", "1e-2", "--log-interval", "1",
             "--eval-iters", "0", "--num-workers", "0", "--attention-dropout", "0",
             "--hidden-dropout", "0", "--load", str(tmp_path / "adam"), "--train-iters", "12"]
    losses = {}
    for name, extra in {"plain": [], "fsdp2": ["--use-torch-fsdp2"],
                        "fsdp2 offload": ["--use-torch-fsdp2", "--optimizer-cpu-offload"],
                        "zero1 offload": ["--use-distributed-optimizer",
                                          "--optimizer-cpu-offload"]}.items():
        assert pretrain([*flags, *extra]) == 0, name
        out = capsys.readouterr().out
        assert "Adam state carried over (step 2)" in out, name
        losses[name] = {log["iteration"]: log["lm_loss"] for log in parse_log(out)}
    assert list(losses["plain"]) == [11, 12]
    for name, got in losses.items():
        assert got == pytest.approx(losses["plain"], rel=1e-5), name


# --- export: Megatron's names, layouts and values ------------------------------------------

def _dcp_entries(directory: Path) -> dict:
    """Every entry of a torch_dist directory as torch.distributed.checkpoint stores it:
    tensors whole, objects as the pickled bytes (decoded here with the args allowed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = FileSystemReader(str(directory)).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) if
             isinstance(m, TensorStorageMetadata) else b""
             for k, m in meta.state_dict_metadata.items()}

    class Raw(DefaultLoadPlanner):
        def load_bytes(self, item, value):
            with torch.serialization.safe_globals([argparse.Namespace]):
                self.state_dict[item.dest_index.fqn] = torch.load(value, weights_only=True)
    planner = Raw(flatten_state_dict=False)
    dcp.load(state, storage_reader=FileSystemReader(str(directory)), planner=planner,
             no_dist=True)
    return planner.state_dict


def export_and_reimport(tmp_path: Path, data: Path) -> None:
    """Megatron's torch_dist checkpoint in `data` imported, exported in both formats and
    imported again: the same model, bit for bit."""
    assert convert("--import-megatron", data / "torch_dist", "--save", tmp_path / "a") == 0
    first = megalite_model(tmp_path / "a")
    for fmt in ("torch", "torch_dist"):
        out = tmp_path / f"megatron_{fmt}"
        assert convert("--load", tmp_path / "a", "--export-megatron", out,
                       "--ckpt-format", fmt) == 0
        assert convert("--import-megatron", out, "--save", tmp_path / f"b_{fmt}") == 0
        again = megalite_model(tmp_path / f"b_{fmt}")
        for (name, x), (_, y) in zip(first.state_dict().items(), again.state_dict().items()):
            assert torch.equal(x, y), (fmt, name)


def assert_torch_dist_matches(ours: Path, theirs: Path, unrecorded: tuple = ()) -> None:
    """Our torch_dist directory holds Megatron's entries: the same keys, tensors and common
    state (args fields in `unrecorded` aside)."""
    ours, theirs = _dcp_entries(ours), _dcp_entries(theirs)
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        if key.startswith("common_state"):
            (common,), (mine,) = value, ours[key]
            assert {k: v for k, v in mine.items() if k != "args"} == \
                {k: v for k, v in common.items() if k != "args"}
            for field, setting in vars(common["args"]).items():
                assert field in unrecorded or getattr(mine["args"], field) == setting, field
        elif torch.is_tensor(value):
            assert ours[key].shape == value.shape and torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_import_export_import_is_lossless_and_torch_dist_matches_megatrons(tmp_path):
    export_and_reimport(tmp_path, DATA)
    assert_torch_dist_matches(tmp_path / "megatron_torch_dist" / "iter_0000010",
                              DATA / "torch_dist" / "iter_0000010")
    legacy = megatron_legacy(tmp_path / "megatron_torch" / LEGACY)["model"]
    assert list(legacy) == list(megatron_legacy()["model"])


def test_export_at_tp2_is_megatrons_split(tmp_path):
    assert convert("--import-megatron", DATA / "torch", "--save", tmp_path / "a") == 0
    assert convert("--load", tmp_path / "a", "--export-megatron", tmp_path / "m",
                   "--ckpt-format", "torch", "--target-tensor-parallel-size", "2") == 0
    for r, expected in enumerate(split_like_megatron(megatron_legacy())):
        got = megatron_legacy(tmp_path / f"m/iter_0000010/mp_rank_{r:02d}/model_optim_rng.pt")
        assert got["args"].padded_vocab_size == 256 and got["iteration"] == 10
        assert list(got["model"]) == list(expected["model"])
        for name, t in expected["model"].items():
            assert (t is None and got["model"][name] is None) or \
                torch.equal(got["model"][name], t), (r, name)


def test_gpt2_style_export_reimports_to_the_same_logits(tmp_path):
    """LayerNorm with biases, GeLU, learned positions, tied embeddings, --qk-layernorm
    (Megatron's self_attention.{q,k}_layernorm, away from their 1 / 0 init); exported at
    TP 2 PP 2 (the last stage keeps its copy of the tied output layer, as Megatron does)."""
    config = tiny_gpt_config(vocab_size=64, qk_layernorm=True)
    model = GPTModel(config, seed=3).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_layernorm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    write_megalite_checkpoint(tmp_path / "a", config, model.state_dict(), 7, 0, 0, None, {})
    for fmt in ("torch", "torch_dist"):
        out = tmp_path / f"m_{fmt}"
        assert convert("--load", tmp_path / "a", "--export-megatron", out, "--ckpt-format", fmt,
                       "--target-tensor-parallel-size", "2",
                       "--target-pipeline-parallel-size", "2") == 0
        assert convert("--import-megatron", out, "--save", tmp_path / f"b_{fmt}") == 0
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        again = megalite_model(tmp_path / f"b_{fmt}")
        torch.testing.assert_close(logits(again, tokens)[..., :64], logits(model, tokens),
                                   atol=0, rtol=0)
        assert find_checkpoint_to_load(tmp_path / f"b_{fmt}")[0] == 7
    # Vocabulary 64 padded to 2 x 128 rows: TP rank 0 holds the 64 real ones.
    last = megatron_legacy(tmp_path / "m_torch/iter_0000007/mp_rank_00_001/model_optim_rng.pt")
    assert torch.equal(last["model"]["output_layer.weight"],
                       torch.cat([model.embedding.word_embeddings.weight.detach(),
                                  torch.zeros(64, 32)]))


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_stage_reads_only_its_own_tensors(tmp_path, monkeypatch, fmt):
    """A Megatron checkpoint saved at TP 2 PP 2 (4 layers), read for pipeline stage 0 of 2
    (Megatron's even split: the embedding and layers 0-1): no file or stored row of the last
    stage is read, no optimizer state is kept, and what is read equals the whole read."""
    config = tiny_gpt_config(vocab_size=64, num_layers=4)
    write_megalite_checkpoint(tmp_path / "a", config, GPTModel(config, seed=3).state_dict(), 7,
                              0, 0, None, {})
    assert convert("--load", tmp_path / "a", "--export-megatron", tmp_path / "m",
                   "--ckpt-format", fmt, "--target-tensor-parallel-size", "2",
                   "--target-pipeline-parallel-size", "2") == 0
    whole = reader.read_checkpoint(tmp_path / "m")
    stage_0 = {n for n in whole.state if n.startswith("embedding.") or
               n.startswith(("decoder.layers.0.", "decoder.layers.1."))}
    files, rows = [], []
    torch_load = reader.torch_load
    monkeypatch.setattr(reader, "torch_load", lambda source, what: (
        files.append(Path(what).parent.name), torch_load(source, what))[1])
    read_data = torch_dist._SafeReader.read_data
    monkeypatch.setattr(torch_dist._SafeReader, "read_data", lambda self, plan, planner: (
        rows.extend((i.storage_index.fqn, i.storage_offsets, i.lengths) for i in plan.items),
        read_data(self, plan, planner))[1])
    part = reader.read_checkpoint(tmp_path / "m", names=stage_0, optimizer=False)
    assert set(part.state) == stage_0 and not part.optimizer_shards
    for name in stage_0:
        assert torch.equal(part.state[name], whole.state[name]), name
    if fmt == "torch":
        assert sorted(files) == ["mp_rank_00_000", "mp_rank_01_000"]
    else:
        tensors = [row for row in rows if not row[0].startswith("common_state")]
        assert tensors and not [key for key, *_ in tensors if "output_layer" in key or
                                "final_layernorm" in key]
        # The exporter stores each stacked tensor whole: rows are offsets into all 4 layers.
        assert all(offsets[0] + lengths[0] <= 2 for key, offsets, lengths in tensors
                   if key.startswith("decoder.layers.")), tensors


# --- bad inputs: a named error, nothing written --------------------------------------------

def _ran(path):
    Path(path).touch()


class Unexpected:
    """Unpickling it would create a file: the allow-list must refuse before that."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return _ran, (str(self.marker),)


def _legacy_with(tmp_path: Path, change) -> Path:
    shutil.copytree(DATA / "torch", tmp_path / "src")
    record = megatron_legacy()
    change(record)
    torch.save(record, tmp_path / "src" / LEGACY)
    return tmp_path / "src"


def _neither(tmp_path):
    (tmp_path / "src/iter_0000010").mkdir(parents=True)
    (tmp_path / "src/iter_0000010/model.bin").write_bytes(b"\0")
    (tmp_path / "src/latest_checkpointed_iteration.txt").write_text("10")
    return tmp_path / "src", "is neither Megatron format"


def _missing_shard(tmp_path):
    shutil.rmtree(save_legacy_tp(tmp_path / "src") / "iter_0000010/mp_rank_01")
    return tmp_path / "src", "mp_rank_01/model_optim_rng.pt"


def _missing_distcp(tmp_path):
    shutil.copytree(DATA / "torch_dist", tmp_path / "src")
    (tmp_path / "src/iter_0000010/__0_0.distcp").unlink()
    return tmp_path / "src", "missing ['__0_0.distcp']"


def _wrong_shape(tmp_path):
    name = "decoder.layers.1.self_attention.linear_qkv.weight"

    def change(record):
        record["model"][name] = record["model"][name][:96]
    return _legacy_with(tmp_path, change), f"{name}: (96, 64), expected (128, 64)"


def _unexpected_global(tmp_path):
    def change(record):
        record["args"].tokenizer = Unexpected(tmp_path / "ran")
    return _legacy_with(tmp_path, change), f"{_ran.__module__}._ran"


def _unexpected_global_in_metadata(tmp_path):
    import pickle
    shutil.copytree(DATA / "torch_dist", tmp_path / "src")
    path = tmp_path / "src/iter_0000010/.metadata"
    metadata = FileSystemReader(str(path.parent)).read_metadata()
    metadata.planner_data = Unexpected(tmp_path / "ran")
    path.write_bytes(pickle.dumps(metadata))
    return tmp_path / "src", f"{_ran.__module__}._ran"


@pytest.mark.parametrize("make", [_neither, _missing_shard, _missing_distcp, _wrong_shape,
                                  _unexpected_global, _unexpected_global_in_metadata])
def test_bad_input_is_a_named_error_and_nothing_is_written(tmp_path, capsys, make):
    source, message = make(tmp_path)
    assert convert("--import-megatron", source, "--save", tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert message in err and str(source) in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "ran").exists()
    with pytest.raises(CheckpointError, match="Megatron|torch_dist|neither"):
        reader.read_checkpoint(source)


# --- optimizer state ----------------------------------------------------------------------

def save_legacy_tp_with_adam(out: Path, tp: int = 2) -> tuple[dict, dict]:
    """The TP `tp` Megatron checkpoint with Adam's state: torch's AdamW over the test vector's
    parameters, grouped as Megatron groups them (decayed, then biases and 1-D), two steps;
    saved by TP rank as Megatron's FP32Optimizer does (Adam's state_dict, each rank its
    shards, cut by split_like_megatron). Returns each name's moments and Megatron's TP 2
    shards of them: {name: {moment: full}}, {moment: [rank 0 {name: shard}, rank 1 ...]}."""
    record = megatron_legacy()
    params = {n: torch.nn.Parameter(t.clone()) for n, t in record["model"].items()
              if t is not None}
    adam = torch.optim.AdamW([{"params": [p for p in params.values() if p.dim() > 1]},
                              {"params": [p for p in params.values() if p.dim() == 1],
                               "weight_decay": 0.0}], lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=generator)
        adam.step()
    saved = adam.state_dict()
    order = [p for group in adam.param_groups for p in group["params"]]
    moments = {k: [m["model"] for m in split_like_megatron({**record, "model": {
        n: adam.state[p][k] for n, p in params.items()}}, tp)] for k in ("exp_avg", "exp_avg_sq")}
    save_legacy_tp(out, tp)
    name_of = {id(p): n for n, p in params.items()}
    for r in range(tp):
        path = out / f"iter_0000010/mp_rank_{r:02d}/model_optim_rng.pt"
        state = {i: {"step": saved["state"][i]["step"],
                     **{k: moments[k][r][name_of[id(p)]] for k in moments}}
                 for i, p in enumerate(order)}
        torch.save({**megatron_legacy(path), "optimizer": {
            "state": state, "param_groups": saved["param_groups"]}}, path)
    full = {n: {k: adam.state[p][k] for k in moments} for n, p in params.items()}
    return full, moments


def test_legacy_adam_state_is_carried_over_at_tp2(tmp_path):
    """Imported from the Megatron TP 2 checkpoint with Adam's state: each name's moments
    whole, the main copy the saved weight (Megatron's FP32Optimizer steps the weights)."""
    record = megatron_legacy()
    full, _ = save_legacy_tp_with_adam(tmp_path / "src")
    assert convert("--import-megatron", tmp_path / "src", "--save", tmp_path / "out") == 0
    _, directory = find_checkpoint_to_load(tmp_path / "out")
    ckpt = SavedCheckpoint(directory, read_metadata(directory))
    assert ckpt.optimizer_step() == 2
    for name, moments in full.items():
        for k, value in moments.items():
            got = ckpt.optimizer_tensor(name, k)
            assert torch.equal(got[:value.shape[0]], value), (name, k)
        weight = record["model"][name]
        assert torch.equal(ckpt.optimizer_tensor(name, "main")[:weight.shape[0]], weight)


def test_megatron_enums_in_args_are_read_without_megatron(monkeypatch):
    """Recent Megatron args hold enums (attention_backend=AttnBackend.auto): read as their
    value, with no Megatron installed and nothing else allowed."""
    import enum
    import io
    import sys
    import types

    from megalite.megatron_checkpoint.safe_pickle import torch_load

    class AttnBackend(enum.Enum):
        auto = 5
    AttnBackend.__module__ = "megatron.core.transformer.enums"
    AttnBackend.__qualname__ = "AttnBackend"
    for name in ("megatron", "megatron.core", "megatron.core.transformer",
                 "megatron.core.transformer.enums"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["megatron.core.transformer.enums"].AttnBackend = AttnBackend
    buffer = io.BytesIO()
    torch.save({"args": argparse.Namespace(attention_backend=AttnBackend.auto)}, buffer)
    monkeypatch.undo()
    assert "megatron.core.transformer.enums" not in sys.modules
    assert torch_load(buffer.getvalue(), "args").get("args").attention_backend.value == 5


def test_vocab_size_the_args_do_not_record(tmp_path, capsys):
    """Megatron's args record the padded rows, not the tokenizer's vocabulary: --vocab-size
    names it (at most the rows); without it every row counts."""
    assert convert("--import-megatron", DATA / "torch", "--save", tmp_path / "a",
                   "--vocab-size", "100") == 0
    assert read_metadata(find_checkpoint_to_load(tmp_path / "a")[1])["model"]["vocab_size"] == 100
    assert convert("--import-megatron", DATA / "torch", "--save", tmp_path / "b",
                   "--vocab-size", "200") == 1
    assert "--vocab-size 200 exceeds the checkpoint's 128 vocabulary rows" in \
        capsys.readouterr().err
    assert not (tmp_path / "b").exists()
