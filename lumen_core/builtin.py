"""What the core itself registers, through the same hooks a plugin uses."""

from .hookspecs import hookimpl


@hookimpl
def register_checkpoint_formats(register):
    register("hf-safetensors", _is_dir, "lumen_core.checkpoint.hf:open_hf")


def _is_dir(path) -> bool:
    return path.is_dir()


@hookimpl
def register_quant_formats(register):
    register("f32", 4, "IEEE float32")
    register("f16", 2, "IEEE float16")
    register("bf16", 2, "bfloat16")
    register("fp8", 1, "FP8 E4M3 with per-tensor, per-channel or 128x128 block scales (HF weight_scale_inv)")
