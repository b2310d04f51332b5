"""Record the study's reference attention outputs as golden hashes for tests/attention.

The reference implementation (github.com/ucker/why-low-precision-training-fails,
``attention.py``) is not part of flashguard and is not vendored. To regenerate the golden
file, download that file yourself (it needs ``einops``) and run

    python tools/make_paper_golden.py --reference /path/to/attention.py

It runs each case of ``tests/attention/paper_cases.py`` through the reference code (STABLE=0
and STABLE=1) and writes SHA-256 hashes of the bf16 output and gradients, with the torch
version and CPU capability they were made on, to tests/attention/data/paper_golden.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "attention"))
import paper_cases  # noqa: E402


def load_reference(path: Path):
    spec = importlib.util.spec_from_file_location("reference_attention_module", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.FlashAttentionFunction


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", type=Path, required=True, help="path to the reference attention.py")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "attention" / "data" / "paper_golden.json")
    args = ap.parse_args()
    fn = load_reference(args.reference)
    cases = []
    for case in paper_cases.CASES:
        os.environ["STABLE"] = "1" if case["stable"] else "0"
        q, k, v, do = paper_cases.make_inputs(case)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = fn.apply(*leaves, None, case["causal"], case["block"], case["block"])
        o.backward(do)
        tensors = [o.detach()] + [t.grad for t in leaves]
        cases.append({**case, "sha256": [paper_cases.digest(t) for t in tensors]})
    payload = {"made_with": paper_cases.platform_tag(), "cases": cases}
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(args.out)
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
