"""Qwen 3.5's multi-token-prediction (MTP) head (issue 20): the layout that loads it, ``MTPHead.forward`` against a
torch reference of vLLM's definition built from transformers' Qwen 3.5 layers, the "equal" checkpoint whose head
predicts exactly what the model does, and ``forward(hidden=True)``.

Tolerance: f32 weights and compute on both sides, max |Δ| ≤ 1e-4 (as tests/test_models.py).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import lumen_core as lumen
from lumen_core.errors import CheckpointError

TOL = 1e-4
CONTEXT = 64
KINDS = ("qwen3_5", "qwen3_5_moe")


def prompt_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    return np.random.RandomState(seed).randint(3, vocab, n).tolist()


def open_arch(path):
    from lumen_core.checkpoint import open_checkpoint
    from lumen_core.plugins import get_registry

    registry = get_registry()
    ckpt = open_checkpoint(path, registry)
    return ckpt, registry.architecture_class(ckpt.config["model_type"]).from_checkpoint(ckpt)


def load_with_mtp(path):
    """The model with its MTP head (``draft.mtp``: the plan sets ``arch.use_mtp`` and places ``("mtp", None)`` with
    the output layer), on the CPU. Every checkpoint tensor is then used, the head's included."""
    engine = lumen.load({"model": {"path": str(path), "compute": "cpu", "store": "ram",
                                   "hidden-layers": {"kv-cache": {"context-size": CONTEXT}}},
                         "draft": {"mtp": True}}, progress=False)
    assert engine.model.mtp is not None
    assert engine.report.unused == [] and not [n for n in engine.report.skipped if n.startswith("mtp.")]
    return engine.model


# --- the torch reference --------------------------------------------------------------------------------------


def read_tensors(path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


class TorchMTP:
    """vLLM's Qwen 3.5 MTP from transformers' pieces: the head's decoder layer and final norm are a one-layer,
    full-attention transformers model (written to ``tmp`` from the ``mtp.*`` tensors: its own embedding, RoPE,
    causal mask and KV cache), fc and the pre-fc norms are applied around it here."""

    def __init__(self, path, tmp):
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

        config = json.loads((path / "config.json").read_text())
        config.update(num_hidden_layers=1, layer_types=["full_attention"])
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "config.json").write_text(json.dumps(config))
        t = read_tensors(path)
        ours = {"model.embed_tokens.weight": t["model.embed_tokens.weight"], "lm_head.weight": t["lm_head.weight"],
                "model.norm.weight": t["mtp.norm.weight"]}
        ours.update({"model." + k.removeprefix("mtp."): v for k, v in t.items() if k.startswith("mtp.layers.0.")})
        save_file(ours, tmp / "model.safetensors", metadata={"format": "pt"})
        self.model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        H, eps = config["hidden_size"], config["rms_norm_eps"]
        self.norm_e, self.norm_h = Qwen3_5RMSNorm(H, eps), Qwen3_5RMSNorm(H, eps)
        self.norm_e.weight.data.copy_(t["mtp.pre_fc_norm_embedding.weight"])
        self.norm_h.weight.data.copy_(t["mtp.pre_fc_norm_hidden.weight"])
        self.fc = t["mtp.fc.weight"]
        self.cache = None

    @torch.no_grad()
    def forward(self, ids, hidden):
        """(last row's logits (1, V), its ``out`` row (1, H)) as numpy; the KV cache carries over between calls."""
        e = self.model.model.embed_tokens(torch.tensor(ids))
        h = torch.as_tensor(np.asarray(hidden, dtype=np.float32))
        x = torch.cat([self.norm_e(e), self.norm_h(h)], dim=-1) @ self.fc.T
        res = self.model.model(inputs_embeds=x[None], past_key_values=self.cache, use_cache=True)
        self.cache = res.past_key_values
        out = res.last_hidden_state[0, -1:]
        return self.model.lm_head(out).numpy(), out.numpy()


# --- the layout -------------------------------------------------------------------------------------------------


