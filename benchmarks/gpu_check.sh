#!/usr/bin/env bash
# One GPU check of the fused Triton flash attention, sized for a 15-minute device budget:
#   1. tests/attention/test_triton.py on the GPU (compiled kernels, TRITON_INTERPRET unset;
#      includes the GPU-only tests: bf16 at T=1024 against torch SDPA, speed vs the PyTorch path)
#   2. benchmarks/gpu_attention.py: fwd+bwd TFLOP/s, triton none / safe vs SDPA flash,
#      head dims 64 and 128, T = 1k..16k, causal and not (expected 1-3 minutes)
# The two steps are capped at 240 s and 300 s, so the whole script stays under the device's
# 10-minute command limit: run it with timeout_s of about 590.
# Results go to $OUT (default ./gpu_results): gpu_check.json (summary), triton_tests.log,
# triton_tests.xml, gpu_attention.json, gpu_attention.log, nvidia-smi.txt.
#
#   bash benchmarks/gpu_check.sh                 # on the device machine: OUT is set there
#   OUT=/tmp/res PYTHON=python3 bash benchmarks/gpu_check.sh
#
# Needs python with torch (CUDA) and triton and pytest; installs nothing (the device machine
# reaches no registry). Uses the source tree through PYTHONPATH=src.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
start=$(date +%s)

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed" >> "$OUT/nvidia-smi.txt"
"$PY" - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import platform, torch
try:
    import triton; tv = triton.__version__
except Exception as e:
    tv = f"not importable: {e}"
print(f"python {platform.python_version()} torch {torch.__version__} triton {tv} "
      f"cuda {torch.cuda.is_available()} {torch.cuda.get_device_name() if torch.cuda.is_available() else ''}")
EOF

echo "== tests/attention/test_triton.py (GPU) =="
timeout 240 "$PY" -m pytest -q -rs tests/attention/test_triton.py -p no:cacheprovider \
    --junitxml="$OUT/triton_tests.xml" 2>&1 | tee "$OUT/triton_tests.log"
test_rc=$?
tests_s=$(( $(date +%s) - start ))

echo "== benchmarks/gpu_attention.py =="
timeout 300 "$PY" benchmarks/gpu_attention.py --json "$OUT/gpu_attention.json" 2>&1 | tee "$OUT/gpu_attention.log"
bench_rc=$?
total_s=$(( $(date +%s) - start ))

"$PY" - "$OUT" "$test_rc" "$bench_rc" "$tests_s" "$total_s" <<'EOF'
import json, sys
from pathlib import Path
out, test_rc, bench_rc, tests_s, total_s = Path(sys.argv[1]), *map(int, sys.argv[2:])
log = (out / "triton_tests.log").read_text(errors="replace").strip().splitlines() if (out / "triton_tests.log").exists() else []
summary = {
    "env": (out / "env.txt").read_text().strip() if (out / "env.txt").exists() else None,
    "tests_rc": test_rc, "tests_summary": log[-1] if log else None, "tests_seconds": tests_s,
    "benchmark_rc": bench_rc, "total_seconds": total_s,
}
bench = out / "gpu_attention.json"
if bench.exists():
    summary["benchmark_summary"] = json.loads(bench.read_text()).get("summary")
(out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
EOF
rm -f "$OUT/env.txt"  # folded into gpu_check.json (at most 8 files come back from the device)
exit $(( test_rc != 0 || bench_rc != 0 ))
