"""Qwen 3.5 MoE (``qwen3_5_moe``): every layer's MLP is a softmax top-k router over routed experts plus a
shared expert behind a sigmoid gate. The routed experts form their own component, so the config can place
them apart from the rest of the layer."""

from __future__ import annotations

from .qwen3_5 import MLP_TENSORS, Qwen3_5


class Qwen3_5Moe(Qwen3_5):
    model_type = "qwen3_5_moe"

    def mlp_tensors(self) -> list[str]:
        shared = [f"mlp.shared_expert.{n}" for n in MLP_TENSORS]
        return ["mlp.gate.weight", *shared, "mlp.shared_expert_gate.weight"]

    def expert_tensors(self) -> list[str]:
        return [f"mlp.experts.{e}.{n}" for e in range(self.args.num_experts) for n in MLP_TENSORS]
