#!/bin/bash
# One device run: install the repo's packages (no deps, no network there), run every CUDA and wgpu test file, then
# the end-to-end benchmark; logs go to $OUT. Carried wheels (.whl, docs/cuda.md "Running the GPU suite": cffi and
# pycparser for wgpu-py among them) fill what the image lacks; the Vulkan loader for the wgpu tests comes as .deb
# files in .gl (docs/wgpu.md), unpacked here; the wgpu tests must find the GPU's Vulkan adapter
# (LUMEN_REQUIRE_WGPU=1: a missing one fails them).
#   T_TESTS (s, default 330), TESTS (default: every tests/test_cuda*.py and tests/test_wgpu*.py), PYTEST_ARGS (e.g.
#   "-n 15 --dist loadfile" with pytest-xdist and execnet among the carried wheels: ~2600 tests, more than 250 s on
#   an H100 in the twenty-sixth session, so give T_TESTS 330 or more), BENCH_ARGS (benchmarks/cuda_models.py
#   arguments; BENCH=0 skips it), T_BENCH (s, default 240).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import cupy, torch, transformers; print('cupy', cupy.__version__, 'torch', torch.__version__, \
'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.log"
if ls .gl/*.deb >/dev/null 2>&1; then for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig; fi
# the NVIDIA driver's Vulkan ICD and EGL vendor files, where the loader does not find them itself (seen on H200 machines)
ICD=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$ICD" ]; then
  export VK_DRIVER_FILES=$ICD __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
fi
export LUMEN_REQUIRE_WGPU=1
if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -3; fi
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/lumen-cpu -e plugins/models-qwen \
  -e plugins/models-gemma -e plugins/lumen-cuda -e plugins/lumen-wgpu 2>&1 | tail -5 | tee "$OUT/install.log"
TESTS=${TESTS:-$(ls tests/test_cuda*.py tests/test_wgpu*.py)}
timeout ${T_TESTS:-330} python3 -m pytest $TESTS ${PYTEST_ARGS:-} -q -rfEs -p no:cacheprovider --durations=10 2>&1 \
  | tee "$OUT/tests.log" | grep -v "^SKIPPED\|PASSED" | tail -60
if [ "${BENCH:-1}" != 0 ]; then
  timeout ${T_BENCH:-240} python3 benchmarks/cuda_models.py ${BENCH_ARGS:---models 9b-bf16 --layers 8 --prompts 512} \
    --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -20
fi
