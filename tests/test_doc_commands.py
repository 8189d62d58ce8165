"""Every command docs/ shows is run in CI, so the pages cannot rot.

guide.md and troubleshooting.md: tests/test_docs.py runs their commands and checks what
they print (quoted errors, planner totals, equal losses). The ```bash blocks of every other
page (benchmarks.md, architecture.md, ...) run here, each line as written, in the
checkout, with SMOKE=1 in the environment: every benchmark then runs all its steps at a
tiny size (benchmarks/common/smoke.py) and stops non-zero when a measured figure breaks the
closed form it is printed next to. A command passes when it exits 0 and leaves nothing
behind in the checkout. Every fenced block of docs/ is labelled `bash` or `text`, so a
command cannot hide in an unlabelled block.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import untracked

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CHECKED_ELSEWHERE = {"guide.md", "troubleshooting.md"}  # tests/test_docs.py
# Commands another test runs and checks more closely (the same line, the same way).
RUN_ELSEWHERE = {"TIER=all bash benchmarks/gpu_check.sh": "tests/test_gpu_check_smoke.py",
                 # the H200 run's command (then every step): the tier core of the above
                 "BUDGET_S=480 bash benchmarks/gpu_check.sh": "tests/test_gpu_check_smoke.py",
                 # one step of the script, which the smoke test runs with all the others
                 "STEPS=fp8 bash benchmarks/gpu_check.sh": "tests/test_gpu_check_smoke.py",
                 "STEPS=fp8 FP8_MAX_LAYERS=8 bash benchmarks/gpu_check.sh":
                     "tests/test_gpu_check_smoke.py",
                 'STEPS="env_info gpu_tests matmul_peak mfu_llama_1b mfu_llama_1b_eager" bash '
                 'benchmarks/gpu_check.sh': "tests/test_gpu_check_smoke.py",
                 # the same steps; under SMOKE the smoke test's mfu_llama_1b runs compiled
                 # layers already (the flag this line adds to mfu_gpt_1b3)
                 'EXTRA_PERF_FLAGS=--compile-layers STEPS="env_info gpu_tests matmul_peak '
                 'mfu_gpt_1b3 mfu_llama_1b" BUDGET_S=260 bash benchmarks/gpu_check.sh':
                     "tests/test_gpu_check_smoke.py",
                 # SMOKE=1 makes it the 12-fault campaign, whose outcomes that test checks
                 "python tools/chaos.py --faults 225 --seed 46 --output-dir /tmp/chaos-46":
                     "tests/test_chaos.py"}


def fenced(text: str) -> list[tuple[str, str]]:
    """(label, body) of each fenced block."""
    return re.findall(r"^```(\S*)\n(.*?)^```", text, re.S | re.M)


def page_commands(page: Path) -> list[str]:
    """The command lines of a page's bash blocks, continuation lines joined."""
    return [line.strip() for label, body in fenced(page.read_text()) if label == "bash"
            for line in body.replace("\\\n", " ").splitlines()
            if line.strip() and not line.strip().startswith("#")]


COMMANDS = [(page.name, i, command) for page in sorted(DOCS.glob("*.md"))
            if page.name not in CHECKED_ELSEWHERE
            for i, command in enumerate(page_commands(page)) if command not in RUN_ELSEWHERE]


def test_every_fenced_block_is_labelled():
    labels = {(page.name, label) for page in DOCS.glob("*.md")
              for label, _ in fenced(page.read_text())}
    assert {label for _, label in labels} <= {"bash", "text"}, sorted(labels)


def test_the_pages_show_commands():
    """The extraction finds the benchmark commands (a regex gone wrong would pass nothing)."""
    pages = {page for page, _, _ in COMMANDS}
    assert "benchmarks.md" in pages and len(COMMANDS) >= 20, COMMANDS


@pytest.mark.slow
@pytest.mark.parametrize("page,command", [(p, c) for p, _, c in COMMANDS],
                         ids=[f"{p}:{i}" for p, i, _ in COMMANDS])
def test_command_runs(page, command, tmp_path):
    before = untracked()
    # No PYTHONPATH: a reader runs the command in the checkout with megalite installed.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(SMOKE="1", OUT=str(tmp_path / "out"), TMPDIR=str(tmp_path))
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    output = done.stdout[-6000:] + done.stderr[-4000:]
    assert done.returncode == 0, f"{page}: {command}\n{output}"
    assert untracked() == before, f"{page}: {command} left files in the checkout"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_pages_resolve():
    """Every relative link of README.md and docs/ names a file that exists and, with a
    #fragment, a heading of that file."""
    broken = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: outside the repo
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            headings = ({anchor(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(),
                                                          re.M)}
                        if linked.suffix == ".md" and linked.exists() else set())
            if not linked.exists() or (fragment and fragment not in headings):
                broken.append(f"{page.name}: {target}")
    assert not broken, broken
