"""The registry of code only a GPU runs (DESIGN.md §19; benchmarks/gpu/device_branches.py):
every device branch in megalite/, tools/ and pretrain_gpt.py names the gpu_check.sh step that
runs it, every name is a step of benchmarks/gpu/steps.tsv, and every step there is a function
gpu_check.sh defines and exports. The scanner itself is checked on sources written here: an
untagged CUDA branch is found, a tagged one is not, a tag covers its whole statement."""

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


registry = load("device_branches")


def untagged(source: str) -> list[int]:
    return [line for line, _, steps in registry.scan(source) if not steps]


def test_every_device_branch_names_a_step_that_exists():
    found = registry.tags()
    assert "" not in found, "device branches without a `# gpu_check: <step>` tag:\n" + \
        "\n".join(found[""])
    unknown = set(found) - set(registry.steps())
    assert not unknown, {name: found[name] for name in unknown}


def test_every_step_is_a_function_of_gpu_check_sh():
    script = (REPO / "benchmarks" / "gpu_check.sh").read_text()
    defined = set(re.findall(r"^(\w+)\(\) \{", script, re.MULTILINE))
    exported = set(" ".join(re.findall(r"^export -f ([\w \\\n]+)", script, re.MULTILINE))
                   .replace("\\", " ").split())
    steps = registry.steps()
    assert set(steps) <= defined, set(steps) - defined
    assert set(steps) <= exported, set(steps) - exported
    assert {row["tier"] for row in steps.values()} == {"core", "extended"}
    # The core tier is the first command on a GPU: its limits fit 8 minutes with start-up.
    assert sum(row["limit"] for row in steps.values() if row["tier"] == "core") <= 480 - 15


def test_the_scanner_finds_an_untagged_cuda_branch_and_accepts_a_tagged_one():
    plain = 'def f(t, device):\n    if device.type == "cuda":\n        torch.cuda.synchronize()\n'
    assert untagged(plain) == [2, 3]
    above = plain.replace("    if device", "    # gpu_check: save_paths\n    if device")
    assert untagged(above) == []
    inline = plain.replace('"cuda":', '"cuda":  # gpu_check: save_paths')
    assert [steps for _, _, steps in registry.scan(inline)] == [["save_paths"]] * 2
    kernels = ("x = torch._grouped_mm(a, b)\ny = torch._scaled_mm(a, b, use_fast_accum=True)\n"
               "t.record_stream(s)\nok = torch.cuda.is_available()\n")
    assert untagged(kernels) == [1, 2, 3, 4]
    # Strings and comments may name CUDA freely; a tag covers only its own statement.
    prose = ('"""torch.cuda.Stream is not used here."""\nhelp = "torch._grouped_mm"  '
             '# torch.cuda.foo\n')
    assert untagged(prose) == []
    two = ("# gpu_check: kernels\nif device.type == 'cuda':\n    pass\n"
           "if device.type == 'cuda':\n    pass\n")
    assert untagged(two) == [4]


def test_a_tag_naming_no_step_is_reported():
    source = 'if device.type == "cuda":  # gpu_check: no_such_step\n    pass\n'
    names = {name for _, _, steps in registry.scan(source) for name in steps}
    assert names == {"no_such_step"} and not names <= set(registry.steps())


def test_the_readme_lists_each_tier_as_steps_tsv_has_it():
    readme = (REPO / "README.md").read_text()
    steps = registry.steps()
    for tier in ("core", "extended"):
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{tier}` |"))
        names = [s for s in steps if steps[s]["tier"] == tier]
        assert re.findall(r"`(\w+)`", row.split("|")[2]) == names, row
        limit = sum(steps[s]["limit"] for s in names)
        assert f"at most {limit:,} s" in row, (row, limit)
