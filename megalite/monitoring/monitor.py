"""The one object the training loop talks to about monitoring (issue 17).

Per step: the profiler window, the replica check, the recovery time of a resumed run, the
watchdog that ends a rank whose step stopped progressing (watchdog.py).
Per log interval, in one all-gather over every rank: memory (the log line prints the
maximum over ranks), the straggler measure and the phase timers, which the logging rank
turns into the extra fields and lines of the log and into TensorBoard scalars.
"""

import os
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import Config
from megalite.monitoring.memory import memory_stats
from megalite.monitoring.peak_flops import compute_dtype, mfu_percent, peak_tflops
from megalite.monitoring.profiling import Profiler
from megalite.monitoring.replica_check import check_all_replicas
from megalite.monitoring.statistics import params_norm
from megalite.timers import COMPUTE, PHASES, Timers, timers_report
from megalite.monitoring.watchdog import Watchdog
from megalite.parallel_state import ParallelState, all_gather_first_dim

MIB = 2 ** 20


def process_start_time() -> float:
    """When this process started (epoch seconds), from /proc on Linux; elsewhere when
    megalite.monitoring was first imported, shortly after."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED


_IMPORTED = time.time()


@dataclass
class IntervalReport:
    """What the logging rank adds for one log interval."""
    mfu_percent: float | None = None
    memory_mib: dict[str, float] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    scalars: dict[str, float] = field(default_factory=dict)


class Monitor:
    def __init__(self, config: Config, state: ParallelState, device: torch.device,
                 model: nn.Module, optimizer, timers: Timers):
        self.m = config.monitoring
        self.state, self.device = state, device
        self.model, self.optimizer = model, optimizer
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timers = timers
        self.peak_tflops = peak_tflops(device, compute_dtype(config.precision.params_dtype),
                                       self.m.peak_tflops)
        self.hosts = None
        if self.m.log_straggler:
            self.hosts = [None] * self.world_size
            dist.all_gather_object(self.hosts, socket.gethostname())
        self.profiler = Profiler(self.m, self.rank, self.world_size, device, self.timers)
        self.watchdog = Watchdog(config.distributed.timeout_minutes * 60, self.rank)
        self.resumed = False
        """Set when a checkpoint was loaded: the first iteration then logs the recovery time."""

    # ------------------------------------------------------------------------ per step

    def before_step(self, done: int):
        self.watchdog.beat()
        self.profiler.before_step(done)

    def after_step(self, iteration: int):
        """Every rank, after each training iteration."""
        self.watchdog.beat()
        self.profiler.after_step(iteration)
        interval = self.m.check_weight_hash_across_dp_replicas_interval
        if interval and iteration % interval == 0 and self.state.dp_cp_size > 1:
            self.optimizer.finish_param_gather()
            check_all_replicas(list(self.model.named_parameters()), self.state, iteration,
                               self.device)
        if self.resumed:
            self.resumed = False
            if self.rank == 0:
                seconds = time.time() - process_start_time()
                print(f" > recovery time: {seconds:.1f} s from process start to the end of "
                      f"the first resumed iteration ({iteration})", flush=True)

    def statistics(self) -> dict[str, float | None]:
        """--log-params-norm and --log-num-zeros-in-grad, on every rank (collectives)."""
        out = {}
        if self.m.log_num_zeros_in_grad:
            out["num_zeros"] = self.optimizer.num_zeros_in_grad()
        if self.m.log_params_norm:
            self.optimizer.finish_param_gather()
            out["params_norm"] = params_norm(self.optimizer.params, self.state.tp_group,
                                             self.state.mp_group, self.state.ep_group)
        return out

    def after_log_interval(self):
        """Every rank, after each log interval's line."""
        self.profiler.after_log_interval()

    def on_out_of_memory(self):
        self.profiler.dump_memory_snapshot()

    def close(self, done: int):
        self.watchdog.close()
        self.profiler.close(done)

    # ------------------------------------------------------------------- per interval

    def interval_report(self, iters: int, tflops_per_gpu: float) -> IntervalReport:
        """Every rank, at each log interval (an all-gather); the report is whole on the
        logging (last) rank."""
        memory = memory_stats(self.device)
        names = list(PHASES)
        elapsed = self.timers.elapsed(reset=True)
        busy = sum(elapsed.get(n, 0.0) for n in COMPUTE)
        local = torch.tensor([*memory.values(), busy, *(elapsed.get(n, 0.0) for n in names)],
                             dtype=torch.float64, device=self.device)
        table = all_gather_first_dim(local[None], dist.group.WORLD).cpu()
        report = IntervalReport()
        if self.peak_tflops:
            report.mfu_percent = mfu_percent(tflops_per_gpu, self.peak_tflops)
            report.scalars["mfu-percent"] = report.mfu_percent
        for i, name in enumerate(memory):
            top = table[:, i].max().item()
            report.memory_mib[name] = top / MIB
            if self.m.log_memory_to_tensorboard:
                report.scalars[f"mem-{name.lower().replace(' ', '-')}-bytes"] = top
        k = len(memory)
        if self.m.log_straggler:
            report.lines.append(self._straggler_line(table[:, k] / iters))
        per_rank_ms = table[:, k + 1:] * 1e3 / iters
        if self.m.timing_log_level > 0:
            report.lines += timers_report(names, per_rank_ms, self.m.timing_log_option)
            if self.m.log_timers_to_tensorboard:
                for i, name in enumerate(names):
                    if (per_rank_ms[:, i] > 0).any():
                        report.scalars[f"{name}-time"] = per_rank_ms[:, i].max().item() / 1e3
        return report

    def _straggler_line(self, seconds: torch.Tensor) -> str:
        """The slowest and fastest rank by their own work per iteration (COMPUTE phases:
        data, forward, backward, optimizer; not the waits for peers, which a straggler
        imposes on everyone)."""
        slow, fast = int(seconds.argmax()), int(seconds.argmin())
        ratio = seconds[slow].item() / max(seconds[fast].item(), 1e-12)
        return (f" straggler (compute time per iteration): slowest rank {slow} "
                f"({self.hosts[slow]}) {seconds[slow].item() * 1e3:.1f} ms | fastest rank "
                f"{fast} ({self.hosts[fast]}) {seconds[fast].item() * 1e3:.1f} ms | "
                f"slowest/fastest: {ratio:.2f} |")
