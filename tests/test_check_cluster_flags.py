"""tools/check_cluster.py refuses, before any check runs, what would make its result
meaningless or lost (issue #46): a --layouts pattern that names no layout (the check would
run over none and pass), and an --output-dir or --checkpoint-dir it cannot write into (it
would fail after the checks, without their report). In this process, at world size 1."""

import pytest

from megalite.cluster_check.correctness import check_layout_patterns
from megalite.errors import ConfigError

from tests.helpers import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("check_cluster")


def test_a_layout_pattern_that_names_nothing_is_refused(tool, tmp_path, capsys):
    assert tool.main(["--output-dir", str(tmp_path), "--checks", "correctness",
                      "--layouts", "Tp2*"]) == 2
    out, err = capsys.readouterr()
    assert "error: --layouts 'Tp2*' matches no layout at world size 1 (names are " \
           "case-sensitive); the layouts are: '1'" in err, err
    assert "check_cluster: correctness" not in out and not (tmp_path / "REPORT.md").exists()


def test_only_the_patterns_that_name_nothing_are_named(tool):
    with pytest.raises(ConfigError) as error:
        check_layout_patterns(["TP2*", "Tp4*", "DP4"], 4)
    message = str(error.value)
    assert message.startswith("--layouts 'Tp4*' matches no layout at world size 4"), message
    assert "'TP2 x DP2'" in message and "'TP4'" in message and "'DP4 ZeRO-1'" in message
    check_layout_patterns(["TP2*", "DP4"], 4)


@pytest.mark.parametrize("flag", ["--output-dir", "--checkpoint-dir"])
def test_a_directory_that_is_a_file_is_refused_before_any_check(tool, tmp_path, capsys, flag):
    a_file = tmp_path / "taken"
    a_file.write_text("a file")
    dirs = {"--output-dir": str(tmp_path / "report"), flag: str(a_file)}
    assert tool.main([*(word for item in dirs.items() for word in item),
                      "--checks", "correctness"]) == 2
    out, err = capsys.readouterr()
    assert f"error: {flag} {a_file}: {a_file} is a file, not a directory" in err, err
    assert "check_cluster: correctness" not in out
