"""pretrain_gpt.py with instruments: the time to the first step, the peak memory next to the
planner's figure, and optionally a torch.profiler profile of one step.

    python benchmarks/gpu/run_pretrain.py [--profile-step N] [--trace FILE.json.gz] \\
        [--deterministic] [--compile-backend NAME] [--report-optimizer] [--die-at-step N] \\
        -- PRETRAIN_GPT_FLAGS...

It runs megalite's own pretrain() (the same code path as pretrain_gpt.py) and wraps
StepRunner.train_step, so nothing in megalite needs a profiler flag. The profiled step
synchronizes the device before the optimizer step (so kernels after that point are the
optimizer's); pick a step after the last logged interval so the log's timings are clean.
Lines starting with ">>" are the results.
"""

import argparse
import functools
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

START = time.perf_counter()  # before the imports: the time to the first step counts them
if __spec__ is None:  # run as a file: benchmarks.* and megalite from this checkout
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch  # noqa: E402

import megalite.train_step as train_step_module  # noqa: E402
from megalite.training import pretrain  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def instrument(profile_step: int | None, trace: str | None, report: bool = False,
               die_at: int | None = None):
    """Replace StepRunner.train_step by a timed (and at profile_step, profiled) one; with
    `report`, the optimizer's tensors are reported before and after the first step."""
    runner_class = getattr(train_step_module, "StepRunner", None)
    original = getattr(runner_class, "train_step", None)
    if original is None:
        print(">> note: megalite.train_step.StepRunner.train_step not found: no instruments")
        return
    calls = [0]

    def train_step(self, microbatches):
        calls[0] += 1
        if calls[0] == die_at:  # as a SIGKILL would: no save, no cleanup
            print(f">> dying at the start of step {die_at}", flush=True)
            os._exit(137)
        if report and calls[0] == 1:
            print(">> optimizer before step 1:", json.dumps(optimizer_report(self.optimizer)))
        if calls[0] == profile_step:
            result = profiled(self, original, microbatches, trace)
        else:
            result = original(self, microbatches)
        if calls[0] == 1:
            sync()
            if report:
                print(">> optimizer after step 1:", json.dumps(optimizer_report(self.optimizer)))
            print(f">> time to the first step: {time.perf_counter() - START:.1f} s from "
                  "the start of the process (imports, device init, model build, step 1)",
                  flush=True)
        return result
    runner_class.train_step = train_step


def profiled(runner, original, microbatches, trace):
    """One step under torch.profiler; a profiler that cannot start or export is reported
    and the step still runs (the run's numbers matter more than its profile)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    from benchmarks.gpu import profile_summary
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    optimizer = runner.optimizer
    step = optimizer.step

    def optimizer_step(*args, **kwargs):
        sync()  # every kernel launched from here on is the optimizer's
        with record_function(profile_summary.OPTIMIZER):
            return step(*args, **kwargs)
    sync()
    try:
        prof = profile(activities=activities)
        prof.__enter__()
    except Exception as error:  # noqa: BLE001
        print(f">> profile: the profiler did not start ({type(error).__name__}: {error})")
        return original(runner, microbatches)
    optimizer.step = optimizer_step
    try:
        with record_function(profile_summary.STEP):
            result = original(runner, microbatches)
            sync()
    finally:
        del optimizer.step
        prof.__exit__(None, None, None)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            print(profile_summary.summarise(path), flush=True)
            if trace:
                with open(path, "rb") as src, gzip.open(trace, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                size = os.path.getsize(trace) / 2**20
                if size > 15:  # what the GPU machines hand back is capped at 16 MiB a file
                    os.remove(trace)
                    print(f">> chrome trace not kept: {size:.0f} MiB compressed", flush=True)
                else:
                    print(f">> chrome trace of the step: {trace} ({size:.1f} MiB)", flush=True)
    except Exception as error:  # noqa: BLE001
        print(f">> profile: no summary ({type(error).__name__}: {error})", flush=True)
    return result


def optimizer_report(optimizer) -> dict:
    """Where the optimizer's tensors live: the main parameters it steps (fp32 copies or
    FSDP2's shards; host ones pinned or not), the model's parameters, and Adam's state
    (tensors not on their main's device counted; the step counter may be a host scalar)."""
    mains = [s.main for s in optimizer.segments]
    host = [m for m in mains if m.device.type == "cpu"]
    state = [(m, optimizer.adam.state.get(m, {})) for m in mains]
    return {"mains": len(mains), "main_devices": sorted({m.device.type for m in mains}),
            "param_devices": sorted({p.device.type for p in optimizer.params}),
            "host_mains": len(host), "pinned_host_mains": sum(m.is_pinned() for m in host),
            "mains_with_state": sum(bool(s) for _, s in state),
            "state_off_device": sum(t.device != m.device for m, s in state for t in s.values()
                                    if torch.is_tensor(t) and t.dim() > 0)}


def report_memory(flags: list[str]):
    try:
        from benchmarks.gpu.runs import planned_bytes  # after the run: its imports not timed
        plan = f"{planned_bytes(flags) / 2**30:.3g} GiB"
    except Exception as error:  # noqa: BLE001 (a planner refusal must not fail the run)
        plan = f"unavailable ({type(error).__name__}: {error})"
    if torch.cuda.is_available():
        peak = f"{torch.cuda.max_memory_allocated() / 2**30:.3g} GiB"
    else:
        peak = "n/a on the CPU"
    print(f">> peak memory allocated (torch.cuda.max_memory_allocated): {peak}; "
          f"planner (most loaded rank): {plan}", flush=True)


def main():
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile-step", type=int, default=None)
    p.add_argument("--trace", default=None, help="Where to write the gzipped chrome trace.")
    p.add_argument("--deterministic", action="store_true",
                   help="On a GPU, torch.use_deterministic_algorithms(True): no atomics in "
                        "backward (set CUBLAS_WORKSPACE_CONFIG=:4096:8 as well).")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile's backend for --compile-layers (default torch's, "
                        "inductor); SMOKE=1 uses aot_eager: the same graph capture and "
                        "AOTAutograd, eager kernels, no minute of C++ compiling on a CPU.")
    p.add_argument("--report-optimizer", action="store_true",
                   help="Print where the optimizer's tensors live before and after step 1 "
                        "(JSON): after a --load, the state it loaded.")
    p.add_argument("--die-at-step", type=int, default=None,
                   help="Exit at once (status 137, as a SIGKILL) as step N starts: what was "
                        "saved before it is all a restart has.")
    args = p.parse_args(own)
    if args.compile_backend and "--compile-layers" in flags:
        torch.compile = functools.partial(torch.compile, backend=args.compile_backend)
        print(f">> torch.compile backend: {args.compile_backend}", flush=True)
    if args.deterministic and torch.cuda.is_available():
        # Only a GPU has the atomics this forbids: the CPU kernels megalite runs are
        # deterministic already (the CPU suite's bit-exact resumes hold without it), and the
        # call imports torch._dynamo, ~2 s of every SMOKE process on a CPU.
        torch.use_deterministic_algorithms(True)
    instrument(args.profile_step, args.trace, args.report_optimizer, args.die_at_step)
    code = pretrain(flags)
    if code == 0:
        report_memory(flags)
    return code


if __name__ == "__main__":
    sys.exit(main())