def test_the_head_is_skipped_unless_asked_for(tiny_checkpoint):
    ckpt, arch = open_arch(tiny_checkpoint("qwen3_5", mtp="random"))
    assert arch.mtp_layers == 1
    layout = arch.layout(ckpt.tensors)
    heads = [n for n in ckpt.tensors if n.startswith("mtp.")]
    assert heads and all("multi-token-prediction" in layout.skipped[n] for n in heads)
    assert ("mtp", None) not in layout.needs and ("mtp", None) not in arch.components()
    plain_ckpt, plain = open_arch(tiny_checkpoint("qwen3_5"))
    assert plain.mtp_layers == 0 and plain.mtp_cache_bytes(100, 4) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_use_mtp_makes_the_head_a_component(tiny_checkpoint, kind):
    ckpt, arch = open_arch(tiny_checkpoint(kind, mtp="random"))
    arch.use_mtp = True
    layout = arch.layout(ckpt.tensors)
    heads = {n for n in ckpt.tensors if n.startswith("mtp.")}
    assert set(layout.needs[("mtp", None)]) == heads  # every head tensor, experts included, and nothing else
    assert not heads & set(layout.skipped)
    assert arch.components()[-2:] == [("output-layer", None), ("mtp", None)]
    shapes = arch.expected_shapes()
    assert shapes["mtp.fc.weight"][0] == (64, 128)
    assert heads <= set(shapes)
    assert not arch.is_matrix("mtp.pre_fc_norm_embedding.weight") and arch.is_matrix("mtp.fc.weight")
    assert arch.norm_weight_offset("mtp.pre_fc_norm_hidden.weight") == 1.0
    assert arch.norm_weight_offset("mtp.norm.weight") == 1.0
    ops = arch.required_ops(("mtp", None))
    assert {"attention", "gather", "concat"} <= ops and ("moe_experts" in ops) == (kind == "qwen3_5_moe")
    # one full-attention layer's KV cache: 2 (k, v) x 2 KV heads x head_dim 16 x context x bytes
    assert arch.mtp_cache_bytes(100, 2) == 2 * 2 * 16 * 100 * 2
    arch.check_checkpoint(ckpt)  # the tiny head has the shapes the config implies


def test_use_mtp_without_a_head_is_refused_naming_the_fix(tiny_checkpoint):
    ckpt, arch = open_arch(tiny_checkpoint("qwen3_5"))
    arch.use_mtp = True
    with pytest.raises(CheckpointError, match="no mtp.* tensors.*draft with a separate draft model"):
        arch.layout(ckpt.tensors)


