#!/usr/bin/env bash
# The GPU check, self-contained for an H100/H200 machine with no network:
#
#   benchmarks/gpu_check.sh [--wheels DIR] [--python PYTHON] [options of python -m benchmarks.gpu_check...]
#
# --wheels DIR    install the wheels in DIR (diffusers, torchao, peft, ... carried by the caller) into a private
#                 folder first, without the network and without touching the machine's packages; default: .whl
#                 when that folder exists, else use what is installed
# --python PATH   the interpreter that has a CUDA torch (default: python3)
# Every other option goes to python -m benchmarks.gpu_check (see its --help): by default the full-depth FLUX.1-dev
# transformer at 1024², 28 steps, 512 T5 tokens, a new rank-64 adapter before each of 5 timed requests, the variants
# bare, fused, fp8_bare and fp8_fused in that order, each within its cap, all within 540 s. The last thing printed is
# one JSON object; --out FILE keeps it too, updated after each variant.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
python="${PYTHON:-python3}"
wheels=""
[[ -d "$root/.whl" ]] && wheels="$root/.whl"
passthrough=()

usage() { sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m benchmarks.gpu_check --help ;;
        --wheels)
            [[ $# -ge 2 ]] || { echo "gpu_check.sh: --wheels needs a folder" >&2; exit 2; }
            wheels="$2"; shift 2 ;;
        --wheels=*) wheels="${1#--wheels=}"; shift ;;
        --python)
            [[ $# -ge 2 ]] || { echo "gpu_check.sh: --python needs an interpreter" >&2; exit 2; }
            python="$2"; shift 2 ;;
        --python=*) python="${1#--python=}"; shift ;;
        *) passthrough+=("$1"); shift ;;
    esac
done

if [[ -n "$wheels" ]]; then
    [[ -d "$wheels" ]] || { echo "gpu_check.sh: --wheels $wheels is not a folder" >&2; exit 2; }
    shopt -s nullglob
    files=("$wheels"/*.whl)
    shopt -u nullglob
    if [[ ${#files[@]} -gt 0 ]]; then
        site="${TMPDIR:-/tmp}/loraswap-gpu-check-site"
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "${files[@]}" >&2
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
# $root for `-m benchmarks.gpu_check` from any working directory (relative --out paths stay the caller's).
export PYTHONPATH="$root:$root/server/src:$root/client/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$python" -m benchmarks.gpu_check ${passthrough[@]+"${passthrough[@]}"}
