"""A fault campaign (docs/design.md §26): a tiny pretrain_gpt.py job (2 layers, 2 ranks, DP 2
with ZeRO-1, gloo on the CPU) trained under its restart policy, with faults injected from a
seeded schedule, several per run; every run's final checkpoint compared value for value
with the fault-free run's.

    python tools/chaos.py --faults 24 --seed 1 --output-dir chaos-report

Policies, in turn per run: torchrun --max-restarts 3; two elastic agents (c10d rendezvous
on tools/rendezvous_store.py) of which a lost one is replaced; a Slurm-style requeue
(torchrun --max-restarts 0, the same command run again). Every policy is requeued when
torchrun itself ends before the last iteration (a killed agent, restarts used up, a
graceful stop). Faults (megalite/chaos/faults.py): SIGKILL in a step's forward, backward,
gradient reduction or optimizer step, in a synchronous, asynchronous or non-persistent save,
before the publish or the tracker, in a load; SIGKILL of a rank or the agent;
SIGTERM to the job and SIGUSR1 to a rank (--exit-signal-handler: save and exit); a hung
rank (SIGSTOP; --distributed-timeout-minutes ends the collectives waiting for it); a
corrupted, truncated or deleted checkpoint file or tracker; a full disk in a save
(RLIMIT_FSIZE lowered in the rank); a truncated dataset .bin or .idx; a NaN in a gradient.

Writes report.json (every fault's record) and report.md (the table by class) to
--output-dir, each run's job log under run_NNN/. Exit status 1 on any outcome other than
survived, clear-error or not-injected (megalite/chaos/report.py says what each means).

SMOKE=1 (benchmarks/smoke.py's convention): whatever the command asks, the campaign CI
runs (tests/test_chaos.py): 12 faults, one of each of SMOKE_KINDS (every class but the hung
rank, which torchrun's 30 s wait before it kills a stopped worker makes the dearest), in
three runs of four under --max-restarts and the requeue.
"""

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from megalite.chaos.campaign import RunDriver, Settings
from megalite.chaos.faults import BY_NAME, KINDS, POLICIES, RunPlan, schedule
from megalite.chaos.report import (FAILURES, build_dataset, checkpoint_values, classify,
                                   differences, markdown, summarize)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=24, help="Faults in the campaign.")
    p.add_argument("--seed", type=int, default=1, help="Seed of the schedule.")
    p.add_argument("--faults-per-run", type=int, default=3,
                   help="Faults injected one after another in one run (one job).")
    p.add_argument("--kinds", default=",".join(k.name for k in KINDS),
                   help="Comma-separated kinds of fault (megalite/chaos/faults.py).")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"Restart policies, taken in turn: {', '.join(POLICIES)}.")
    p.add_argument("--train-iters", type=int, default=None,
                   help="Iterations of each run (default: 10 per fault of a run, at least 24).")
    p.add_argument("--hang-timeout-minutes", type=float, default=0.25,
                   help="--distributed-timeout-minutes of the job: how long a hung rank "
                        "holds the others (default 0.25, 15 s).")
    p.add_argument("--output-dir", required=True, help="Where the runs and the report go.")
    args = p.parse_args(argv)
    unknown = [k for k in args.kinds.split(",") if k not in BY_NAME]
    if unknown:
        p.error(f"--kinds: unknown {unknown}; known: {', '.join(BY_NAME)}")
    bad = [x for x in args.policies.split(",") if x not in POLICIES]
    if bad:
        p.error(f"--policies: unknown {bad}; known: {', '.join(POLICIES)}")
    if args.faults < 1 or args.faults_per_run < 1:
        p.error("--faults and --faults-per-run must be >= 1")
    return args


SMOKE_KINDS = ("kill_backward", "kill_optimizer", "kill_async_write", "kill_publish",
               "kill_load", "kill_rank", "kill_agent", "sigterm_job", "corrupt_file",
               "disk_full", "truncate_bin", "nan_grad")


def smoke(args: argparse.Namespace) -> argparse.Namespace:
    if os.environ.get("SMOKE", "0") == "1":
        args.faults, args.faults_per_run, args.train_iters = len(SMOKE_KINDS), 4, 30
        args.kinds, args.policies = ",".join(SMOKE_KINDS), "restarts,requeue"
        print(f"SMOKE=1: the CI campaign ({args.faults} faults: {args.kinds})", flush=True)
    return args


def run_campaign(out: Path, seed: int, n_faults: int, per_run: int, settings: Settings,
                 kinds=KINDS, policies=POLICIES, say=print) -> dict:
    """The reference run, then every run of the schedule; returns the report (JSON)."""
    out.mkdir(parents=True, exist_ok=True)
    data = build_dataset(out / "data" / "chaos_text_document")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    start = time.time()
    RunDriver(RunPlan(-1, "requeue", False, False), out / "reference", data, settings,
              env).run()
    reference = checkpoint_values(out / "reference" / "ckpt")
    say(f"reference run: {time.time() - start:.0f} s")
    records = []
    for plan in schedule(seed, n_faults, per_run, kinds, policies):
        driver = RunDriver(plan, out / f"run_{plan.index:03d}", data, settings, env)
        try:
            done = driver.run()
            finished = driver.finished()
            different = (differences(reference, checkpoint_values(driver.save)) if finished
                         else [])
            classify(done, plan.faults, finished, different)
        except Exception:  # the campaign's own bug: reported, and the next run goes on
            say(traceback.format_exc())
            done, different = driver.records, []
            for record in done:
                record.outcome = "tool-error"
        records += done
        say(f"run {plan.index} ({plan.policy}, async {plan.async_save}, local "
            f"{plan.local}): " + ", ".join(f"{r.kind} -> {r.outcome}" for r in done)
            + (f"; differs in {different[:5]}" if different else ""))
    return {"seed": seed, "faults": n_faults, "faults_per_run": per_run,
            "settings": vars(settings), "seconds": time.time() - start,
            "summary": summarize(records), "records": [r.as_json() for r in records]}


def _exit_on_sigterm(signum, _frame):
    raise SystemExit(128 + signum)  # the runs' `finally` ends their jobs


def main(argv=None) -> int:
    args = smoke(parse(argv))
    out = Path(args.output_dir)
    settings = Settings(train_iters=args.train_iters or max(24, 10 * args.faults_per_run),
                        timeout_minutes=args.hang_timeout_minutes)
    kinds = [BY_NAME[k] for k in args.kinds.split(",")]
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        report = run_campaign(out, args.seed, args.faults, args.faults_per_run, settings,
                              kinds, tuple(args.policies.split(",")))
    finally:
        signal.signal(signal.SIGTERM, previous)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    command = " ".join(["python", "tools/chaos.py", *(sys.argv[1:] if argv is None else argv)])
    (out / "report.md").write_text(markdown(report["summary"],
                                            f"Fault campaign: `{command}`"))
    print((out / "report.md").read_text())
    failed = sum(report["summary"]["total"]["outcomes"].get(k, 0) for k in FAILURES)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
