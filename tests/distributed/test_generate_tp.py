"""tools/generate.py on a checkpoint trained at TP 2 x PP 2: the same tokens at TP 1 (one
process) and TP 2 (torchrun), greedy and sampled; bad input refused without a traceback."""

import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest

from megalite.spawn import torchrun_command

ROOT = Path(__file__).resolve().parent.parent.parent
# Llama style (RoPE, RMSNorm, SwiGLU, GQA with a K/V group per TP-2 rank, untied). The
# NullTokenizer's eod (--vocab-size) is the mock data's; 41 ids pad to 42 at TP 2 only.
MODEL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "40",
         "--make-vocab-size-divisible-by", "1", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
         "--swiglu", "--ffn-hidden-size", "96", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear", "--seq-length", "32"]
TRAIN = ["--mock-data", "--micro-batch-size", "4", "--global-batch-size", "8",
         "--train-iters", "20", "--lr", "2e-2", "--lr-warmup-iters", "2",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "10",
         "--eval-iters", "0", "--num-workers", "0", "--distributed-backend", "gloo"]
PROMPT = ["--prompt", "3 4 5 6", "--max-new-tokens", "16"]
SAMPLED = ["--temperature", "2.0", "--top-k", "8", "--top-p", "0.95", "--seed", "5"]
IDS = re.compile(r"^ > generated token ids: (.*)$", re.M)


def torchrun(nproc: int, script: str, *flags: str) -> str:
    proc = subprocess.run(torchrun_command(nproc, script, flags), cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    save = str(tmp_path_factory.mktemp("generate") / "ckpt")
    torchrun(4, "pretrain_gpt.py", *MODEL, *TRAIN, "--tensor-model-parallel-size", "2",
             "--sequence-parallel", "--pipeline-model-parallel-size", "2", "--save", save)
    return save


def tool():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "tools" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generate_tp1(capsys, *flags: str) -> str:
    """One process, in this one: the tool's main() with a one-rank process group."""
    assert tool().main([*MODEL, *flags]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def ids_and_text(stdout: str) -> tuple[list[int], str]:
    return [int(t) for t in IDS.search(stdout)[1].split()], stdout.rstrip("\n").split("\n")[-1]


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [["--greedy"], SAMPLED], ids=["greedy", "sampled"])
def test_tp1_and_tp2_generate_the_same_tokens(checkpoint, capsys, sampling):
    flags = ["--load", checkpoint, *PROMPT, *sampling]
    tp1 = generate_tp1(capsys, *flags)
    tp2 = torchrun(2, "tools/generate.py", *MODEL, *flags, "--tensor-model-parallel-size", "2",
                   "--distributed-backend", "gloo")
    assert "saved at TP 2 PP 2 DP 1" in tp1 and "generating at TP 2" in tp2
    ids, text = ids_and_text(tp1)
    assert (ids, text) == ids_and_text(tp2)
    assert text == " ".join(map(str, [3, 4, 5, 6, *ids]))
    assert all(0 <= t <= 40 for t in ids)  # never a padding id (41 at TP 2)
    if sampling == ["--greedy"]:
        # The mock documents count 1, 2, 3, ...: the loaded weights (not a fresh
        # initialisation, which is the same at every TP size) have learnt to continue.
        assert ids[:8] == list(range(7, 15))
    else:
        assert ids[:8] != list(range(7, 15))


@pytest.mark.slow
@pytest.mark.parametrize("flags, message", [
    (["--prompt", " ".join(["1"] * 30), "--max-new-tokens", "3"],
     r"the prompt \(30 tokens\) \+ --max-new-tokens \(3\) = 33 tokens exceeds the model's 32 "
     r"positions \(--seq-length\)"),
    (["--prompt", "1 two 3"], "NullTokenizer expects whitespace-separated integer ids"),
    (["--prompt", "1 99"], r"ids outside the vocabulary \[0, 41\): \[99\]"),
    (["--temperature", "0"], "--temperature must be positive"),
    (["--pipeline-model-parallel-size", "2"], "pass --pipeline-model-parallel-size 1, not 2"),
    (["--num-layers", "4"], r"holds a different model.*num_layers: checkpoint: 2, this run: 4"),
])
def test_bad_input_is_refused_without_traceback(checkpoint, capsys, flags, message):
    argv = [*MODEL, "--load", checkpoint, "--prompt", "1 2", "--max-new-tokens", "4", *flags]
    assert tool().main(argv) != 0
    err = capsys.readouterr().err
    assert re.search(message, err, re.S), err
    assert "Traceback" not in err


def test_missing_checkpoint_is_refused(tmp_path, capsys):
    assert tool().main([*MODEL, "--load", str(tmp_path / "none"), "--prompt", "1"]) == 1
    assert f"--load {tmp_path / 'none'}: no checkpoint there" in capsys.readouterr().err
