"""cpu.threads: the CPU backend's compute pool (numba) starts with the configured number of threads; a pool already
running with another count is refused by name; bad values are config errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import lumen_core as lumen
from lumen_core.errors import ConfigError


def test_a_fresh_process_runs_its_cpu_kernels_on_the_configured_threads(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("gemma3")
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"model": {"path": str(path), "compute": "cpu", "store": "ram"},
                                  "cpu": {"threads": 1}}))
    script = textwrap.dedent(f"""
        import numba, numpy as np, lumen_core as lumen
        from numba import njit, prange
        engine = lumen.load({str(config)!r}, progress=False)
        cache = engine.model.new_cache(64)
        logits = engine.model.forward([1, 2, 3, 4, 5], cache)
        assert np.isfinite(logits).all()

        @njit(parallel=True)
        def ids(out):
            for i in prange(out.shape[0]):
                out[i] = numba.get_thread_id()
        out = np.zeros(64, np.int64)
        ids(out)
        print(numba.get_num_threads(), numba.config.NUMBA_NUM_THREADS, len(set(out.tolist())))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1", "1", "1"]


def test_a_running_pool_of_another_size_says_what_it_uses(tiny_checkpoint, capsys):
    import numba
    from lumen_cpu import int8

    from lumen_core.backend import Weight

    q = np.ones((64, 32), np.int8)
    w = Weight(int8.I8Data(q, np.ones((64, 1), np.float32), None), "i8", (64, 32))
    int8.linear(np.ones((1, 32), np.float32), w)  # a parallel kernel: the pool is running now
    running = numba.config.NUMBA_NUM_THREADS
    path = tiny_checkpoint("gemma3")
    try:
        lumen.load({"model": {"path": str(path)}, "cpu": {"threads": running + 1}}, progress=False)
        err = capsys.readouterr().err
        assert f"cpu.threads {running + 1}: this process's CPU thread pool already runs {running} threads" in err
        assert f"this thread uses {running}" in err and numba.get_num_threads() == running
        if running > 1:
            lumen.load({"model": {"path": str(path)}, "cpu": {"threads": 1}}, progress=False)
            assert "this thread uses 1" in capsys.readouterr().err and numba.get_num_threads() == 1
        lumen.load({"model": {"path": str(path)}, "cpu": {"threads": running}}, progress=False)
        assert "cpu.threads" not in capsys.readouterr().err
    finally:
        numba.set_num_threads(running)


@pytest.mark.parametrize("cpu,match", [({"threads": 0}, r"cpu\.threads"), ({"threads": "4"}, r"cpu\.threads"),
                                       ({"thread": 4}, r"unknown key 'thread'")])
def test_bad_cpu_blocks_are_config_errors(tiny_checkpoint, cpu, match):
    with pytest.raises(ConfigError, match=match):
        lumen.load({"model": {"path": str(tiny_checkpoint("gemma3"))}, "cpu": cpu}, progress=False)


def test_cpu_settings_without_a_cpu_component_say_they_have_no_effect(capsys):
    from lumen_core.config import load_config
    from lumen_core.engine import _configure_cpu

    class Gpu:
        name = "cuda"

        def configure_threads(self, threads):
            raise AssertionError("only the CPU backend takes cpu.threads")

    def config(cpu):
        return load_config({"model": {"path": "m"}, "cpu": cpu})

    _configure_cpu(config({"threads": 4, "compute-quantization": "int8"}), {("layer", 0): Gpu()})
    err = capsys.readouterr().err
    assert "cpu.threads (4) has no effect: no component computes on the CPU" in err
    assert "cpu.compute-quantization (int8) has no effect: no component computes on the CPU" in err
    _configure_cpu(config({}), {("layer", 0): Gpu()})
    assert capsys.readouterr().err == ""


def test_cuda_compute_quantization_goes_to_each_cuda_backend_or_says_it_has_no_effect(capsys):
    from lumen_core.config import load_config
    from lumen_core.engine import _configure_cuda

    class Backend:
        def __init__(self, name):
            self.name, self.got = name, []

        def configure_compute_quantization(self, quantization):
            self.got.append(quantization)

    config = load_config({"model": {"path": "m"}, "cuda": {"compute-quantization": "bf16"}})
    cpu, gpu = Backend("cpu"), Backend("cuda")
    _configure_cuda(config, {("layer", 0): cpu, ("layer", 1): gpu, ("layer", 2): gpu})
    assert gpu.got == ["bf16"] and cpu.got == [] and capsys.readouterr().err == ""
    _configure_cuda(config, {("layer", 0): cpu})
    assert "cuda.compute-quantization (bf16) has no effect: no component computes on cuda" in capsys.readouterr().err
    _configure_cuda(load_config({"model": {"path": "m"}}), {("layer", 0): cpu})
    assert capsys.readouterr().err == ""


def test_int8_compute_quantization_without_int8_layout_weights_says_it_has_no_effect(tiny_checkpoint, capsys):
    """The tiny Gemma 3 checkpoint is f32 safetensors: no weight is in the int8 layout, so the mode does nothing."""
    lumen.load({"model": {"path": str(tiny_checkpoint("gemma3"))}, "cpu": {"compute-quantization": "int8"}},
               progress=False)
    assert "cpu.compute-quantization (int8) has no effect" in capsys.readouterr().err
    lumen.load({"model": {"path": str(tiny_checkpoint("gemma3"))}}, progress=False)
    assert "compute-quantization" not in capsys.readouterr().err


