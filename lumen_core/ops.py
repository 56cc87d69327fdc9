"""The op contract: what an architecture may call on ``ops``, with shapes. Backends implement these.

A backend registers ``register(op, backend, fn, variant=None, priority=0)``; ``variant`` is a weight format
(``f32``, ``bf16``, ``f16``, ``fp8``) for ops that take a ``Weight``. Activations are f32 arrays of the
backend; T = tokens of this call, H = hidden size. Architectures may also use the tensor protocol:
``.shape``, ``.reshape``, basic slicing, and ``+ - * /`` with tensors or Python scalars.
"""

CONTRACT = {
    "embedding": "(ids list[int] (T,), w Weight (vocab, H)) -> (T, H)",
    "linear": "(x (T, in), w Weight (out, in)) -> (T, out); variants per weight format",
    "rms_norm": "(x (..., D), w (D,) | None, eps, offset=0.0) -> x / rms(x) * (w + offset)",
    "rms_norm_gated": "(x (..., D), gate (..., D), w (D,), eps) -> rms_norm(x, w) * silu(gate)",
    "l2norm": "(x (..., D), eps=1e-6) -> x / sqrt(sum(x²) + eps)",
    "sigmoid": "(x) -> 1 / (1 + exp(-x))",
    "silu": "(x) -> x * sigmoid(x)",
    "softplus": "(x) -> log(1 + exp(x))",
    "exp": "(x) -> exp(x)",
    "silu_mul": "(gate (T, I), up (T, I)) -> silu(gate) * up",
    "gelu_tanh_mul": "(gate (T, I), up (T, I)) -> gelu_tanh(gate) * up",
    "softcap": "(x, cap) -> tanh(x / cap) * cap",
    "rope_tables": "(positions (T,) | (3, T), inv_freq list[float], mrope_section=None, interleaved=False) "
                   "-> cos, sin (T, rot)",
    "apply_rope": "(x (T, heads, D), cos (T, rot), sin (T, rot)) -> x with dims [:rot] rotated (rotate-half)",
    "kv_cache": "(context, kv_heads, head_dim, type_k='f32', type_v=None, head_dim_v=None) -> cache",
    "attention": "(q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, Dv), cache, start, scale, window=None, "
                 "softcap=None, blocks=None) -> (T, Hq, Dv); writes k, v at start..start+T-1, causal; blocks: "
                 "[(first, end)] position ranges of this call (an image's tokens, Gemma) whose queries also see "
                 "every key of their range (within the window); passed only when the call holds images",
    "conv_state": "(channels, kernel) -> state holding the last kernel-1 inputs",
    "causal_conv1d": "(x (T, C), w (C, K), state) -> silu(depthwise causal conv) (T, C); updates state",
    "delta_state": "(v_heads, k_dim, v_dim) -> recurrent state (v_heads, k_dim, v_dim)",
    "gated_delta_rule": "(q, k (T, Hk, Dk), v (T, Hv, Dv), g, beta (T, Hv), state) -> (T, Hv, Dv); "
                        "L2-normalises q, k; updates state",
    "moe_route": "(logits (T, E), k, normalize=True) -> weights (T, k), ids (T, k): softmax top-k",
    "moe_experts": "(x (T, H), ids (T, k), weights (T, k), gate_up [(Weight, Weight)] per expert, "
                   "down [Weight] per expert, act='silu') -> (T, H)",
    "gather": "(table (N, ...), ids int (...)) -> table[ids]: rows picked by index (e.g. per-expert scales)",
    "moe_experts_packed": "(x (T, H), ids (T, k), weights (T, k), gate_up Weight (E, 2I, H) gate rows then up, "
                          "down Weight (E, H, I), act='gelu_tanh') -> (T, H); moe_experts over one packed tensor",
    "sliding_kv_cache": "(window, kv_heads, head_dim, type_k='f32', type_v=None, head_dim_v=None) -> cache of "
                        "the last `window` positions (a ring); `attention` with that window accepts it",
    "attention_shared": "(q (T, Hq, D), cache, start, scale, window=None, softcap=None, blocks=None) -> (T, Hq, "
                        "Dv); attends over keys another layer wrote at ..start+T-1 in this call (KV sharing); "
                        "writes nothing; blocks as attention's",
    # vision towers (issue 17)
    "layer_norm": "(x (..., D), w (D,) | None, b (D,) | None, eps) -> (x - mean) / sqrt(var + eps) * w + b",
    "gelu": "(x) -> x * Φ(x): the erf form (torch's nn.GELU())",
    "gelu_tanh": "(x) -> 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))) (gelu_pytorch_tanh)",
    "bidirectional_attention": "(q (T, H, D), k (S, Hkv, D), v (S, Hkv, Dv), scale) -> (T, H, Dv): every query over "
                               "every key, no mask, no cache (a vision tower within one image); Hkv divides H",
    "concat": "(xs [(T_i, ...)]) -> (sum T_i, ...): along the first axis (image embeddings between text's)",
    "clamp": "(x, lo: float, hi: float) -> min(max(x, lo), hi) (Gemma 4's clipped linears)",
}


