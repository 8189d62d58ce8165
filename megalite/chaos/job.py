"""One attempt of a campaign's job under its restart policy (faults.POLICIES), and its
processes as the campaign reaches them: by rank, agent or all at once.

Every process of an attempt carries $MEGALITE_CHAOS_RUN in its environment (torchrun's
workers inherit the agent's), so they are found in /proc even once their agent is dead and
they are orphans; `kill_all` ends them as Slurm ends a job step whose task died. Output of
every process, stamped with its arrival time, goes to one queue and one log file.
"""

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from megalite.network import free_port
from megalite.spawn import outside_launcher, process_environments, process_parent

TAG = "MEGALITE_CHAOS_RUN"
ROOT = Path(__file__).resolve().parents[2]


class Job:
    """The agent(s) of `policy` running pretrain (through inject.py) with `flags`."""

    def __init__(self, policy: str, flags: list[str], env: dict, log: Path, tag: str,
                 max_restarts: int = 3):
        self.policy, self.flags, self.tag = policy, flags, tag
        self.env = outside_launcher(env)
        self.env.update({TAG: tag, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        self.max_restarts = 0 if policy == "requeue" else max_restarts
        self.lines: queue.Queue = queue.Queue()
        self.log, self._log_lock = open(log, "a"), threading.Lock()
        self.agents: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []
        self.replaced: set[subprocess.Popen] = set()
        self.store = self.port = None

    # ------------------------------------------------------------------ starting

    def start(self) -> None:
        if self.policy != "elastic":
            self._agent(["--standalone", "--nproc-per-node", "2"])
            return
        self.port = free_port()
        self.store = subprocess.Popen(
            [sys.executable, "tools/rendezvous_store.py", "--port", str(self.port)],
            cwd=ROOT, env={**self.env, TAG: ""},
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.store.stdout.readline()  # "listening": the agents may connect
        for _ in range(2):
            self.start_replacement()

    def start_replacement(self) -> None:
        """An elastic node: one agent with one worker, joining the rendezvous. The agents
        do not share their rendezvous store with the workers (docs/troubleshooting.md, "A
        replaced node waits at the rendezvous"): a node that stays rendezvous rank 0
        publishes no store address for a round a new node joins."""
        self._agent(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.tag,
                     "--rdzv-conf", "is_host=0,last_call_timeout=1"])

    def _agent(self, launch: list[str]) -> None:
        command = [sys.executable, "-m", "torch.distributed.run", *launch,
                   "--max-restarts", str(self.max_restarts), "--monitor-interval", "0.1",
                   "-m", "megalite.chaos.inject", *self.flags]
        env = {**self.env, **({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
                              if self.policy == "elastic" else {})}
        proc = subprocess.Popen(command, cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.agents.append(proc)
        for stream in (proc.stdout, proc.stderr):
            reader = threading.Thread(target=self._follow, args=(stream,), daemon=True)
            reader.start()
            self.readers.append(reader)

    def _follow(self, stream) -> None:
        for line in stream:
            now = time.time()
            self.lines.put((now, line))
            with self._log_lock:
                if not self.log.closed:  # an orphan's last words after kill_all
                    self.log.write(f"{now:.3f} {line}")
                    self.log.flush()

    # ------------------------------------------------------------------ processes

    def processes(self) -> dict[int, int | None]:
        """pid -> RANK (None for an agent) of every live process of this attempt."""
        tag = self.tag.encode()
        return {pid: int(env[b"RANK"]) if b"RANK" in env else None
                for pid, env in process_environments() if env.get(TAG.encode()) == tag}

    def worker(self, rank: int) -> int | None:
        return next((pid for pid, r in self.processes().items() if r == rank), None)

    def running_agents(self) -> list[subprocess.Popen]:
        return [a for a in self.agents if a.poll() is None]

    def replace_lost_node(self) -> None:
        """Elastic: an agent killed while another runs is a lost node; the cluster gives
        a new one, which joins the rendezvous."""
        for agent in self.agents:
            if agent.poll() == -signal.SIGKILL and agent not in self.replaced and \
                    self.policy == "elastic" and self.running_agents():
                self.replaced.add(agent)
                self.start_replacement()

    def signal_rank(self, rank: int, signum: int) -> bool:
        pid = self.worker(rank)
        return pid is not None and _send(pid, signum)

    def signal_job(self, signum: int) -> bool:
        """Every process of the job, as Slurm signals a job step (preemption)."""
        return any([_send(pid, signum) for pid in self.processes()])

    def kill_agent(self, rank: int) -> bool:
        """SIGKILL the agent: under --standalone that agent alone (its workers live on,
        orphans, until `kill_all`); elastic, the node of `rank`'s worker, agent and
        workers, as losing the machine does."""
        if self.policy != "elastic":
            agents = self.running_agents()
            return bool(agents) and _send(agents[0].pid, signal.SIGKILL)
        pid = self.worker(rank)
        if pid is None:
            return False
        agent = process_parent(pid)
        node = [agent] + [w for w, r in self.processes().items()
                          if r is not None and process_parent(w) == agent]
        return any([_send(p, signal.SIGKILL) for p in node])

    def kill_all(self) -> None:
        """SIGKILL what is left of the attempt (agents, orphaned workers, the store)."""
        for pid in self.processes():
            _send(pid, signal.SIGKILL)
        if self.store is not None:
            self.store.kill()
        for proc in [*self.agents, *([self.store] if self.store else [])]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for reader in self.readers:
            reader.join(timeout=10)
        with self._log_lock:
            self.log.close()


def _send(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
        return True
    except ProcessLookupError:
        return False
