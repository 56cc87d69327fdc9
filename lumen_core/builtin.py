"""What the core itself registers, through the same hooks a plugin uses."""

from .hookspecs import hookimpl


@hookimpl
def register_checkpoint_formats(register):
    register("hf-safetensors", _is_dir, "lumen_core.checkpoint.hf:open_hf")
    register("gguf", _is_gguf, "lumen_core.checkpoint.gguf:open_gguf")


def _is_dir(path) -> bool:
    return path.is_dir()


def _is_gguf(path) -> bool:
    """A file that starts with the GGUF magic, or any ``*.gguf`` file (the reader then names what is wrong)."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


# GGUF block formats (llama.cpp's GGML types, lower case): (values per block, bytes per block, description)
GGUF_FORMATS = {
    "q4_0": (32, 18, "4-bit, one f16 scale per 32 values"),
    "q4_1": (32, 20, "4-bit, f16 scale and minimum per 32 values"),
    "q5_0": (32, 22, "5-bit, one f16 scale per 32 values"),
    "q5_1": (32, 24, "5-bit, f16 scale and minimum per 32 values"),
    "q8_0": (32, 34, "8-bit, one f16 scale per 32 values"),
    "q2_k": (256, 84, "2-bit k-quant, 256-value super-blocks"),
    "q3_k": (256, 110, "3-bit k-quant, 256-value super-blocks"),
    "q4_k": (256, 144, "4-bit k-quant, 256-value super-blocks of 8 scaled sub-blocks with minimums"),
    "q5_k": (256, 176, "5-bit k-quant, 256-value super-blocks of 8 scaled sub-blocks with minimums"),
    "q6_k": (256, 210, "6-bit k-quant, 256-value super-blocks of 16 scaled sub-blocks"),
    "iq2_xxs": (256, 66, "2-bit i-quant (lattice codebook)"),
    "iq2_xs": (256, 74, "2-bit i-quant (lattice codebook)"),
    "iq2_s": (256, 82, "2-bit i-quant (lattice codebook)"),
    "iq3_xxs": (256, 98, "3-bit i-quant (lattice codebook)"),
    "iq3_s": (256, 110, "3-bit i-quant (lattice codebook)"),
    "iq1_s": (256, 50, "1.5-bit i-quant"),
    "iq1_m": (256, 56, "1.75-bit i-quant"),
    "iq4_nl": (32, 18, "4-bit non-linear levels, one f16 scale per 32 values"),
    "iq4_xs": (256, 136, "4-bit non-linear levels, 256-value super-blocks"),
    "tq1_0": (256, 54, "ternary (1.69 bits)"),
    "tq2_0": (256, 66, "ternary (2 bits)"),
    "mxfp4": (32, 17, "OCP MX FP4 (e2m1), one e8m0 scale per 32 values"),
}


NVFP4_BYTES_PER_VALUE = 0.5 + 1 / 16  # 0.5625


@hookimpl
def register_quant_formats(register):
    register("f32", 4, "IEEE float32")
    register("f16", 2, "IEEE float16")
    register("bf16", 2, "bfloat16")
    register("fp8", 1, "FP8 E4M3 with per-tensor, per-channel or 128x128 block scales (HF weight_scale_inv)")
    # 4-bit value + one 1-byte scale per 16 values = 4.5 bits; the 4-byte global scale per tensor is not counted
    register("nvfp4", NVFP4_BYTES_PER_VALUE,
             "NVFP4 (ModelOpt): E2M1 4-bit values, one FP8 E4M3 scale per 16 values and an FP32 global scale per "
             "tensor (4.5 bits a value)")
    for name, (block, nbytes, description) in GGUF_FORMATS.items():
        register(name, nbytes / block, f"GGUF {name.upper()}: {description}")
