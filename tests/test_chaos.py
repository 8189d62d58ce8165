"""The fault campaign (tools/chaos.py, megalite/chaos/): its schedule, its in-rank trigger,
its damage and the documented fixes, its oracle and outcomes in-process; then a 12-fault
campaign end to end (slow), which fails on any silent outcome and on any class that should
recover and did not."""

import json
import random
import re
import shlex
from pathlib import Path

import pytest
import torch

from megalite.chaos import campaign, faults, inject, report
from megalite.chaos.campaign import Record
from megalite.chaos.job import Job
from megalite.checkpointing import storage
from megalite.errors import CheckpointError

from tests.helpers import load_tool

ROOT = Path(__file__).resolve().parents[1]


def test_the_schedule_deals_every_kind_once_before_any_twice_into_fitting_runs():
    runs = faults.schedule(5, 2 * len(faults.KINDS) + 3, 3)
    dealt = sorted((f.id, f.kind.name) for run in runs for f in run.faults)
    assert [i for i, _ in dealt] == list(range(2 * len(faults.KINDS) + 3))
    assert {name for _, name in dealt[:len(faults.KINDS)]} == set(faults.BY_NAME)
    for run in runs:
        assert 1 <= len(run.faults) <= 3 and run.policy == faults.POLICIES[run.index % 3]
        for f in run.faults:
            assert {"sync": not run.async_save, "async": run.async_save,
                    "local": run.local, None: True}[f.kind.mode], (run, f.kind.name)
            assert f.rank == 0 if f.kind.rank0 else f.rank in (0, 1)
    again = faults.schedule(5, 2 * len(faults.KINDS) + 3, 3)
    assert [(r.policy, r.async_save, r.local, [(f.kind.name, f.rank, f.after, f.pick)
                                              for f in r.faults]) for r in runs] == \
        [(r.policy, r.async_save, r.local, [(f.kind.name, f.rank, f.after, f.pick)
                                           for f in r.faults]) for r in again]


def test_an_armed_fault_fires_once_on_its_rank_point_iteration_and_call(tmp_path):
    (tmp_path / inject.ARMED).write_text(json.dumps(
        {"id": 3, "where": "forward", "rank": 1, "iteration": 5, "occurrence": 2,
         "pick": 0.5}))
    other, chosen = inject.Injector(tmp_path, 0), inject.Injector(tmp_path, 1)
    for injector in (other, chosen):
        injector.iteration = 4
        assert injector.due("forward") is None  # too early
        injector.iteration = 5
    assert other.due("forward") is None and chosen.due("backward") is None
    assert chosen.due("forward") is None  # the first call; it fires at the second
    assert chosen.due("forward")["id"] == 3
    record = json.loads(inject.fired_path(tmp_path, 3).read_text())
    assert (record["rank"], record["iteration"], record["where"]) == (1, 5, "forward")
    assert chosen.due("forward") is None  # once ever, in this process or a restarted one
    assert inject.Injector(tmp_path, 1).due("forward") is None


def _checkpoint(save, iteration):
    staging = storage.prepare_staging(save, iteration)
    for name in ("model.pt", "optim.pt"):
        storage.save_tensor_file({"w": torch.arange(1000.0)}, staging / name)
    storage.commit(save, iteration, {"consumed_train_samples": 4 * iteration},
                   ["model.pt", "optim.pt"])


@pytest.mark.parametrize("kind", ["corrupt_file", "truncate_file", "delete_file",
                                  "garble_tracker", "delete_tracker"])
