"""tools/convert_checkpoint.py end to end: checkpoints pretrain_gpt.py saved at TP 2 and PP 2
exported to HF give transformers' logits equal to the single-process model's on the saved
weights; a HF Llama imported as a checkpoint gives HF's logits and is trained from at TP 2.

The references are independent of the tool: the saved shards are concatenated here from the
file format saving.py documents, and the model flags are spelled out here."""

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402  (a dependency of transformers)

from megalite.model.gpt import GPTModel  # noqa: E402
from megalite.spawn import torchrun_launcher  # noqa: E402

from tests.helpers import LLAMA_STYLE, flags_with, tiny_gpt_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "convert_checkpoint.py"
VOCAB = 61
# The sizes the TRAIN flags below spell out, for tiny_gpt_config.
TINY = dict(hidden_size=64, kv_channels=16, seq_length=32, vocab_size=VOCAB)
GPT2 = dict(ffn_hidden_size=256, num_query_groups=4)
LLAMA = dict(LLAMA_STYLE, ffn_hidden_size=96, num_query_groups=2)
LLAMA_FLAGS = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
               "--disable-bias-linear", "--untie-embeddings-and-output-weights",
               "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "96"]
TRAIN = flags_with("--eval-iters", "0", "--log-interval", "1", "--num-workers", "0",
                   "--distributed-backend", "gloo", vocab_size=VOCAB,
                   make_vocab_size_divisible_by=None, micro_batch_size=2, global_batch_size=4,
                   train_iters=3, lr="1e-2")