# Optional ops: a backend may register them (to fuse work); where it does not, ``OpSet`` runs the composite below
# over the contract ops, so every backend supports them and gives the same numbers either way.
OPTIONAL = {
    "linear_group": "(x (T, in), ws [Weight (out_i, in)]) -> [(T, out_i)]: linear with each weight; a backend may "
                    "fuse the matrices into one (one read of x, one launch)",
    "gdn_gates": "(a (T, Hv), b (T, Hv), neg_a (Hv,), dt_bias (Hv,)) -> (g, beta): g = neg_a * softplus(a + "
                 "dt_bias), beta = sigmoid(b) (Gated-DeltaNet decay and write strength)",
    # several sequences in one call (continuous batching): rows spans[i] = (first, end) belong to sequence i, whose
    # state is states[i] and whose first row sits at cache position starts[i]; a backend may run the one-row spans
    # (decode steps) of all sequences in one launch
    "attention_segments": "(q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, Dv), states [cache], starts [int], spans "
                          "[(first, end)], scale, window=None) -> (T, Hq, Dv): attention per sequence",
    "causal_conv1d_segments": "(x (T, C), w (C, K), states [conv state], spans) -> (T, C): causal_conv1d per "
                              "sequence",
    "gated_delta_rule_segments": "(q, k (T, Hk, Dk), v (T, Hv, Dv), g, beta (T, Hv), states [delta state], spans) "
                                 "-> (T, Hv, Dv): gated_delta_rule per sequence",
    # a speculative verify (lumen_core.speculative): the T tokens one at a time, and the state after each one (a
    # list per token of the state's arrays, in lumen_core.speculative's field order), so a rewind can pick one
    "causal_conv1d_kept": "(x (T, C), w (C, K), state) -> ((T, C), [[arrays of the state after token t]])",
    "gated_delta_rule_kept": "(q, k (T, Hk, Dk), v (T, Hv, Dv), g, beta (T, Hv), state) -> ((T, Hv, Dv), "
                             "[[arrays of the state after token t]])",
    # the Gated-DeltaNet recurrence from its raw gate projections: a backend may compute the gates inside its
    # recurrence kernel (one launch a decode step where gdn_gates and gated_delta_rule take two)
    "gated_delta_rule_gates": "(q, k (T, Hk, Dk), v (T, Hv, Dv), a, b (T, Hv), neg_a, dt_bias (Hv,), state) -> "
                              "gated_delta_rule(q, k, v, *gdn_gates(a, b, neg_a, dt_bias), state)",
    # the Gated-DeltaNet token mixer between its input projections and its output projection (Qwen 3.5): a backend may
    # run a decode step's conv, recurrence and gated norm as one kernel
    "gated_delta_net": "(qkv (T, C), conv_w (C, K), conv_state, a, b (T, Hv), neg_a, dt_bias (Hv,), delta_state, z "
                       "(T, Hv * Dv), norm_w (Dv,), eps, dims (Hk, Dk, Hv, Dv)) -> (T, Hv, Dv): x = causal_conv1d(qkv) "
                       "split into q, k (T, Hk, Dk) and v (T, Hv, Dv) (C = 2 Hk Dk + Hv Dv), then rms_norm_gated("
                       "gated_delta_rule_gates(q, k, v, a, b, neg_a, dt_bias), z, norm_w, eps); updates both states",
    # a residual add and the norm of its result (a decoder layer between its token mixer and its MLP): one launch
    "add_rms_norm": "(x (T, H), r (T, H), w (H,) | None, eps, offset=0.0) -> (x + r, rms_norm(x + r, w, eps, offset))",
    # a MoE block with a shared expert (Qwen 3.5 MoE) whose routed experts compute on the layer's own backend: the
    # shared expert is passed as expert E (the last item of gate_up / down), so a backend may run it as one more
    # slot of the routed experts' kernels (one launch pair for all k + 1) instead of three more products
    "moe_shared": "(x (T, H), logits (T, E), shared_logit (T, 1), k, gate_up [(Weight, Weight)] E + 1 pairs, down "
                  "[Weight] E + 1, normalize=True, act='silu') -> (T, H): moe_experts over the experts moe_route "
                  "picks from logits, plus expert E (the shared expert) times sigmoid(shared_logit)",
    # a whole decoder layer whose attention and MLP are each normed before and after (Gemma 2/3): one call, so a
    # backend may run a decode step's layer as one compiled function (the CPU: issue 22)
    "sandwich_layer": "(x (T, H), norms (in, post_attn, pre_ff, post_ff) (H,), attn (q, k, v Weights, q_norm, "
                      "k_norm (D,), o Weight), mlp (gate, up, down Weights), cache, start, rope (cos, sin), dims "
                      "(heads, kv_heads, D), scale, window, eps, offset, act='gelu_tanh') -> (T, H): x + "
                      "norm(o(attention(rope(norm(q)), rope(norm(k)), v))) of norm(x), then + norm(down(act(gate) * "
                      "up)) of its norm; every norm rms_norm(., w, eps, offset)",
}


