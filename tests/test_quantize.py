"""``lumen quantize``: FP8 (HF block layout) and NVFP4 (ModelOpt layout) checkpoints that Lumen loads back."""

from __future__ import annotations

import json
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
import torch

import lumen_core as lumen
from lumen_core.checkpoint.hf import HFCheckpoint
from lumen_core.cli import main
from lumen_core.quantize import dequantize_fp8, dequantize_nvfp4, quantize_fp8, quantize_nvfp4

PROMPT = list(range(5, 45))
TEXT = ("The quick brown fox jumps over the lazy dog. The engine loads the weights from disk, places each layer "
        "on a device, and runs the prompt through the network.")
# |nll(quantized) - nll(f32)| in nats per token on a random tiny model; measured ~0.02 (fp8), ~0.06 (nvfp4).
NLL_BOUND = {"fp8": 0.1, "nvfp4": 0.5}


def cli(*args):
    try:
        main(["quantize", *map(str, args)])
    except SystemExit as exc:
        return exc.code
    return 0


def logits_of(path):
    engine = lumen.load({"model": {"path": str(path)}}, progress=False)
    return engine, engine.model.forward(PROMPT, engine.model.new_cache(64), all_logits=True)


def write_dequantized(qdir, dst):
    """An f32 checkpoint holding the values the quantized one stands for (the independent reference)."""
    ckpt = HFCheckpoint(qdir)
    block = (ckpt.config["quantization_config"].get("weight_block_size") or [0])[0]
    out = {}
    for name in ckpt.tensors:
        if name.endswith(("_scale_inv", "_scale", "_scale_2")):
            continue
        w = ckpt.read(name)
        if name + "_scale_inv" in ckpt.tensors:
            w = dequantize_fp8(w, ckpt.read(name + "_scale_inv"), block)
        elif name + "_scale_2" in ckpt.tensors:
            w = torch_nvfp4(w, ckpt.read(name + "_scale"), ckpt.read(name + "_scale_2"))
        out[name] = np.asarray(w, np.float32)
    shutil.copytree(qdir, dst)
    (dst / "config.json").write_text(json.dumps({k: v for k, v in ckpt.config.items() if k != "quantization_config"}))
    _save_raw(out, dst / "model.safetensors")
    return dst


def _save_raw(tensors: dict, path):
    """f32 safetensors written by hand (the layout: 8-byte header length, JSON header, raw bytes)."""
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr, np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def torch_nvfp4(packed, scale, scale_2):
    """NVFP4 dequantization written independently of Lumen's: bit arithmetic on torch tensors."""
    p = torch.from_numpy(np.array(packed)).to(torch.int32)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(p.shape[0], -1)  # low nibble first
    sign = 1.0 - 2.0 * ((codes >> 3) & 1).to(torch.float32)
    exp, man = (codes >> 1) & 3, (codes & 1).to(torch.float32)
    mag = torch.where(exp == 0, man * 0.5, (1.0 + man * 0.5) * torch.pow(2.0, (exp - 1).to(torch.float32)))
    s = torch.from_numpy(np.array(scale).view(np.uint8)).view(torch.float8_e4m3fn).to(torch.float32)
    vals = (sign * mag).reshape(p.shape[0], -1, 16) * s[..., None]
    return (vals * float(np.asarray(scale_2).reshape(()))).reshape(p.shape[0], -1).numpy()


@pytest.fixture(scope="module")
def quantized(tiny_checkpoint, tmp_path_factory):
    """(kind, fmt) -> (source, quantized dir, dequantized f32 dir), each built once."""
    built = {}

    def get(kind, fmt):
        if (kind, fmt) not in built:
            src = tiny_checkpoint(kind)
            root = tmp_path_factory.mktemp(f"{kind}-{fmt}")
            assert cli("--input", src, "--output", root / "q", "--format", fmt, "--block", 32) == 0
            built[kind, fmt] = src, root / "q", write_dequantized(root / "q", root / "deq")
        return built[kind, fmt]

    return get


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("kind", ["qwen3_5", "gemma3"])
def test_quantized_checkpoint_matches_its_dequantized_values(quantized, kind, fmt, capsys):
    src, q, deq = quantized(kind, fmt)
    engine, ours = logits_of(q)
    _, ref = logits_of(deq)
    _, full = logits_of(src)
    diff = np.abs(ours - ref).max()
    print(f"{kind} {fmt}: max |logit - dequantized-f32 logit| = {diff:.2e}; vs the f32 model "
          f"{np.abs(ours - full).max():.3f} (logit range {np.ptp(full):.2f})")
    assert diff <= 1e-5
    assert not engine.report.unused
    mlp = engine.weights[("layer", 0)]
    w = next(v for k, v in mlp.items() if k.endswith("mlp.gate_proj.weight"))
    assert w.format == fmt and w.shape == (128, 64)
    if fmt == "nvfp4":
        assert w.data.dtype == np.uint8 and w.data.shape == (128, 32) and w.scale.block.shape == (128, 4)
        assert w.nbytes == 128 * 32 + 128 * 4 + 4
    else:
        assert w.data.dtype == ml_dtypes.float8_e4m3fn and w.block == (32, 32)
    entry = next(e for e in engine.plan.entries if e.component == "layers.0")
    assert entry.format == fmt
    f32 = next(e for e in lumen.load({"model": {"path": str(src)}}, progress=False).plan.entries
               if e.component == "layers.0")
    assert entry.nbytes < f32.nbytes / (3.5 if fmt == "fp8" else 6)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("kind", ["qwen3_5", "gemma3"])
