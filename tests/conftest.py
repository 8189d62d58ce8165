"""pytest fixtures over tests/helpers.py, for tests that prefer a fixture to an import, and
the `slow` marker of the tests that launch processes.

The shared values and functions themselves live in tests/helpers.py, which spawned
distributed workers can import by name (a conftest cannot be imported that way).
"""

import multiprocessing.context
import subprocess

import pytest

from tests.helpers import BASE_FLAGS, tiny_gpt_config


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: launches processes (ranks, torchrun, "
                            "pretrain_gpt.py, a tool, Slurm); the fast part alone: "
                            "-m 'not slow'")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A test not marked slow that starts a process (a subprocess, or ranks spawned by
    megalite.spawn) fails, so -m "not slow" stays fast as tests are added."""
    if item.get_closest_marker("slow"):
        yield
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{item.nodeid} launches a process: mark it @pytest.mark.slow")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse)
        patch.setattr(multiprocessing.context.SpawnProcess, "start", refuse)
        yield


@pytest.fixture
def base_flags() -> list[str]:
    """A fresh copy of BASE_FLAGS, free to mutate."""
    return list(BASE_FLAGS)


@pytest.fixture(name="tiny_gpt_config")
def tiny_gpt_config_fixture():
    """The factory tiny_gpt_config(**overrides) -> GPTConfig."""
    return tiny_gpt_config