def _linear_group(ops, x, ws):
    return [ops.linear(x, w) for w in ws]


def _gdn_gates(ops, a, b, neg_a, dt_bias):
    return neg_a * ops.softplus(a + dt_bias), ops.sigmoid(b)


def _per_span(ops, spans, fn, *arrays):
    out = [fn(i, *(a[first:end] for a in arrays)) for i, (first, end) in enumerate(spans)]
    return out[0] if len(out) == 1 else ops.concat(out)


def _attention_segments(ops, q, k, v, states, starts, spans, scale, window=None):
    extra = {} if window is None else {"window": window}
    return _per_span(ops, spans, lambda i, q, k, v: ops.attention(q, k, v, states[i], starts[i], scale, **extra),
                     q, k, v)


def _causal_conv1d_segments(ops, x, w, states, spans):
    return _per_span(ops, spans, lambda i, x: ops.causal_conv1d(x, w, states[i]), x)


def _gated_delta_rule_segments(ops, q, k, v, g, beta, states, spans):
    return _per_span(ops, spans, lambda i, *a: ops.gated_delta_rule(*a, states[i]), q, k, v, g, beta)


def _state_arrays(state) -> list:
    from .speculative import state_copy

    return state_copy(state)


def _causal_conv1d_kept(ops, x, w, state):
    ys, kept = [], []
    for t in range(x.shape[0]):
        ys.append(ops.causal_conv1d(x[t:t + 1], w, state))
        kept.append(_state_arrays(state))
    return (ys[0] if len(ys) == 1 else ops.concat(ys)), kept


def _gated_delta_rule_kept(ops, q, k, v, g, beta, state):
    os_, kept = [], []
    for t in range(q.shape[0]):
        os_.append(ops.gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state))
        kept.append(_state_arrays(state))
    return (os_[0] if len(os_) == 1 else ops.concat(os_)), kept


def _gated_delta_rule_gates(ops, q, k, v, a, b, neg_a, dt_bias, state):
    g, beta = ops.gdn_gates(a, b, neg_a, dt_bias)
    return ops.gated_delta_rule(q, k, v, g, beta, state)


