#!/bin/bash
# One device run: install the repo's packages (no deps, no network there), run the CUDA tests, a CPU sanity run
# and the tiny benchmark; logs go to $OUT. Carried wheels (.whl, see docs/cuda.md) fill what the image lacks.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import cupy, torch, transformers; print('cupy', cupy.__version__, 'torch', torch.__version__, \
'transformers', transformers.__version__)"
  for p in gguf jsonschema referencing rpds-py jsonschema-specifications hatchling editables numba ml_dtypes \
    tokenizers pluggy typer jinja2 tqdm safetensors; do python3 -m pip show -q "$p" >/dev/null 2>&1 || echo "missing: $p"; done
} 2>&1 | tee "$OUT/env.log"
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -3; fi
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/lumen-cpu -e plugins/models-qwen \
  -e plugins/models-gemma -e plugins/lumen-cuda 2>&1 | tail -5 | tee "$OUT/install.log"
timeout ${T_CUDA:-300} python3 -m pytest tests/test_cuda.py -q -rsP -p no:cacheprovider --durations=8 2>&1 \
  | tee "$OUT/test_cuda.log" | tail -40
timeout ${T_MODELS:-120} python3 -m pytest tests/test_models.py -q -x -p no:cacheprovider 2>&1 \
  | tee "$OUT/test_models.log" | tail -8
timeout ${T_BENCH:-90} python3 plugins/lumen-cuda/scripts/tiny_bench.py 32 2>&1 | tee "$OUT/bench.log" | tail -12
