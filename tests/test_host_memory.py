"""host_memory.keep_freed_host_memory against the kernel's own count of page faults."""

import json
import os
import statistics
import subprocess
import sys

import pytest

from megalite.host_memory import keep_freed_host_memory

# nanoGPT's baby model (benchmarks/nanogpt_baseline.py), 15 training steps in a fresh process
# (malloc's state is per process); prints the minor page faults of each step after the fifth.
STEPS = """
import json, resource, sys, torch
from megalite.host_memory import keep_freed_host_memory
from megalite.config import GPTConfig
from megalite.model.gpt import GPTModel
if sys.argv[1] == "keep":
    assert keep_freed_host_memory()
torch.set_num_threads(1)
model = GPTModel(GPTConfig(num_layers=4, hidden_size=128, ffn_hidden_size=512,
                           num_attention_heads=4, kv_channels=32, num_query_groups=4,
                           seq_length=64, max_position_embeddings=64, padded_vocab_size=65,
                           attention_dropout=0.0, hidden_dropout=0.0), seed=0)
optimizer = torch.optim.AdamW(model.parameters())
tokens = torch.randint(0, 65, (12, 64), generator=torch.Generator().manual_seed(0))
faults = []
for _ in range(15):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(tokens, tokens).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults[5:]))
"""


# glibc's initial thresholds (128 KiB), set so that its dynamic adjustment stays off: left on,
# the first large free raises them and, depending on the heap's layout, a run may keep its
# memory by chance (1 of 3 default runs faulted 1 page a step, the others 1,100-1,900).
GLIBC_DEFAULTS = {"MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_MMAP_THRESHOLD_": "131072"}


def _faults_per_step(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if mode == "default":
        env.update(GLIBC_DEFAULTS)
    done = subprocess.run([sys.executable, "-c", STEPS, mode], env=env, capture_output=True,
                          text=True, check=True)
    return statistics.median(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.slow  # two fresh processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux)")
def test_training_steps_stop_faulting_freed_memory_back_in():
    """With glibc's default thresholds the steps of a small model fault thousands of pages
    back in each (freed activations returned to the kernel); once megalite has set malloc to
    keep them, a step faults almost none."""
    kept, default = _faults_per_step("keep"), _faults_per_step("default")
    assert kept <= 10 < default, (kept, default)


def test_the_users_own_malloc_settings_are_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert keep_freed_host_memory() is False