def test_perplexity_stays_close(quantized, kind, fmt):
    src, q, _ = quantized(kind, fmt)
    base = lumen.load({"model": {"path": str(src)}}, progress=False).perplexity(TEXT)
    ours = lumen.load({"model": {"path": str(q)}}, progress=False).perplexity(TEXT)
    print(f"{kind} {fmt}: perplexity f32 {base['perplexity']:.2f} -> {ours['perplexity']:.2f} "
          f"(nll {base['nll']:.4f} -> {ours['nll']:.4f})")
    assert abs(ours["nll"] - base["nll"]) <= NLL_BOUND[fmt]


def test_layout_and_config(quantized):
    src, q8, _ = quantized("qwen3_5", "fp8")
    _, q4, _ = quantized("qwen3_5", "nvfp4")
    c8, c4 = HFCheckpoint(q8), HFCheckpoint(q4)
    assert c8.config["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32], "activation_scheme": "dynamic",
        "modules_to_not_convert": ["lm_head", "model.embed_tokens"]}
    qc = c4.config["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"], qc["group_size"]) == ("modelopt", "NVFP4", 16)
    name = "model.layers.0.mlp.down_proj.weight"  # (64, 128)
    assert (c8.tensors[name].dtype, c8.tensors[name].shape) == ("F8_E4M3", (64, 128))
    assert (c8.tensors[name + "_scale_inv"].dtype, c8.tensors[name + "_scale_inv"].shape) == ("F32", (2, 4))
    assert (c4.tensors[name].dtype, c4.tensors[name].shape) == ("U8", (64, 64))
    assert (c4.tensors[name + "_scale"].dtype, c4.tensors[name + "_scale"].shape) == ("F8_E4M3", (64, 8))
    assert (c4.tensors[name + "_scale_2"].dtype, c4.tensors[name + "_scale_2"].shape) == ("F32", ())
    for c in (c8, c4):  # embeddings, norms and the head keep their type; tokenizer files come along
        assert c.tensors["model.embed_tokens.weight"].dtype == "F32"
        assert c.tensors["model.norm.weight"].dtype == "F32" and c.tensors["lm_head.weight"].dtype == "F32"
        assert (c.path / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_moe_router_skip_and_shards(tiny_checkpoint, tmp_path, capsys):
    src = tiny_checkpoint("qwen3_5_moe")
    out = tmp_path / "q"
    assert cli("--input", src, "--output", out, "--format", "nvfp4", "--skip", r"self_attn\.o_proj",
               "--max-shard-size", "100KB") == 0
    err = capsys.readouterr().err
    assert "MoE router" in err and "--skip" in err
    ckpt = HFCheckpoint(out)
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 1
    assert ckpt.tensors["model.layers.3.mlp.gate.weight"].dtype == "F32"
    assert ckpt.tensors["model.layers.3.mlp.shared_expert_gate.weight"].dtype == "F32"
    assert ckpt.tensors["model.layers.3.self_attn.o_proj.weight"].dtype == "F32"
    assert ckpt.tensors["model.layers.3.mlp.experts.5.up_proj.weight"].dtype == "U8"
    engine, ours = logits_of(out)
    _, ref = logits_of(write_dequantized(out, tmp_path / "deq"))
    assert np.abs(ours - ref).max() <= 1e-5


def test_fp8_round_trip_error():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((200, 300)) * np.exp(rng.uniform(-6, 2, (200, 1)))).astype(np.float32)
    q, s = quantize_fp8(w, 128)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.shape == (2, 3)
    big = np.repeat(np.repeat(s, 128, 0), 128, 1)[:200, :300]
    err = np.abs(dequantize_fp8(q, s, 128) - w)
    rel = (err / np.maximum(np.abs(w), 1e-30))[np.abs(w) >= big * 2.0 ** -6]  # e4m3 normals
    sub = np.abs(w) < big * 2.0 ** -6
    print(f"fp8 round trip: max relative error {rel.max():.4f} (bound 2^-4 = 0.0625), mean {rel.mean():.4f}; "
          f"subnormals: max error / scale {(err / big)[sub].max():.5f} (bound 2^-10 = 0.00098)")
    assert rel.max() <= 2.0 ** -4 + 1e-6
    assert np.all(err <= big * 2.0 ** -10 + np.abs(w) * 2.0 ** -4 + 1e-12)


