"""A fixed set of runs against the outputs the code wrote before the house was rebuilt (issue
40): one process, TP2 x PP2 x DP2 with ZeRO-1, FSDP2, EP 2 and FP8, on the CPU. Each prints
the log lines it printed then (the fields that do not measure time or memory) and writes
the same checkpoint bytes: every .pt file and the tracker byte for byte; metadata.json
equal but for its echo of the configuration (`config`, `run_file`: a new flag adds a line
there, by design, and its checksum over them) and the launch that wrote it (`run`: a new
one each launch). tests/data/golden_runs.json holds those outputs;
GOLDEN_REGENERATE=1 rewrites it (only when an output is meant to change: say why in the
commit). Two launches: one process, and eight ranks running the four layouts in turn."""

import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch.distributed

from megalite.spawn import run_distributed
from tests.helpers import train_in_rank

pytestmark = pytest.mark.slow  # launches ranks

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden_runs.json"
MODEL = ["--mock-data", "--vocab-size", "64", "--num-layers", "4", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings",
         "16", "--lr", "1e-3", "--train-iters", "2", "--log-interval", "1", "--eval-iters",
         "0", "--num-workers", "0", "--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
LAYOUTS = {  # on eight ranks
    "tp2_pp2_dp2_zero1": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                          "--micro-batch-size", "1", "--global-batch-size", "4"],
    "fsdp2": ["--use-torch-fsdp2", "--micro-batch-size", "1", "--global-batch-size", "8"],
    "ep2": ["--num-experts", "4", "--expert-model-parallel-size", "2",
            "--disable-bias-linear", "--moe-aux-loss-coeff", "1e-2", "--micro-batch-size", "1",
            "--global-batch-size", "8"],
    "fp8": ["--fp8-format", "hybrid", "--tensor-model-parallel-size", "2",
            "--micro-batch-size", "1", "--global-batch-size", "4"],
}
ONE_PROCESS = ["--micro-batch-size", "2", "--global-batch-size", "4"]
# The log line's fields that measure time or memory, not what was computed.
VARYING = re.compile(r"^ ?\[[^\]]*\] |(elapsed time per iteration|throughput per GPU|"
                     r"tokens per second|mem [\w ]+\(MiB\))[^|]*\| ?")


def log_lines(printed: str) -> list[str]:
    return [VARYING.sub("", line).strip() for line in printed.splitlines()
            if " iteration " in line and "lm loss" in line]


def checkpoint(root: Path) -> dict[str, str]:
    """{relative path: sha256 of its bytes}, metadata.json hashed without its echo of the
    configuration and its launch."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name == "metadata.json":
            meta = {k: v for k, v in json.loads(data).items() if k not in ("config", "run_file", "run", "checksum")}
            data = json.dumps(meta, sort_keys=True).encode()
        out[str(path.relative_to(root))] = hashlib.sha256(data).hexdigest()
    return out


def run_layouts(rank, world_size, root, layouts):
    outputs = {}
    for name, flags in layouts.items():
        save = os.path.join(root, name)
        printed = train_in_rank(rank, world_size, [*MODEL, *flags, "--save", save])
        torch.distributed.barrier()  # every rank's files are written before the next run
        outputs[name] = printed
    return outputs


def outputs(tmp_path) -> dict:
    printed = run_distributed(1, run_layouts, str(tmp_path), {"one_process": ONE_PROCESS},
                              timeout=300)[0]
    by_rank = run_distributed(8, run_layouts, str(tmp_path), LAYOUTS, timeout=600)
    for name in LAYOUTS:  # the log line is printed by the last rank (the loss's stage)
        printed[name] = by_rank[-1][name]
    return {name: {"log": log_lines(text), "checkpoint": checkpoint(tmp_path / name)}
            for name, text in printed.items()}


def test_runs_print_and_save_what_they_did_before(tmp_path):
    got = outputs(tmp_path)
    if os.environ.get("GOLDEN_REGENERATE") == "1":
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name]["log"] == want[name]["log"], name
        assert len(got[name]["log"]) == 2, name
        assert got[name]["checkpoint"] == want[name]["checkpoint"], name
