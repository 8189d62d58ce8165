"""pytest fixtures over tests/helpers.py, for tests that prefer a fixture to an import.

The shared values and functions themselves live in tests/helpers.py, which spawned
distributed workers can import by name (a conftest cannot be imported that way).
"""

import pytest

from tests.helpers import BASE_FLAGS, tiny_gpt_config


@pytest.fixture
def base_flags() -> list[str]:
    """A fresh copy of BASE_FLAGS, free to mutate."""
    return list(BASE_FLAGS)


@pytest.fixture(name="tiny_gpt_config")
def tiny_gpt_config_fixture():
    """The factory tiny_gpt_config(**overrides) -> GPTConfig."""
    return tiny_gpt_config
