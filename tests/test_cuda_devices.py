"""Why a cuda:N device cannot be used, as the user is told it: CuPy not installed (with the command that installs
it), CuPy installed but finding no driver or GPU, or an index past the GPUs there are. CPU only: the backend's one
``import cupy`` (``lumen_cuda.backend._import_cupy``) is replaced by a failing import or a stand-in module, so these
run the same on a machine with or without a GPU. Never through sys.modules or builtins.__import__: on the GPU
machine the real CuPy and torch are loaded in the same process, and hiding them breaks later imports there."""

from __future__ import annotations

import types

import pytest

from lumen_core.errors import ConfigError, PlanError
from lumen_core.plugins import get_registry

pytest.importorskip("lumen_cuda")

MISSING = "CuPy is not installed: pip install -e 'plugins/lumen-cuda[cuda13]' (or [cuda12])"


@pytest.fixture
def cuda():
    return get_registry().backend_class("cuda")


IMPORT = "lumen_cuda.backend._import_cupy"


def importing(monkeypatch, result) -> None:
    """The backend's ``import cupy`` returns ``result``, or raises it when it is an exception."""

    def stand_in():
        if isinstance(result, BaseException):
            raise result
        return result

    monkeypatch.setattr(IMPORT, stand_in)


@pytest.fixture
def no_cupy(monkeypatch):
    """``import cupy`` fails as on a machine where it is not installed."""
    importing(monkeypatch, ModuleNotFoundError("No module named 'cupy'", name="cupy"))


def fake_cupy(count=None, error: Exception | None = None) -> types.ModuleType:
    """A stand-in for CuPy whose runtime counts ``count`` GPUs (H200s, 141 GB each), or raises ``error``."""

    def get_device_count():
        if error is not None:
            raise error
        return count

    class Device:
        def __init__(self, index):
            self.mem_info = (100 << 30, 141 << 30)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    runtime = types.SimpleNamespace(
        getDeviceCount=get_device_count,
        getDeviceProperties=lambda i: {"name": b"NVIDIA H200", "major": 9, "minor": 0},
    )
    cp = types.ModuleType("cupy")
    cp.__version__ = "14.2.0"
    cp.cuda = types.SimpleNamespace(runtime=runtime, Device=Device)
    return cp


def test_cupy_missing_is_named_with_the_command_that_installs_it(cuda, no_cupy):
    assert cuda.devices() == []
    with pytest.raises(PlanError) as info:
        cuda.device_info("cuda:0")
    message = str(info.value)
    assert message.startswith(MISSING)
    assert "pip install 'lumen-cuda[cuda13]'" in message  # the distribution, for when it is on PyPI


def test_a_cuda_config_without_cupy_names_cupy_in_validate(no_cupy, tiny_checkpoint, write_config, capsys):
    """What ``lumen validate --config X`` prints for ``compute: cuda:0`` where lumen-cuda is installed without
    CuPy (this machine, as the issue found it): the missing CuPy and its install command, exit status 2."""
    from lumen_core.cli import main

    config = write_config({"model": {"path": str(tiny_checkpoint("qwen3_5")), "compute": "cuda:0",
                                     "store": "vram"}})
    capsys.readouterr()  # what building the checkpoint printed
    with pytest.raises(SystemExit) as exit_:
        main(["validate", "--config", str(config)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith(f"lumen: error: config model: {MISSING}"), err
    assert "Traceback" not in err


def test_a_cuda_config_without_cupy_is_refused_by_load(no_cupy, tiny_checkpoint):
    import lumen_core as lumen

    with pytest.raises(ConfigError, match=r"CuPy is not installed: pip install -e 'plugins/lumen-cuda\[cuda13\]'"):
        lumen.load({"model": {"path": str(tiny_checkpoint("qwen3_5")), "compute": "cuda:0", "store": "vram"}},
                   progress=False)


def test_cupy_that_cannot_load_says_so(cuda, monkeypatch):
    """CuPy is there but fails to import (a wheel for a CUDA this machine lacks): not 'not installed'."""
    importing(monkeypatch, ImportError("libnvrtc.so.13: cannot open shared object file",
                                       name="cupy_backends.cuda.libs.nvrtc"))
    with pytest.raises(PlanError) as info:
        cuda.device_info("cuda:0")
    message = str(info.value)
    assert "CuPy is installed but cannot be imported" in message and "libnvrtc.so.13" in message
    assert "pip install -e 'plugins/lumen-cuda[cuda13]'" in message


def test_cupy_without_a_driver_or_gpu_says_so(cuda, monkeypatch):
    error = RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
    importing(monkeypatch, fake_cupy(error=error))
    assert cuda.devices() == []
    with pytest.raises(PlanError) as info:
        cuda.device_info("cuda:0")
    message = str(info.value)
    assert message.startswith("CuPy 14.2.0 is installed but finds no CUDA driver or GPU")
    assert "cudaErrorNoDevice" in message and "nvidia-smi" in message
    assert "not installed" not in message


def test_a_device_index_past_the_gpus_names_how_many_there_are(cuda, monkeypatch):
    importing(monkeypatch, fake_cupy(count=2))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cuda.device_info("cuda:1").description == "NVIDIA H200, sm_90"
    with pytest.raises(PlanError) as info:
        cuda.device_info("cuda:3")
    assert str(info.value) == "device 'cuda:3' does not exist; this machine has 2 GPUs (cuda:0 to cuda:1)"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    importing(monkeypatch, fake_cupy(count=1))
    with pytest.raises(PlanError, match=r"has 1 GPU \(cuda:0\), as CUDA_VISIBLE_DEVICES='1' shows it"):
        cuda.device_info("cuda:1")


def test_a_device_index_past_the_gpus_in_a_config(cuda, monkeypatch, tiny_checkpoint, write_config, capsys):
    from lumen_core.cli import main

    importing(monkeypatch, fake_cupy(count=1))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = write_config({"model": {"path": str(tiny_checkpoint("qwen3_5")), "compute": "cuda:3",
                                     "store": "vram"}})
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["validate", "--config", str(config)])
    err = capsys.readouterr().err
    assert "config model: device 'cuda:3' does not exist; this machine has 1 GPU (cuda:0)" in err, err
    assert "CuPy" not in err


def test_the_backend_itself_names_the_install_without_cupy(cuda, no_cupy):
    with pytest.raises(RuntimeError, match=r"needs CuPy\. CuPy is not installed: pip install -e"):
        cuda("cuda:0", get_registry())