def test_damage_is_named_by_the_loader_and_the_documented_fix_resumes_older(tmp_path, kind):
    """Each damage of the newest of two checkpoints: megalite's checks (those a load runs
    before any weight is read) name the damaged file or the tracker; the fix of
    docs/troubleshooting.md leaves a checkpoint that loads, the older one."""
    save = tmp_path / "ckpt"
    _checkpoint(save, 4)
    _checkpoint(save, 8)
    pick = 0.3 if kind == "corrupt_file" else 0.9  # the flip lands in a tensor's bytes
    fault = faults.Fault(0, faults.BY_NAME[kind], 0, 1, 1, 0.0, pick)
    record = Record(0, kind, "", "requeue", 0, 0, durable=8)
    record.hit = campaign.damage(fault, save, tmp_path / "data")
    try:
        _, directory = storage.find_checkpoint_to_load(save)
        problems = [p for p in (storage.damaged_file(f) for f in directory.glob("*.pt")) if p]
        if problems:
            raise CheckpointError("; ".join(problems))
        raise AssertionError(f"{kind} of {record.hit} went unnoticed")
    except CheckpointError as error:
        record.errors.append(f"error (rank 0): {error}")
    assert campaign.names_fault(record, fault), record.errors
    record.fixed = campaign.fix(fault, record, save, tmp_path / "data", tmp_path / "pristine")
    assert storage.find_checkpoint_to_load(save)[0] == (4 if "file" in kind else 8), \
        record.fixed


def test_the_oracle_compares_bits():
    a = {"x": torch.tensor([0.0, float("nan")]), "n": 3}
    assert report.differences(a, {"x": torch.tensor([0.0, float("nan")]), "n": 3}) == []
    assert report.differences(a, {"x": torch.tensor([-0.0, float("nan")]), "n": 3}) == ["x"]
    assert report.differences(a, {"x": a["x"].double(), "n": 3, "m": 1}) == ["m", "x"]


def _record(kind, **fields):
    record = Record(0, kind, faults.BY_NAME[kind].group, "restarts", 0, 1,
                    fired_at=10.0, resumed=4, recovered_at=14.0, iteration=6, durable=4)
    for name, value in fields.items():
        setattr(record, name, value)
    return record


def test_outcomes():
    """classify against outcomes written out by hand (megalite/chaos/report.py)."""
    cases = [  # (record, finished, differing keys, expected)
        (_record("kill_rank"), True, [], "survived"),
        (_record("kill_rank"), True, ["optim.pt/main"], "silent"),
        (_record("kill_rank", resumed=2), True, [], "lost-data"),  # behind the durable 4
        (_record("sigterm_job"), True, [], "lost-data"),  # graceful, yet 6 - 4 steps lost
        (_record("nan_grad", hook_iteration=7), True, [], "unclear"),
        (_record("nan_grad", hook_iteration=7, errors=[
            "error (rank 0): iteration 7: a gradient is NaN or infinite on rank(s) [1] "
            "before the data-parallel reduction"]), True, [], "survived"),
        (_record("corrupt_file", fixed="tracker set to iteration 4"), True, [], "clear-error"),
        (_record("corrupt_file"), True, [], "survived"),  # a flip nothing reads
        (_record("kill_rank", fired_at=None), True, [], "not-injected"),
        (_record("hang_rank", state="fired"), False, [], "unrecovered"),
        (_record("truncate_bin", state="fired", hit="/d/x.bin",
                 errors=["error (rank 1): /d/x.bin: size expected"]), False, [], "clear-error"),
    ]
    for record, finished, different, expected in cases:
        kind = faults.BY_NAME[record.kind]
        fault = faults.Fault(0, kind, 1, 1, 1, 0.0, 0.5)
        report.classify([record], [fault], finished, different)
        assert record.outcome == expected, (record.kind, expected)


