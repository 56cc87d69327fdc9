"""Qwen 3.5 MoE (``qwen3_5_moe``): every layer's MLP is a softmax top-k router over routed experts plus a
shared expert behind a sigmoid gate. The routed experts form their own component, so the config can place
them apart from the rest of the layer."""

from __future__ import annotations

from .qwen3_5 import MLP_TENSORS, Qwen3_5


class Qwen3_5Moe(Qwen3_5):
    model_type = "qwen3_5_moe"
    int_keys = {**Qwen3_5.int_keys, "num_experts": 1, "num_experts_per_tok": 1, "moe_intermediate_size": 1,
                "shared_expert_intermediate_size": 1}
    nullable_keys = frozenset({"intermediate_size"})  # the dense MLP's width: no dense MLP here

    def mlp_shapes(self, L: str) -> dict:
        a, hidden = self.args, self.args.hidden_size
        shared, moe, E = a.shared_expert_intermediate_size, a.moe_intermediate_size, a.num_experts
        s_keys, m_keys = ("shared_expert_intermediate_size", "hidden_size"), ("moe_intermediate_size", "hidden_size")
        out = {L + "mlp.gate.weight": ((E, hidden), ("num_experts", "hidden_size")),
               L + "mlp.shared_expert_gate.weight": ((1, hidden), ("hidden_size",))}
        for n in ("gate", "up"):
            out[f"{L}mlp.shared_expert.{n}_proj.weight"] = ((shared, hidden), s_keys)
        out[L + "mlp.shared_expert.down_proj.weight"] = ((hidden, shared), s_keys)
        for e in range(E):
            for n in ("gate", "up"):
                out[f"{L}mlp.experts.{e}.{n}_proj.weight"] = ((moe, hidden), m_keys)
            out[f"{L}mlp.experts.{e}.down_proj.weight"] = ((hidden, moe), m_keys)
        return out

    def mlp_tensors(self) -> list[str]:
        shared = [f"mlp.shared_expert.{n}" for n in MLP_TENSORS]
        return ["mlp.gate.weight", *shared, "mlp.shared_expert_gate.weight"]

    def expert_tensors(self) -> list[str]:
        return [f"mlp.experts.{e}.{n}" for e in range(self.args.num_experts) for n in MLP_TENSORS]
