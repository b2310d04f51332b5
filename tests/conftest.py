import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels are tested in Triton's CPU interpreter, which must be chosen
# before triton is first imported (tests/attention/test_triton.py says why).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# test helpers that live next to the tests (tests/run_helpers.py, tests/attention/paper_cases.py)
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "attention"))

from run_helpers import make_tiny_corpus  # noqa: E402


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A small byte-level corpus, prepared once per session, for the tests that train."""
    return make_tiny_corpus(tmp_path_factory)


@pytest.fixture
def one_thread():
    """torch at one intra-op thread for the test, restored after: pinned bits (CPU reductions split
    by thread count) and many small ops (where threads cost more than they give) both want it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