def docs_command(output_dir) -> list[str]:
    """The arguments of docs/benchmarks.md's `python tools/chaos.py` line, writing to
    `output_dir`."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    argv = shlex.split(re.search(r"^python tools/chaos\.py .*$", text, re.M).group(0))[2:]
    argv[argv.index("--output-dir") + 1] = str(output_dir)
    return argv


@pytest.mark.slow
def test_the_campaign_of_docs_benchmarks_at_its_ci_size(tmp_path, monkeypatch):
    """docs/benchmarks.md's campaign with SMOKE=1: 12 faults, one of each kind of
    tools/chaos.py's SMOKE_KINDS, three runs of four under torchrun --max-restarts and a
    Slurm-style requeue, against one fault-free run. Every one ends bit-identical to it, or
    (a damaged file) stopped by an error naming the damage and then, fixed as
    docs/troubleshooting.md says, bit-identical: none silent, every class that should
    recover recovered."""
    chaos = load_tool("chaos")
    monkeypatch.setenv("SMOKE", "1")
    code = chaos.main(docs_command(tmp_path))
    result = json.loads((tmp_path / "report.json").read_text())
    outcomes = {r["kind"]: r["outcome"] for r in result["records"]}
    assert sorted(outcomes) == sorted(chaos.SMOKE_KINDS)
    for kind, outcome in outcomes.items():
        expected = ("survived",) if faults.BY_NAME[kind].recovers else \
            ("clear-error", "survived")  # a damage may miss what a load reads
        assert outcome in expected, (kind, outcome, result["records"])
    assert result["summary"]["total"]["silent"] == 0 and code == 0


def test_a_campaign_seed_is_its_schedule():
    first = [(r.policy, [f.kind.name for f in r.faults]) for r in faults.schedule(46, 12, 4)]
    random.seed(0)  # the global generator plays no part
    assert first == [(r.policy, [f.kind.name for f in r.faults])
                     for r in faults.schedule(46, 12, 4)]


def test_the_steps_before_a_fault_are_counted_since_its_restart(tmp_path):
    """An earlier attempt logged up to iteration 7, then the job resumed at 4: a fault
    after iteration 5 of the resumed job has lost 1 step, not 3."""
    data = tmp_path / "data" / "x"
    data.parent.mkdir()
    for suffix in (".bin", ".idx"):
        data.with_suffix(suffix).write_bytes(b"")
    driver = campaign.RunDriver(faults.RunPlan(0, "requeue", False, False), tmp_path / "run",
                                data, campaign.Settings(), {})
    driver.starts = [(0.0, 0), (10.0, 4)]
    driver.iterations = [(1.0, 1), (2.0, 5), (3.0, 7), (11.0, 5), (12.0, 6)]
    assert driver._last_iteration_before(11.5) == 5
    assert driver._last_iteration_before(10.5) == 4
    assert driver._last_iteration_before(9.0) == 7


def test_a_local_save_cut_short_is_not_what_is_damaged(tmp_path):
    """The SIGKILL before a damage may leave a local save's `.tmp`: the bit is flipped in
    a whole file, the one a restart would read."""
    local = tmp_path / "local" / "iter_0000006"
    local.mkdir(parents=True)
    storage.save_tensor_file({"w": torch.arange(100.0)}, local / "rank_00000.pt")
    (local / "rank_00001.pt.tmp").write_bytes(b"")
    whole = (local / "rank_00000.pt").read_bytes()
    for pick in (0.1, 0.9):
        fault = faults.Fault(0, faults.BY_NAME["corrupt_local"], 0, 1, 1, 0.0, pick)
        assert campaign.damage(fault, tmp_path / "ckpt", tmp_path / "data",
                               tmp_path / "local") == str(local / "rank_00000.pt")
    assert (local / "rank_00000.pt").read_bytes() != whole


def test_a_campaign_run_under_torchrun_does_not_hand_its_launcher_to_the_job(tmp_path):
    """Every variable torchrun gives its workers (torch.distributed.run's docs list them) is
    dropped, or the job's own agents would rendezvous with the outer launch."""
    outer = {name: "1" for name in (
        "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
        "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID")}
    job = Job("restart", [], {**outer, "PATH": "/bin"}, tmp_path / "log", "t")
    job.log.close()
    assert not set(outer) & set(job.env) and job.env["PATH"] == "/bin"
