import sys
from pathlib import Path

# test helpers that live next to the tests (e.g. tests/attention/paper_cases.py)
sys.path.insert(0, str(Path(__file__).parent / "attention"))
