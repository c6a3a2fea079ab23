#!/usr/bin/env bash
# The GPU suite in one command: builds the extension, runs the CUDA tests and
# every benchmark, writes JSON + PNG + gpu_suite.json into OUTDIR, and packs
# them into one gpu_suite_<gpu>_<date>.tar.gz (the last line printed names it).
#
#   benchmarks/gpu_suite.sh OUTDIR              # an NVIDIA GPU (< 10 min on one H100)
#   benchmarks/gpu_suite.sh OUTDIR --dry-run    # the CPU rehearsal (tiny grids, fake driver)
#   VATTN_GPU_SUITE_DRY_RUN=1 benchmarks/gpu_suite.sh OUTDIR
#   benchmarks/gpu_suite.sh OUTDIR --wheels DIR --archive DIR2   # carried wheels; the archive elsewhere
#
# Python: $PYTHON, else the first python3 on PATH; it needs torch, pybind11,
# pytest and matplotlib (transformers for the engine benchmark; flash-attn and
# flashinfer-python are used when importable). The stages, and which packages
# to carry to a machine without network, are described in benchmarks/gpu_suite.py.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: $0 OUTDIR [--dry-run] [--wheels DIR] [--archive DIR]" >&2
  exit 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$(command -v python3 || true)}"
if [[ -z "$python" ]]; then
  echo "$0: no python3 on PATH (set PYTHON)" >&2
  exit 2
fi
exec "$python" "$root/benchmarks/gpu_suite.py" "$@"
