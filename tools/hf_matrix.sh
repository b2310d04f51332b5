#!/usr/bin/env bash
# tests/integrations (flashguard inside Hugging Face transformers) against the transformers
# versions users have: the lowest supported 4.x (pyproject: transformers>=4.54) and the newest 5.x,
# each in a virtual environment of its own, made on the first run and reused after.
#
#   tools/hf_matrix.sh            # both
#   tools/hf_matrix.sh 4          # transformers 4.54.* only
#   tools/hf_matrix.sh 5 -k readme   # newest 5.x only; further arguments go to pytest
#
# Needs Python >= 3.10 (PYTHON, default python3) and PyPI (pip's own configuration applies: an
# index or a wheel folder set in pip.conf / PIP_* is used as it is). torch is pinned to the tested
# release, 2.13.0; pip takes the CPU build where pip is configured to find one, else PyPI's
# (a CUDA build, several GB). The environments live in HF_MATRIX_DIR (default
# ~/.cache/flashguard/hf-matrix). One run of pytest per version, one thread each
# (OMP_NUM_THREADS=1 unless set). Exit status: 0 when every version passed, else the last failure's.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
DIR=${HF_MATRIX_DIR:-${HOME}/.cache/flashguard/hf-matrix}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

spec() {
    case "$1" in
        4) echo "transformers==4.54.*" ;;
        5) echo "transformers>=5,<6" ;;
        *) echo "unknown version '$1' (expected 4 or 5)" >&2; return 2 ;;
    esac
}

versions=(4 5)
if [[ $# -gt 0 && ( "$1" == 4 || "$1" == 5 ) ]]; then
    versions=("$1"); shift
fi

status=0
for v in "${versions[@]}"; do
    req=$(spec "$v") || exit 2
    venv="$DIR/transformers-$v"
    echo "== $req in $venv"
    if [[ ! -x "$venv/bin/python" ]]; then
        mkdir -p "$DIR" && "$PYTHON" -m venv "$venv" || { status=1; continue; }
    fi
    if ! "$venv/bin/python" -m pip install -q "torch==2.13.0" -e ".[dev]" "$req"; then
        echo "== $req: install failed" >&2; status=1; continue
    fi
    "$venv/bin/python" -c "import torch, transformers; print('== torch', torch.__version__, '/ transformers', transformers.__version__)"
    "$venv/bin/python" -m pytest -q tests/integrations "$@"
    rc=$?
    echo "== $req: pytest exit status $rc"
    [[ $rc -ne 0 ]] && status=$rc
done
exit $status
