# device call: tests + fp8 sweep + profiles (not committed)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps .whl/*.whl 2>&1 | tail -2
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/lumen-cpu -e plugins/models-qwen -e plugins/models-gemma -e plugins/lumen-cuda 2>&1 | tail -2
( python3 - > $OUT/build.log 2>&1 <<'PY'
import sys, time; sys.path.insert(0, "benchmarks")
from pathlib import Path
import cuda_models as m
w = Path("/tmp/lb")
for shape, L in (("35b-a3b", 4), ("9b", 8)):
    t = time.time(); src = m.build(shape, L, 248320, w); m.quantized(src, "fp8"); print(shape, "ready", time.time() - t)
PY
) &
BUILD=$!
timeout 280 python3 -m pytest tests/test_cuda*.py -q -x -p no:cacheprovider -n 4 2>&1 | tail -40 > $OUT/tests.log
tail -15 $OUT/tests.log
wait $BUILD; cat $OUT/build.log | grep ready
timeout 60 python3 benchmarks/cuda_gemv.py --fp8-sweep > $OUT/sweep.txt 2>&1; tail -30 $OUT/sweep.txt
timeout 70 python3 benchmarks/cuda_profile.py /tmp/lb/35b-a3b-l4-fp8 --trace --steps 32 > $OUT/prof35.txt 2>&1
timeout 70 python3 benchmarks/cuda_profile.py /tmp/lb/9b-l8-fp8 --trace --steps 32 > $OUT/prof9.txt 2>&1
head -30 $OUT/prof35.txt
