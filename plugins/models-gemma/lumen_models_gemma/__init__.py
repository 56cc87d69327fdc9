"""Gemma 3 and Gemma 4 for Lumen: interleaved sliding-window and full attention, GeGLU, four norms a layer."""

from lumen_core import hookimpl


@hookimpl
def register_architectures(register):
    for model_type in ("gemma3", "gemma3_text"):
        register(model_type, "lumen_models_gemma.gemma3:Gemma3")
    for model_type in ("gemma4", "gemma4_text"):
        register(model_type, "lumen_models_gemma.gemma4:Gemma4")


@hookimpl
def register_chat_formats(register):
    from lumen_models_gemma.chat import GEMMA3, GEMMA4

    for model_type in ("gemma3", "gemma3_text"):
        register(model_type, format=GEMMA3)
    for model_type in ("gemma4", "gemma4_text"):
        register(model_type, format=GEMMA4)
