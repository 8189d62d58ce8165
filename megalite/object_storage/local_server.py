"""An S3-compatible server on this machine, as a process: moto's standalone server
(`pip install megalite[dev]`), which the tests and benchmarks/object_storage_throughput.py
reach over HTTP through the same client code that talks to AWS.

    with s3_server() as env:      # env: AWS_ENDPOINT_URL and dummy credentials
        os.environ.update(env)

Imports neither torch nor boto3: a benchmark's smoke run starts in a second.
"""

import os
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from typing import Iterator

from megalite.network import free_port

DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_DEFAULT_REGION": "us-east-1"}


def wait_for_http(url: str, process: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no server answered at {url} (exit code {process.poll()})")
            time.sleep(0.05)


@contextmanager
def s3_server(server_env: dict[str, str] | None = None) -> Iterator[dict[str, str]]:
    """moto's server on a free port of 127.0.0.1 for the block (`server_env` added to its
    environment: INITIAL_NO_AUTH_ACTION_COUNT=0 makes it check credentials); yields the
    environment that points boto3 at it."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                str(port)], env={**os.environ, **(server_env or {})},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{endpoint}/moto-api/", process)
        yield {"AWS_ENDPOINT_URL": endpoint, **DUMMY_CREDENTIALS}
    finally:
        process.kill()
        process.wait()
