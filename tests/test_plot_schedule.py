"""tools/plot_schedule.py (issue 16): the timeline it draws is the simulator's, box for
box; the PNG is written when matplotlib (the optional `plot` extra) is installed, and a
clear error says how to get it when it is not."""

import sys

import pytest

from tests.helpers import load_tool



@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("1f1b", 2), ("gpipe", 1), ("zb-h1", 1)])
def test_timeline_boxes_are_the_schedule_on_the_clock(schedule, v):
    tool = load_tool("plot_schedule")
    costs = (2, 3, 1)
    boxes, sim = tool.timeline(schedule, 4, 8, v, costs)
    split = schedule == "zb-h1"
    length = {"forward": 2, "backward": 3 if split else 4, "weight": 1}
    for rank in range(4):
        mine = sorted((b for b in boxes if b.rank == rank), key=lambda b: b.start)
        assert len(mine) == 8 * v * (3 if split else 2)
        assert all(b.end - b.start == length[b.kind] for b in mine)
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:]))  # one at a time
        assert sum(b.end - b.start for b in mine) == sim.busy == 8 * v * 6
    assert max(b.end for b in boxes) == sim.makespan


def test_zb_h1_timeline_by_hand():
    # p=4, F=B=W=1: rank 0 runs F0..F3 at 0..4, then waits for B0 to come back through
    # ranks 3, 2, 1 (F0 reaches rank 3 at 3; its B0 at 4, rank 2's at 5, rank 1's at 6).
    boxes, sim = load_tool("plot_schedule").timeline("zb-h1", 4, 8)
    first_b = min(b.start for b in boxes if b.rank == 0 and b.kind == "backward")
    assert first_b == 7
    assert sim.makespan - sim.busy == 3  # (p-1)(F+B-W)


def test_png_is_written(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the 'plot' extra) is not installed")
    out = tmp_path / "zb.png"
    assert load_tool("plot_schedule").main(["--schedule", "zb-h1", "--pp", "2",
                                            "--microbatches", "4", "--output", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["zb.png"]  # no partial file left


def test_missing_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit, match=r"megalite\[plot\]"):
        load_tool("plot_schedule").main(["--output", str(tmp_path / "x.png")])
    assert not list(tmp_path.iterdir())


def test_bad_layout_is_a_config_error(tmp_path, capsys):
    assert load_tool("plot_schedule").main(["--schedule", "zb-h1", "--chunks", "2",
                             "--output", str(tmp_path / "x.png")]) == 1
    assert "--num-layers-per-virtual-pipeline-stage" in capsys.readouterr().err
