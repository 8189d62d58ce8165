"""tools/check_cluster.py under torchrun on 2 CPU processes (gloo), as a user runs it on a
new cluster (issue 25): layouts of every kind agree with one process and the report says
so; with one reduction broken on purpose (broken_check_cluster.py) the check fails and
names that layout, its first differing step and tensor, and no other layout."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
# One layout of each kind, two steps each: the whole list runs in the README's command.
LAYOUTS = ["DP2 ZeRO-1", "DP2 FSDP2 optim_grads_params", "TP2", "PP2 1f1b", "CP2 p2p"]


def check_cluster(script: str, output_dir, *extra) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", script, "--output-dir", str(output_dir), "--steps", "2", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_every_layout_kind_equals_one_process(tmp_path):
    proc = check_cluster("tools/check_cluster.py", tmp_path, "--checks", "correctness",
                         "checkpoint", "--layouts", *LAYOUTS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "REPORT.md").read_text()
    assert "every check passed" in report
    for layout in LAYOUTS:
        assert f"| {layout} | fp32 | ok |" in report, report
    assert "Projected save of the 13B model (13.02B parameters" in report


def test_a_broken_reduction_is_named(tmp_path):
    proc = check_cluster("tests/distributed/broken_check_cluster.py", tmp_path,
                         "--checks", "correctness", "--layouts", "DP2 ZeRO-1", "TP2")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "REPORT.md").read_text()
    assert "| DP2 ZeRO-1 | fp32 | ok |" in report, report
    failed = next(line for line in report.splitlines() if line.startswith("| TP2 |"))
    # The norms' gradients are halved: the first step's grad norm differs, and the first
    # value to differ after the update is the first layer's first norm.
    assert "**FAIL** | rank 0: step 1:" in failed, failed
    assert "first tensor: value of decoder.layers.0.input_layernorm.weight" in failed, failed