def _gated_delta_net(ops, qkv, conv_w, conv_state, a, b, neg_a, dt_bias, delta_state, z, norm_w, eps, dims):
    Hk, Dk, Hv, Dv = dims
    T, kd = qkv.shape[0], Hk * Dk
    x = ops.causal_conv1d(qkv, conv_w, conv_state)  # (T, 2 kd + Hv Dv)
    q, k = x[:, :kd].reshape(T, Hk, Dk), x[:, kd:2 * kd].reshape(T, Hk, Dk)
    o = ops.gated_delta_rule_gates(q, k, x[:, 2 * kd:].reshape(T, Hv, Dv), a, b, neg_a, dt_bias, delta_state)
    return ops.rms_norm_gated(o, z.reshape(T, Hv, Dv), norm_w, eps)


def _add_rms_norm(ops, x, r, w, eps, offset=0.0):
    s = x + r
    return s, ops.rms_norm(s, w, eps, offset)


def _moe_shared(ops, x, logits, shared_logit, k, gate_up, down, normalize=True, act="silu"):
    if act not in ("silu", "gelu_tanh"):
        raise ValueError(f"moe_shared: act must be 'silu' or 'gelu_tanh', got {act!r}")
    E = len(gate_up) - 1
    if E < 1 or len(down) != E + 1:
        raise ValueError(f"moe_shared: gate_up ({len(gate_up)}) and down ({len(down)}) must both hold the routed "
                         "experts and then the shared expert")
    weights, ids = ops.moe_route(logits, k, normalize)
    mul = ops.silu_mul if act == "silu" else ops.gelu_tanh_mul
    shared = ops.linear(mul(*ops.linear_group(x, list(gate_up[E]))), down[E]) * ops.sigmoid(shared_logit)
    return ops.moe_experts(x, ids, weights, gate_up[:E], down[:E], act) + shared


def _sandwich_layer(ops, x, norms, attn, mlp, cache, start, rope, dims, scale, window, eps, offset,
                    act="gelu_tanh"):
    n_in, n_post_attn, n_pre_ff, n_post_ff = norms
    wq, wk, wv, q_norm, k_norm, wo = attn
    (H, KV, D), (cos, sin), T = dims, rope, x.shape[0]
    q, k, v = ops.linear_group(ops.rms_norm(x, n_in, eps, offset), [wq, wk, wv])
    q = ops.apply_rope(ops.rms_norm(q.reshape(T, H, D), q_norm, eps, offset), cos, sin)
    k = ops.apply_rope(ops.rms_norm(k.reshape(T, KV, D), k_norm, eps, offset), cos, sin)
    o = ops.attention(q, k, v.reshape(T, KV, D), cache, start, scale, window)
    gate, up, down = mlp
    if act not in ("silu", "gelu_tanh"):
        raise ValueError(f"sandwich_layer: act must be 'silu' or 'gelu_tanh', got {act!r}")
    x, h = ops.add_rms_norm(x, ops.rms_norm(ops.linear(o.reshape(T, H * D), wo), n_post_attn, eps, offset), n_pre_ff,
                            eps, offset)  # x + the normed attention output, and its pre-feed-forward norm
    mul = ops.silu_mul if act == "silu" else ops.gelu_tanh_mul
    h = ops.linear(mul(*ops.linear_group(h, [gate, up])), down)
    return x + ops.rms_norm(h, n_post_ff, eps, offset)


COMPOSITES = {"sandwich_layer": _sandwich_layer, "moe_shared": _moe_shared, "add_rms_norm": _add_rms_norm,
              "gated_delta_rule_gates": _gated_delta_rule_gates, "gated_delta_net": _gated_delta_net,
              "causal_conv1d_kept": _causal_conv1d_kept, "gated_delta_rule_kept": _gated_delta_rule_kept,
              "linear_group": _linear_group, "gdn_gates": _gdn_gates, "attention_segments": _attention_segments,
              "causal_conv1d_segments": _causal_conv1d_segments,
              "gated_delta_rule_segments": _gated_delta_rule_segments}
