"""benchmarks/gpu_check.sh in SMOKE mode (tiny, on the CPU): the script's output contract.

docs/benchmarks.md's first command (both tiers: every step of steps.tsv) runs here rather than in
tests/test_doc_commands.py, which runs the page's other commands: one run of the whole
script is checked for its exit status and the contract: one PASS / FAIL / SKIP line per
step, every step passing but those that only a GPU can run, the results in summary.txt,
and at most a few small files under $OUT (the device tool's limits: <= 8 files, each
< 16 MiB, <= 2 folders deep), the scratch directory gone.
"""

import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.helpers import untracked

pytestmark = pytest.mark.slow  # every test here launches processes

REPO = Path(__file__).resolve().parents[1]
STEPS = [line.split()[0] for line in
         (REPO / "benchmarks" / "gpu" / "steps.tsv").read_text().splitlines()
         if line.strip() and not line.startswith("#")]
# The steps a CPU cannot run, and why the script says so.
GPU_ONLY = {"memory_snapshot": "needs a GPU", "implicit_gpu_tests": "CPU CI runs these"}
COMMAND = "TIER=all bash benchmarks/gpu_check.sh"  # docs/benchmarks.md's first command


@pytest.mark.skipif(shutil.which("timeout") is None or shutil.which("tar") is None,
                    reason="gpu_check.sh needs coreutils timeout and tar")
def test_smoke_steps_pass_and_outputs_fit_the_device_limits(tmp_path):
    assert COMMAND in (REPO / "docs" / "benchmarks.md").read_text()
    before = untracked()
    (tmp_path / "tmp").mkdir()
    out_dir = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a reader runs it
    env.update(SMOKE="1", OUT=str(out_dir), TMPDIR=str(tmp_path / "tmp"))
    out = subprocess.run(["bash", "-c", COMMAND], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert untracked() == before, "gpu_check.sh left files in the checkout"
    lines = re.findall(r"^(PASS|FAIL|SKIP) (\w+): (.*)$", out.stdout, re.MULTILINE)
    verdicts = {name: (v, why) for v, name, why in lines}
    assert sorted(verdicts) == sorted(STEPS)
    for step, (verdict, why) in verdicts.items():
        if step in GPU_ONLY:
            assert verdict == "SKIP" and GPU_ONLY[step] in why, (step, verdict, why)
        else:
            assert verdict == "PASS", (step, verdict, why)

    results = out_dir / "gpu_check"
    summary = (results / "summary.txt").read_text()
    assert "PASS mfu_llama_1b" in summary
    assert re.search(r"profile of one step: [\d.]+ ms wall", summary)
    assert "time to the first step" in summary and "planner (most loaded rank)" in summary
    assert re.search(r"MFU [\d.]+% of the dense bf16 peak 989", summary)

    files = [p for p in out_dir.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == ["cluster_report.md", "logs.tar.gz",
                                             "step_times.tsv", "summary.txt",
                                             "trace_llama_1b.json.gz"]
    times = (results / "step_times.tsv").read_text().splitlines()[1:]
    assert [row.split("\t")[0] for row in times] == [s for s in STEPS], times
    assert "Layout tuning" in (results / "cluster_report.md").read_text()
    assert all(p.stat().st_size < 16 * 2**20 for p in files)
    assert all(len(p.relative_to(out_dir).parts) <= 2 for p in files)
    assert not list((tmp_path / "tmp").glob("gpu_check.*"))  # the scratch directory is gone
    with tarfile.open(results / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith("mfu_llama_1b.log") for n in names)
    assert not any("ckpt_" in n for n in names)
