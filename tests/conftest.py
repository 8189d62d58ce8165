"""pytest fixtures over tests/helpers.py, for tests that prefer a fixture to an import, and
the `slow` marker of the tests that launch processes.

The shared values and functions themselves live in tests/helpers.py, which spawned
distributed workers can import by name (a conftest cannot be imported that way).
"""

import multiprocessing.context
import subprocess
import uuid

import pytest

from megalite.object_storage.local_server import s3_server

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


@pytest.fixture(scope="session")
def s3_server_env():
    """moto's S3 server, a process on 127.0.0.1 for the session: the environment (endpoint,
    dummy credentials) that points boto3 at it."""
    pytest.importorskip("moto", reason="the S3 tests need moto[server]: pip install -e .[dev]")
    with s3_server() as env:
        yield env


@pytest.fixture
def s3_bucket(s3_server_env, monkeypatch) -> str:
    """A fresh bucket on the session's S3 server, this process's environment pointed at it:
    its URL, s3://<bucket>."""
    import boto3
    for key, value in s3_server_env.items():
        monkeypatch.setenv(key, value)
    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return f"s3://{name}"
