"""benchmarks/gpu_check.sh in SMOKE mode (tiny, on the CPU): the script's output contract.

tests/test_doc_commands.py runs every step in SMOKE mode (the commands of
docs/benchmarks.md) and checks their exit status. This test runs only the step that writes
every kind of output (planner, run_pretrain with its profile and trace, parse_log) and
checks the contract: one PASS / FAIL / SKIP line per step, the results in summary.txt, and
at most a few small files under $OUT (the device tool's limits: <= 8 files, each < 16 MiB,
<= 2 folders deep), the scratch directory gone.
"""

import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here launches processes

REPO = Path(__file__).resolve().parents[1]
STEPS = ["env_info", "gpu_tests", "kernels", "matmul_peak", "train_350m", "mfu_table",
         "mfu_llama_1b", "checkpoint_resume", "torchrun_nccl", "fsdp_offload", "megatron_load",
         "ring_attention", "zero_bubble", "memory_snapshot", "mfu_gpt_1b3",
         "mfu_llama_1b_compiled", "implicit_gpu_tests"]
RUN = ["mfu_llama_1b"]


@pytest.mark.skipif(shutil.which("timeout") is None or shutil.which("tar") is None,
                    reason="gpu_check.sh needs coreutils timeout and tar")
def test_smoke_steps_pass_and_outputs_fit_the_device_limits(tmp_path):
    (tmp_path / "tmp").mkdir()
    out_dir = tmp_path / "out"
    env = dict(os.environ, SMOKE="1", OUT=str(out_dir), STEPS=" ".join(RUN),
               TMPDIR=str(tmp_path / "tmp"), PYTHONPATH=str(REPO))
    out = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    verdicts = {name: v for v, name in re.findall(r"^(PASS|FAIL|SKIP) (\w+):", out.stdout,
                                                  re.MULTILINE)}
    assert sorted(verdicts) == sorted(STEPS)
    assert {s: verdicts[s] for s in RUN} == {s: "PASS" for s in RUN}
    assert all(verdicts[s] == "SKIP" for s in STEPS if s not in RUN)

    results = out_dir / "gpu_check"
    summary = (results / "summary.txt").read_text()
    assert "PASS mfu_llama_1b" in summary
    assert re.search(r"profile of one step: [\d.]+ ms wall", summary)
    assert "time to the first step" in summary and "planner (most loaded rank)" in summary
    assert re.search(r"MFU [\d.]+% of the dense bf16 peak 989", summary)

    files = [p for p in out_dir.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == ["logs.tar.gz", "summary.txt",
                                             "trace_llama_1b.json.gz"]
    assert all(p.stat().st_size < 16 * 2**20 for p in files)
    assert all(len(p.relative_to(out_dir).parts) <= 2 for p in files)
    assert not list((tmp_path / "tmp").glob("gpu_check.*"))  # the scratch directory is gone
    with tarfile.open(results / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith("mfu_llama_1b.log") for n in names)
    assert not any("ckpt_" in n for n in names)
