import sys
from pathlib import Path

import pytest

# test helpers that live next to the tests (tests/run_helpers.py, tests/attention/paper_cases.py)
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "attention"))

from run_helpers import make_tiny_corpus  # noqa: E402


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A small byte-level corpus, prepared once per session, for the tests that train."""
    return make_tiny_corpus(tmp_path_factory)