def test_the_threads_option_sets_cpu_threads(tiny_checkpoint, tmp_path):
    """--threads N is cpu.threads from the command line (on generate, chat, serve, perplexity): a fresh process
    generates with it; 0 is refused by the option; the config copy keeps the rest of the config."""
    import shutil
    from pathlib import Path

    from lumen_core.config import load_config

    path = tiny_checkpoint("gemma3")
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"model": {"path": str(path)}, "cpu": {"threads": 2}}))
    cfg = load_config(config).with_threads(1)
    assert cfg.cpu_threads() == 1 and cfg.raw["model"]["path"] == str(path)
    assert load_config(config).with_threads(None).cpu_threads() == 2
    lumen = shutil.which("lumen") or str(Path(sys.executable).with_name("lumen"))
    ok = subprocess.run([lumen, "generate", "-c", str(config), "-p", "Hi", "-n", "2", "-q", "--threads", "1"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "Traceback" not in ok.stderr, ok.stderr
    bad = subprocess.run([lumen, "generate", "-c", str(config), "-p", "Hi", "--threads", "0"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--threads" in bad.stderr and "Traceback" not in bad.stderr


def test_compute_quantization_modes_reach_nvfp4_experts(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """NVFP4 experts on the CPU: under cpu.compute-quantization int8 one token's experts take the 8-bit path
    (lumen_cpu.native.moe_token's NVFP4_Q8); the prompt's take AMX tiles on a CPU with AMX-BF16, the tokens as three
    exact bf16 planes, or one rounded under bf16 (elsewhere the f32 path, and under bf16 a note that it does
    nothing); without the key, the exact paths; no other note."""
    from lumen_cpu import moe_fused, native

    from lumen_core.quantize import quantize_checkpoint
    from lumen_core.sampling import SamplingParams

    if not native.available:
        pytest.fail("lumen_cpu's C kernels were not built (pip install -e plugins/lumen-cpu needs a C compiler)")
    src = tiny_checkpoint("qwen3_5_moe")
    dst = tmp_path / "nvfp4"
    quantize_checkpoint(src, dst, "nvfp4", progress=False)
    seen = []
    real = native.moe_token

    def spy(fmt, *args):
        seen.append(fmt)
        return real(fmt, *args)

    monkeypatch.setattr(native, "moe_token", spy)
    amx = []
    real_gate_up = moe_fused._gate_up_nvfp4

    def gate_up_spy(*args):
        amx.append(args[-1])
        return real_gate_up(*args)

    monkeypatch.setattr(moe_fused, "_gate_up_nvfp4", gate_up_spy)
    for quant in ("int8", "none", "bf16"):
        seen.clear(), amx.clear()
        engine = lumen.load({"model": {"path": str(dst), "compute": "cpu"}, "cpu": {"compute-quantization": quant}},
                            progress=False)
        err = capsys.readouterr().err
        tokens = list(engine.generate_tokens([1, 2, 3, 4, 5], 4, SamplingParams(temperature=0.0)))
        assert len(tokens) == 4
        assert set(seen) == {native.NVFP4_Q8 if quant == "int8" else native.NVFP4}, (quant, seen)
        # the prompt's experts in AMX tiles where this CPU has them: the tokens as 3 exact bf16 planes, or 1 rounded
        # under bf16; elsewhere the f32 path (0) and, under bf16, a note that it does nothing
        assert set(amx) == {(1 if quant == "bf16" else 3) if native.level == "amx" else 0}, (quant, amx)
        noted = "cpu.compute-quantization (bf16) has no effect" in err
        assert noted == (quant == "bf16" and native.level != "amx"), err
        assert "compute-quantization" not in err or noted
    native.use("avx512vnni")  # below the amx level (or as it was): the bf16 mode has no effect, and says so
    try:
        lumen.load({"model": {"path": str(dst), "compute": "cpu"}, "cpu": {"compute-quantization": "bf16"}},
                   progress=False)
        assert "cpu.compute-quantization (bf16) has no effect" in capsys.readouterr().err
    finally:
        native.use(native.HIGHEST)


def test_bf16_compute_quantization_reaches_fp8_experts(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """fp8 experts on the CPU: on a CPU with AMX-BF16 the prompt's take AMX tiles, the tokens as three exact bf16
    planes, or one rounded under cpu.compute-quantization bf16 (elsewhere the f32 path, and a note that bf16 does
    nothing). Their numbers against a model of each: test_cpu_native (a random tiny model's near-even logits let the
    bf16 rounding change the greedy tokens, so they are not compared here)."""
    from lumen_cpu import moe_fused, native

    from lumen_core.quantize import quantize_checkpoint
    from lumen_core.sampling import SamplingParams

    src = tiny_checkpoint("qwen3_5_moe")
    dst = tmp_path / "fp8"
    quantize_checkpoint(src, dst, "fp8", progress=False)
    amx = []
    real = moe_fused._gate_up_scaled

    def spy(*args):
        amx.append(args[-1])
        return real(*args)

    monkeypatch.setattr(moe_fused, "_gate_up_scaled", spy)
    for quant in ("none", "bf16"):
        amx.clear()
        engine = lumen.load({"model": {"path": str(dst), "compute": "cpu"}, "cpu": {"compute-quantization": quant}},
                            progress=False)
        err = capsys.readouterr().err
        assert len(list(engine.generate_tokens(list(range(1, 17)), 4, SamplingParams(temperature=0.0)))) == 4
        assert amx and set(amx) == {(1 if quant == "bf16" else 3) if native.level == "amx" else 0}, (quant, amx)
        assert ("cpu.compute-quantization (bf16) has no effect" in err) == (quant == "bf16" and native.level != "amx")