def test_nvfp4_round_trip_error():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 256)) * np.exp(rng.uniform(-3, 1, (64, 16))).repeat(16, axis=1)).astype(np.float32)
    packed, scale, scale_2 = quantize_nvfp4(w)
    assert packed.shape == (64, 128) and scale.shape == (64, 16) and scale.dtype == ml_dtypes.float8_e4m3fn
    assert np.isclose(scale_2, np.abs(w).max() / (6 * 448))
    eff = np.repeat(scale.astype(np.float32) * scale_2, 16, axis=1)  # the effective scale of each value
    deq = dequantize_nvfp4(packed, scale, scale_2)
    err = np.abs(deq - w)
    x = np.abs(w) / eff
    half_step = np.select([x <= 2, x <= 4], [0.25, 0.5], 1.0)  # half the E2M1 spacing around x
    clipped = np.maximum(np.abs(w) - 6 * eff, 0)  # e4m3 rounding of the block scale may push |x| past 6
    bound = half_step * eff + clipped
    blocks = np.abs(w).reshape(64, 16, 16).max(-1).repeat(16, 1)
    print(f"nvfp4 round trip: max error / effective scale {(err / eff).max():.3f} (bound 1 = half the top "
          f"E2M1 step), max error / block amax {(err / blocks).max():.3f}, "
          f"relative RMS {np.sqrt((err ** 2).mean() / (w ** 2).mean()):.4f}")
    assert np.all(err <= bound * (1 + 1e-6))
    assert np.all(err <= blocks / 6 * (1 + 2.0 ** -4) + 1e-12)


def test_cpu_nvfp4_dequantization_matches_torch_reference():
    from lumen_cpu.backend import CPUBackend
    from lumen_cpu.nvfp4 import dequantize, embedding_nvfp4, linear_nvfp4

    rng = np.random.default_rng(2)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    packed, scale, scale_2 = quantize_nvfp4(w)
    weight = CPUBackend("cpu", None).weight(packed, "nvfp4", "ram", scale=(scale, scale_2), shape=(48, 96))
    ref = torch_nvfp4(packed, scale, scale_2)
    assert np.array_equal(dequantize(weight), ref)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    assert np.allclose(linear_nvfp4(x, weight), x @ ref.T, rtol=1e-5, atol=1e-5)
    assert np.array_equal(embedding_nvfp4([4, 0, 47], weight), ref[[4, 0, 47]])
    # every one of the 16 codes in both nibbles: 0x10 * hi + lo
    every = np.arange(256, dtype=np.uint8).reshape(16, 16)
    ones = np.full((16, 2), 1.0, ml_dtypes.float8_e4m3fn)
    grid = CPUBackend("cpu", None).weight(every, "nvfp4", "ram", scale=(ones, np.float32(1)), shape=(16, 32))
    assert np.array_equal(dequantize(grid), torch_nvfp4(every, ones, np.float32(1)))
    assert list(dequantize(grid)[0, 0:16:2]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_cli_errors(tiny_checkpoint, tmp_path, capsys):
    src = tiny_checkpoint("qwen3_5")
    assert cli("--input", tmp_path / "nope", "--output", tmp_path / "o", "--format", "fp8") == 2
    assert "input checkpoint not found" in capsys.readouterr().err
    assert cli("--input", src, "--output", tmp_path / "o", "--format", "int3") == 2
    assert "unknown format 'int3'; choose one of: fp8, nvfp4" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep")
    assert cli("--input", src, "--output", tmp_path / "busy", "--format", "fp8") == 2
    assert "already exists and is not empty; pass --force" in capsys.readouterr().err
    assert cli("--input", src, "--output", tmp_path / "o", "--format", "fp8", "--skip", "(") == 2
    assert "--skip is not a valid regular expression" in capsys.readouterr().err
    assert cli("--input", src, "--output", src, "--format", "fp8", "--force") == 2
    assert "--output must differ from --input" in capsys.readouterr().err
    assert cli("--input", src, "--output", tmp_path / "busy", "--format", "fp8", "--force") == 0
    assert (tmp_path / "busy" / "model.safetensors").exists()
    assert cli("--input", tmp_path / "busy", "--output", tmp_path / "again", "--format", "nvfp4") == 2
    assert "already quantized (quant_method 'fp8')" in capsys.readouterr().err