TORCHRUN_2 = torchrun_launcher(2)


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def pretrain(prefix: list[str], *flags) -> str:
    proc = run([*prefix, "pretrain_gpt.py", *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def tool():
    """The tool as a module, so most tests skip the interpreter and transformers start-up."""
    spec = importlib.util.spec_from_file_location("convert_checkpoint", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def full_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The single-process tensors of a checkpoint: for each pipeline stage, its TP shard
    files' pieces concatenated along the partition dim they record, part by part for a
    stacked parameter (saving.py's format: SwiGLU's fc1 is [gate; up], each split)."""
    layout = json.loads((directory / "metadata.json").read_text())["layout"]
    state = {}
    for pp in range(layout["pipeline_model_parallel_size"]):
        shards = [torch.load(directory / f"model_tp{t:02d}_pp{pp:03d}.pt", weights_only=True)
                  for t in range(layout["tensor_model_parallel_size"])]
        dims, strides = shards[0]["partition_dims"], shards[0]["partition_strides"]
        for name, t in shards[0]["params"].items():
            if name in dims:
                parts = [s["params"][name].chunk(strides.get(name, 1), dims[name])
                         for s in shards]
                t = torch.cat([p[i] for i in range(len(parts[0])) for p in parts], dims[name])
            state[name] = t
    return state


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(7))


def megalite_logits(style: dict, state: dict[str, torch.Tensor]) -> torch.Tensor:
    rows = state["embedding.word_embeddings.weight"].shape[0]
    model = GPTModel(tiny_gpt_config(**TINY, **style, padded_vocab_size=rows), seed=0).eval()
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(tokens())[..., :VOCAB]


def hf_logits(hf) -> torch.Tensor:
    if not isinstance(hf, torch.nn.Module):
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager")
    with torch.no_grad():
        return hf.eval()(tokens()).logits


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory) -> Path:
    """GPT-2 style (LayerNorm, learned positions, GeLU, tied), trained at TP 2, saved at
    iterations 2 and 3."""
    save = tmp_path_factory.mktemp("gpt2") / "ckpt"
    pretrain(TORCHRUN_2, *TRAIN, "--tensor-model-parallel-size", "2", "--save", save,
             "--save-interval", "2")
    return save


@pytest.mark.slow
def test_export_of_tp2_gpt2_matches_hf_logits(gpt2_checkpoint, tmp_path):
    out = tmp_path / "hf"
    proc = run([sys.executable, TOOL, "--load", gpt2_checkpoint, "--export-hf", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exported iteration 3" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging left behind
    state = full_tensors(gpt2_checkpoint / "iter_0000003")
    assert state["embedding.word_embeddings.weight"].shape[0] == 256  # 61 padded to 128 x TP 2
    assert "output_layer.weight" not in state  # tied
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(hf).__name__ == "GPT2LMHeadModel" and hf.config.vocab_size == VOCAB
    torch.testing.assert_close(hf_logits(hf), megalite_logits(GPT2, state), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_export_of_an_earlier_iteration_in_bf16(gpt2_checkpoint, tmp_path, capsys):
    convert = tool()
    assert convert.main(["--load", str(gpt2_checkpoint), "--iteration", "2", "--export-hf",
                         str(tmp_path / "hf"), "--dtype", "bf16"]) == 0
    assert "exported iteration 2" in capsys.readouterr().out
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    wte = full_tensors(gpt2_checkpoint / "iter_0000002")["embedding.word_embeddings.weight"]
    assert torch.equal(stored["transformer.wte.weight"], wte[:VOCAB].bfloat16())
    later = full_tensors(gpt2_checkpoint / "iter_0000003")["embedding.word_embeddings.weight"]
    assert not torch.equal(wte, later)
    # An existing output is replaced only when asked.
    assert convert.main(["--load", str(gpt2_checkpoint), "--export-hf",
                         str(tmp_path / "hf")]) == 1
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.slow
def test_export_of_pp2_llama_style_matches_hf_logits(tmp_path, capsys):
    """Llama style (RoPE, RMSNorm, SwiGLU, no biases, untied, GQA), one layer per pipeline
    stage: the output layer is saved by the last stage, the embedding by the first."""
    save = tmp_path / "ckpt"
    pretrain(TORCHRUN_2, *TRAIN, *LLAMA_FLAGS, "--pipeline-model-parallel-size", "2",
             "--save", save)
    assert (save / "iter_0000003" / "model_tp00_pp001.pt").is_file()
    assert tool().main(["--load", str(save), "--export-hf", str(tmp_path / "hf")]) == 0
    state = full_tensors(save / "iter_0000003")
    assert "output_layer.weight" in state  # untied
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                           attn_implementation="eager")
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert hf.config.num_key_value_heads == 2 and not hf.config.tie_word_embeddings
    torch.testing.assert_close(hf_logits(hf), megalite_logits(LLAMA, state), atol=1e-4, rtol=0)


def tiny_hf_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from their all-ones init
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.mark.slow
def test_import_gives_hf_logits_and_trains_at_tp2(gpt2_checkpoint, tmp_path, capsys):
    hf = tiny_hf_llama()
    hf.save_pretrained(tmp_path / "hf")
    save = tmp_path / "imported"
    assert tool().main(["--import-hf", str(tmp_path / "hf"), "--save", str(save)]) == 0
    command = capsys.readouterr().out.splitlines()[-1]

    directory = save / "iter_0000000"
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "0"
    assert sorted(p.name for p in directory.iterdir()) == ["metadata.json",
                                                          "model_tp00_pp000.pt"]
    meta = json.loads((directory / "metadata.json").read_text())
    trained = json.loads((gpt2_checkpoint / "iter_0000003" / "metadata.json").read_text())
    # A launch's record ("run", save_guard.RunRecord) is a training run's; a tool writes none.
    assert meta.keys() == trained.keys() - {"run"}
    assert meta["layout"].keys() == trained["layout"].keys()
    assert meta["model"].keys() == trained["model"].keys()
    assert (meta["has_optimizer"], meta["has_rng"]) == (False, False)
    state = full_tensors(directory)
    assert state["embedding.word_embeddings.weight"].shape[0] == 128
    torch.testing.assert_close(megalite_logits(LLAMA, state), hf_logits(hf), atol=1e-4, rtol=0)

    # The printed command (model flags) loads it at TP 2, where the vocabulary pads to 256.
    # An lr of 1e-12 moves no fp32 weight, so the checkpoint saved after one step still
    # holds HF's model, gathered from TP 2 shards.
    argv = shlex.split(command)
    assert argv[:2] == ["python", "pretrain_gpt.py"]
    out = pretrain(TORCHRUN_2, *TRAIN, *argv[2:], "--tensor-model-parallel-size", "2",
                   "--lr", "1e-12", "--train-iters", "1", "--save", tmp_path / "tuned")
    assert f"resuming from {save} at iteration 0" in out
    tuned = full_tensors(tmp_path / "tuned" / "iter_0000001")
    assert tuned["embedding.word_embeddings.weight"].shape[0] == 256
    torch.testing.assert_close(megalite_logits(LLAMA, tuned), hf_logits(hf), atol=1e-4, rtol=0)


def test_missing_input_is_an_error_naming_the_path(tmp_path, capsys):
    convert = tool()
    empty = tmp_path / "empty"
    empty.mkdir()
    for load in (empty, tmp_path / "absent"):
        assert convert.main(["--load", str(load), "--export-hf", str(tmp_path / "hf")]) == 1
        assert f"error: --load {load}" in capsys.readouterr().err
    assert convert.main(["--load", str(empty), "--iteration", "5", "--export-hf",
                         str(tmp_path / "hf")]) == 1
    assert str(empty / "iter_0000005") in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    for source in (tmp_path / "absent", empty):  # no directory; no HF model in it
        assert convert.main(["--import-hf", str(source), "--save", str(tmp_path / "s")]) == 1
        assert f"error: --import-hf {source}" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_unsupported_style_is_an_error_naming_the_field(tmp_path, capsys):
    """RMSNorm with a GeLU MLP has no HF counterpart. Its checkpoint is written by the
    import's writer (which the test above has pretrain_gpt.py load), not by a training run,
    to spare a process start."""
    convert = tool()
    config = tiny_gpt_config(**TINY, **GPT2, normalization="RMSNorm", padded_vocab_size=128)
    state = GPTModel(config, seed=0).state_dict()
    convert.save_single_process_checkpoint(str(tmp_path / "ckpt"), config, state, "test")
    assert convert.main(["--load", str(tmp_path / "ckpt"), "--export-hf",
                         str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "normalization='RMSNorm'" in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_import_refuses_a_non_empty_save_dir(gpt2_checkpoint, tmp_path, capsys):
    assert tool().main(["--import-hf", str(tmp_path), "--save", str(gpt2_checkpoint)]) == 1
    assert f"--save {gpt2_checkpoint} is not empty" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    ([], "exactly one of --export-hf"),
    (["--export-hf", "x"], "--export-hf needs --load"),
    (["--import-hf", "x"], "--import-hf needs --save"),
    (["--import-hf", "x", "--save", "y", "--dtype", "bf16"], "not used with --import-hf: --dtype"),
    (["--load", "x", "--export-hf", "y", "--make-vocab-size-divisible-by", "64"],
     "not used with --export-hf: --make-vocab-size-divisible-by"),
])
def test_bad_flags_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tool().main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