def test_a_head_of_the_wrong_shape_is_refused_before_loading(tiny_checkpoint, tmp_path):
    from safetensors.torch import save_file

    src = tiny_checkpoint("qwen3_5", mtp="random")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    t = read_tensors(src)
    t["mtp.fc.weight"] = t["mtp.fc.weight"][:, :64].contiguous()  # the embedding half only
    save_file(t, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ckpt, arch = open_arch(tmp_path)  # not used: skipped, its shape not checked
    arch.use_mtp = True
    with pytest.raises(CheckpointError, match=r"mtp\.fc\.weight.*\(64, 64\).*\(64, 128\)"):
        arch.check_checkpoint(ckpt)


# --- the head against the torch reference ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_mtp_forward_matches_the_torch_reference(tiny_checkpoint, tmp_path, kind):
    """A prompt's rows in one call (the head's prefill), then drafts one token at a time from the head's own ``out``,
    then a multi-token call at a later position (the rows a verify accepted): logits and ``out`` within 1e-4."""
    path = tiny_checkpoint(kind, mtp="random")
    model, ref = load_with_mtp(path), TorchMTP(path, tmp_path / "ref")
    ids = prompt_ids(model.vocab_size, 12)
    _, rows = model.forward(ids, model.new_cache(CONTEXT), all_logits=True, hidden=True)
    cache = model.mtp.new_cache(CONTEXT)

    def check(tokens, hidden, what):
        logits, out = model.mtp.forward(tokens, hidden, cache)
        want_logits, want_out = ref.forward(tokens, hidden)
        assert logits.shape == want_logits.shape == (1, model.vocab_size), what
        assert np.abs(logits - want_logits).max() <= TOL, what
        assert np.abs(np.asarray(out) - want_out).max() <= TOL, what
        return logits, out

    logits, out = check(ids[1:], rows[:-1], "prompt")  # row i: token i + 1 with the hidden that predicted it
    assert cache.pos == len(ids) - 1
    for step in range(3):
        logits, out = check([int(np.argmax(logits[-1]))], out, f"draft step {step}")
    later = prompt_ids(model.vocab_size, 3, seed=1)
    check(later, rows[3:6], "a later multi-token call")
    assert cache.pos == len(ids) - 1 + 3 + 3


def test_mtp_forward_takes_backend_arrays_and_keeps_logits_on_the_backend(tiny_checkpoint):
    model = load_with_mtp(tiny_checkpoint("qwen3_5", mtp="random"))
    ids = prompt_ids(model.vocab_size, 6)
    logits, rows = model.forward(ids, model.new_cache(CONTEXT), host=False, hidden=True)
    a, b = model.mtp.new_cache(CONTEXT), model.mtp.new_cache(CONTEXT)
    on_host = model.mtp.forward(ids[1:], np.asarray(rows[:-1]), a)
    on_backend = model.mtp.forward(ids[1:], rows[:-1], b, host=False)
    assert model.out_backend.owns(on_backend[0])
    assert np.array_equal(on_host[0], model.out_backend.to_host(on_backend[0]))
    assert np.array_equal(np.asarray(on_host[1]), np.asarray(on_backend[1]))


def test_mtp_forward_refuses_rows_that_do_not_pair_up(tiny_checkpoint):
    from lumen_core.errors import InputError

    model = load_with_mtp(tiny_checkpoint("qwen3_5", mtp="random"))
    cache = model.mtp.new_cache(CONTEXT)
    with pytest.raises(InputError, match=r"2 token\(s\) but hidden rows of shape \(3, 64\)"):
        model.mtp.forward([5, 6], np.zeros((3, 64), np.float32), cache)
    with pytest.raises(InputError, match="no tokens"):
        model.mtp.forward([], np.zeros((0, 64), np.float32), cache)
    assert cache.pos == 0


# --- the "equal" checkpoint --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_the_equal_head_predicts_what_the_model_predicts(tiny_checkpoint, kind):
    """make_tiny_checkpoint's mtp="equal": at every position the head's argmax (token, hidden before it) is the
    model's next-token argmax, and drafting recursively from its own ``out`` gives the model's greedy tokens."""
    model = load_with_mtp(tiny_checkpoint(kind, mtp="equal"))
    ids = prompt_ids(model.vocab_size, 16, seed=4)
    logits, rows = model.forward(ids, model.new_cache(CONTEXT), all_logits=True, hidden=True)
    cache = model.mtp.new_cache(CONTEXT)
    for j in range(1, len(ids)):
        got, _ = model.mtp.forward([ids[j]], rows[j - 1:j], cache)
        assert int(np.argmax(got)) == int(np.argmax(logits[j])), f"position {j}"
        assert np.abs(got[0] - logits[j]).max() <= 1e-3  # equal up to the eps in the unit-RMS norm
    # recursive drafts from the head's own rows against the model's greedy continuation
    main_cache = model.new_cache(CONTEXT)
    model.forward(ids, main_cache)
    mtp_cache = model.mtp.new_cache(CONTEXT)
    draft, out = model.mtp.forward(ids[1:], rows[:-1], mtp_cache)
    drafted, greedy, last = [], [], logits[-1]
    for _ in range(4):
        drafted.append(int(np.argmax(draft[-1])))
        greedy.append(int(np.argmax(last)))
        draft, out = model.mtp.forward([drafted[-1]], out, mtp_cache)
        last = model.forward([greedy[-1]], main_cache)[-1]
    assert drafted == greedy
    assert len(set(greedy + ids)) > 1  # not a degenerate model that predicts one token everywhere


# --- forward(hidden=True) -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_forward_hidden_returns_the_rows_the_head_reads(tiny_checkpoint, kind):
    """The rows are the final-normed hidden states of every position (transformers' last_hidden_state); the lm_head
    of each is that position's logits; the logits are forward's without ``hidden``."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(kind, mtp="random")
    model = load_with_mtp(path)
    ids = prompt_ids(model.vocab_size, 10, seed=2)
    plain_all = model.forward(ids, model.new_cache(CONTEXT), all_logits=True)
    plain_last = model.forward(ids, model.new_cache(CONTEXT))
    all_logits, rows = model.forward(ids, model.new_cache(CONTEXT), all_logits=True, hidden=True)
    last, rows_again = model.forward(ids, model.new_cache(CONTEXT), hidden=True)
    assert np.array_equal(all_logits, plain_all) and np.array_equal(last, plain_last)
    assert rows.shape == (len(ids), 64) and np.array_equal(np.asarray(rows), np.asarray(rows_again))
    head = read_tensors(path)["lm_head.weight"].numpy()
    assert np.abs(np.asarray(rows) @ head.T - all_logits).max() <= TOL
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref.model(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()
    # the rows carry the f32 rounding of the two Gated-DeltaNet implementations at full scale (measured 2.6e-4 on
    # rows of RMS about 1); the logits (lm_head of 0.05-scale weights) shrink it below 1e-4
    assert np.abs(np.asarray(rows) - want).max() <= 1e-3
