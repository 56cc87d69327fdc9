"""Qwen 3.5 / 3.6 for Lumen: Gated-DeltaNet + gated full attention, dense and MoE."""

from lumen_core import hookimpl


@hookimpl
def register_architectures(register):
    for model_type in ("qwen3_5", "qwen3_5_text", "qwen35"):  # qwen35, qwen35moe: llama.cpp's GGUF names
        register(model_type, "lumen_models_qwen.qwen3_5:Qwen3_5")
    for model_type in ("qwen3_5_moe", "qwen3_5_moe_text", "qwen35moe"):
        register(model_type, "lumen_models_qwen.qwen3_5_moe:Qwen3_5Moe")


@hookimpl
def register_chat_formats(register):
    from lumen_models_qwen.chat import QWEN3_5

    for model_type in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"):
        register(model_type, format=QWEN3_5)
