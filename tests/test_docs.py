"""The commands of docs/troubleshooting.md run, and print what the page quotes.

Each `### ` section holds the messages it quotes (```text blocks) and the commands that
produce them (```bash blocks). The commands run as written (with the page's $TINY); every
quoted message must appear in what they print, and a section that quotes an error must
exit non-zero. `python pretrain_gpt.py` and `python tools/estimate_memory.py` commands run
in this process (the same entry points, minus the interpreter start-up); the rest in bash.
"""

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalite.layout_check import FP32
from megalite.training import pretrain

from tests.helpers import load_tool

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "troubleshooting.md"
GUIDE = ROOT / "docs" / "guide.md"


def blocks(text: str, kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", text, re.S)


def sections() -> dict[str, str]:
    text = PAGE.read_text()
    parts = re.split(r"^### (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def tiny() -> str:
    preamble = re.split(r"^### ", PAGE.read_text(), flags=re.M)[0]
    (definition,) = [b for b in blocks(preamble, "bash") if b.startswith("TINY=")]
    return shlex.split(definition.strip()[len("TINY="):])[0]


def commands(section: str) -> list[str]:
    """The command lines of a section's bash blocks, continuation lines joined."""
    return [line.strip() for block in blocks(section, "bash")
            for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def run(command: str) -> tuple[int, str]:
    """(exit code, stdout + stderr) of one command line of the page."""
    words = shlex.split(command.replace("$TINY", tiny()), comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    entry = {("python", "pretrain_gpt.py"): pretrain,
             ("python", "tools/estimate_memory.py"): lambda argv: load_tool(
                 "estimate_memory").main(argv),
             ("python", "tools/estimate_cost.py"): lambda argv: load_tool(
                 "estimate_cost").main(argv)}.get(tuple(words[:2]))
    if entry is None:
        done = subprocess.run(["bash", "-c", f"TINY={shlex.quote(tiny())}; {command}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, **env, "PYTHONPATH": str(ROOT)})
        return done.returncode, done.stdout + done.stderr
    out = io.StringIO()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = entry(words[2:])
    finally:
        os.chdir(cwd)
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return code, out.getvalue()


def assert_losses_agree(one_process: str, layout: str):
    """The `lm loss` of every iteration of two runs' output agrees to the fp32 contract's
    round-off, the layout tests' tolerance: a layout sums in another order, which can move
    the last printed digit."""
    ref, got = ([float(x) for x in re.findall(r"lm loss: (\S+)", out)]
                for out in (one_process, layout))
    assert ref and len(got) == len(ref), (ref, got)
    for i, (a, b) in enumerate(zip(ref, got), start=1):
        assert abs(a - b) <= FP32.step_rtol * abs(a), f"iteration {i}: {b} against {a}"


SECTIONS = sections()
ERRORS = {title: body for title, body in SECTIONS.items() if blocks(body, "text")}


@pytest.fixture(autouse=True)
def clean_scratch():
    scratch = [str(ROOT / "runs" / name) for name in ("troubleshooting", "guide")]
    subprocess.run(["rm", "-rf", *scratch], check=True)
    yield
    subprocess.run(["rm", "-rf", *scratch], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("title", list(ERRORS))
def test_quoted_message_is_what_the_command_prints(title):
    if "NCCL without a GPU" in title and torch.cuda.is_available():
        pytest.skip("a GPU is visible here: the command trains instead of failing")
    results = [run(c) for c in commands(ERRORS[title])]
    assert results, f"section {title!r} shows no command"
    output = "".join(out for _, out in results)
    for message in blocks(ERRORS[title], "text"):
        assert message.strip() in output, output
    assert results[-1][0] != 0, f"the last command of {title!r} should fail"


@pytest.mark.slow
def test_layouts_give_the_same_losses():
    """'A loss that differs between layouts': the two commands print the same losses."""
    losses = []
    for command in commands(SECTIONS["A loss that differs between layouts"]):
        code, out = run(command)
        assert code == 0, out
        losses.append(out)
    assert_losses_agree(*losses)


@pytest.mark.slow
def test_planner_commands_show_the_layout_that_does_not_fit():
    first, second = (run(c) for c in commands(SECTIONS["Out of memory after a layout change"]))
    assert first[0] == 0 and "does NOT fit" not in first[1], first[1]
    assert "does NOT fit" in second[1], second[1]


@pytest.mark.slow
def test_standalone_launch_runs():
    (command,) = commands(SECTIONS["Rendezvous failures"])
    code, out = run(command)
    assert code == 0 and "iteration        2/" in out, out


def test_every_section_with_commands_is_tested():
    tested = set(ERRORS) | {"A loss that differs between layouts",
                            "Out of memory after a layout change", "Rendezvous failures"}
    untested = [t for t, body in SECTIONS.items() if commands(body) and t not in tested]
    assert not untested, untested


@pytest.mark.slow
def test_guide_commands_run_and_print_the_totals_they_state():
    """Every command of docs/guide.md, in order (later ones use what earlier ones wrote);
    a planner command's `# total X GiB` (or the cost planner's `# on demand $X`) comment
    must be what it prints, and a layout run
    (torchrun) the losses of the one-process run before it."""
    lines, outputs = commands(GUIDE.read_text()), []
    for command in lines:
        code, out = run(command)
        assert code == 0, f"{command}\n{out}"
        stated = re.search(r"# total ([\d.]+) GiB", command)
        if stated:
            assert f"total {stated.group(1)} GiB of" in out, f"{command}\n{out}"
        cost = re.search(r"# on demand (\$[\d,.]+)$", command)
        if cost:
            assert f"= {cost.group(1)}\n" in out, f"{command}\n{out}"
        outputs.append(out)
    pairs = [(outputs[i - 1], out) for i, (command, out) in enumerate(zip(lines, outputs))
             if command.startswith("torchrun") and "pretrain_gpt.py" in command]
    assert len(pairs) == 2, "sections 4 and 7 each compare a layout with one process"
    for one_process, layout in pairs:
        assert_losses_agree(one_process, layout)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
