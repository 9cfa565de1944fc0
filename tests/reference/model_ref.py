#!/usr/bin/env python3
"""Independent reference of fp8moe's MoE transformer, in JAX (FP64), with autograd.

Usage: model_ref.py DIR
DIR holds what the C++ test wrote: config.json (model shape, recipe, routing), tokens.bin and
targets.bin (int32, B*T), and one float32 file per parameter, param.<name>.bin. This script
computes the loss and the gradient of every trainable parameter with jax.grad and writes
loss.txt and grad.<name>.bin (float32). It shares no code with fp8moe.

FP8: with recipe "blockwise" every linear layer quantize-dequantizes its operands exactly as the
FP8 contract says (1 x T tiles for activations and gradients along K, T x T blocks for weights,
power-of-two scales fmax / amax, E4M3 through ml_dtypes' float8_e4m3fn, a second, independent
rounding oracle), in a custom VJP: forward x W^T, dgrad dy W, wgrad dy^T x with dy and x
re-quantized in T x 1 tiles. The expert choice (top-k) is taken from the C++ run's routing
(routing.bin) so that a near-tie cannot pick different experts in FP32 and FP64; the reference
also makes its own top-k choice (score + bias, ties to the lower index) and writes to
routing_check.txt how many tokens it would route differently where the choice is not a near-tie
(gap between the k-th and the next key above 1e-6): the C++ test requires 0.

BF16 activations ("activations": "bf16", fp8moe's train.activations): values and gradients rounded
to BF16 (ml_dtypes, from FP64) at fp8moe's rounding points, in custom VJPs, and attention as a
fused BF16 kernel computes it (attention_bf16); see forward().
"""
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

jax.config.update("jax_enable_x64", True)
# This model runs eagerly, and JAX compiles each primitive for its shapes: two thirds of a run's
# time (18 of 27 s, cProfile, 2-core VM, 2026-12-08). The runs share those compilations through
# JAX's persistent cache, beside the Python environment (build/venv), or where FP8MOE_JAX_CACHE
# says; a second run of the same case took 9 s.
_cache = os.environ.get("FP8MOE_JAX_CACHE", os.path.join(sys.prefix, "jax-cache"))
try:
    os.makedirs(_cache, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
except OSError:
    pass  # (a prefix this user cannot write: no cache, every primitive compiled again)

FP8_MAX = 448.0


def tile_quant_dequant(x, tile, axis):
    """Quantize-dequantize a 2-D array in 1 x T tiles along `axis` (numpy, FP64 in and out)."""
    x = np.asarray(x, dtype=np.float64)
    if axis == 0:
        return tile_quant_dequant(x.T, tile, 1).T
    rows, cols = x.shape
    out = np.empty_like(x)
    for c0 in range(0, cols, tile):
        blk = x[:, c0:c0 + tile]
        amax = np.max(np.abs(blk), axis=1, keepdims=True)
        out[:, c0:c0 + tile] = _qdq(blk, amax)
    return out


def block_quant_dequant(w, tile):
    w = np.asarray(w, dtype=np.float64)
    out = np.empty_like(w)
    for r0 in range(0, w.shape[0], tile):
        for c0 in range(0, w.shape[1], tile):
            blk = w[r0:r0 + tile, c0:c0 + tile]
            out[r0:r0 + tile, c0:c0 + tile] = _qdq(blk, np.max(np.abs(blk)))
    return out


def _qdq(x, amax, dtype=ml_dtypes.float8_e4m3fn):
    fmax = float(ml_dtypes.finfo(dtype).max)
    amax = np.asarray(amax, dtype=np.float64)
    safe = np.where(amax > 0, amax, 1.0)
    # Scale computed in FP32 as the contract says, then floored to a power of two.
    scale = np.where(amax > 0, np.float32(fmax) / safe.astype(np.float32), np.float32(1.0)).astype(np.float64)
    scale = np.exp2(np.floor(np.log2(scale)))
    q = (x * scale).astype(np.float32).astype(dtype)
    return q.astype(np.float64) / scale


def tensor_quant_dequant(x, dtype=ml_dtypes.float8_e4m3fn):
    x = np.asarray(x, dtype=np.float64)
    return _qdq(x, np.max(np.abs(x)), dtype)


def make_linear(recipe, tile, cache=False, hybrid=False, retile_dy=False):
    """y = x W^T with the recipe's quantization in all three GEMMs. cache: the weight gradient
    re-tiles x's 1 x T values (FP8-cached inputs, or inputs quantized before dispatch); retile_dy:
    likewise dy's (an output gradient quantized before dispatch)."""
    if recipe == "off":
        return lambda x, w: x @ w.T
    if recipe == "current":
        return make_per_tensor_linear(ml_dtypes.float8_e5m2 if hybrid else ml_dtypes.float8_e4m3fn)
    if recipe != "blockwise":
        raise SystemExit(f"model_ref.py: recipe {recipe!r} is not modelled (delayed scaling is stateful)")

    @jax.custom_vjp
    def linear(x, w):
        return _fwd(x, w)[0]

    def _fwd(x, w):
        xq = jax.pure_callback(lambda a: tile_quant_dequant(a, tile, 1), jax.ShapeDtypeStruct(x.shape, jnp.float64), x)
        wq = jax.pure_callback(lambda a: block_quant_dequant(a, tile), jax.ShapeDtypeStruct(w.shape, jnp.float64), w)
        return xq @ wq.T, (x, wq)

    def _bwd(res, dy):
        x, wq = res
        dyq = jax.pure_callback(lambda a: tile_quant_dequant(a, tile, 1), jax.ShapeDtypeStruct(dy.shape, jnp.float64), dy)
        dyt = jax.pure_callback((lambda a: tile_quant_dequant(tile_quant_dequant(a, tile, 1), tile, 0)) if retile_dy
                                else (lambda a: tile_quant_dequant(a, tile, 0)),
                                jax.ShapeDtypeStruct(dy.shape, jnp.float64), dy)
        # With FP8-cached activations the weight gradient re-tiles the cached 1 x T values.
        retile = (lambda a: tile_quant_dequant(tile_quant_dequant(a, tile, 1), tile, 0)) if cache else \
                 (lambda a: tile_quant_dequant(a, tile, 0))
        xt = jax.pure_callback(retile, jax.ShapeDtypeStruct(x.shape, jnp.float64), x)
        return dyq @ wq, dyt.T @ xt

    linear.defvjp(_fwd, _bwd)
    return linear


def make_per_tensor_linear(grad_dtype):
    """Current scaling: one scale per tensor from its amax; gradients in grad_dtype (E5M2: hybrid)."""
    f64 = lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float64)

    @jax.custom_vjp
    def linear(x, w):
        return _fwd(x, w)[0]

    def _fwd(x, w):
        xq = jax.pure_callback(tensor_quant_dequant, f64(x), x)
        wq = jax.pure_callback(tensor_quant_dequant, f64(w), w)
        return xq @ wq.T, (xq, wq)

    def _bwd(res, dy):
        xq, wq = res
        dyq = jax.pure_callback(lambda a: tensor_quant_dequant(a, grad_dtype), f64(dy), dy)
        return dyq @ wq, dyq.T @ xq

    linear.defvjp(_fwd, _bwd)
    return linear


def rmsnorm(x, w, eps):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, theta):
    # x: (B, T, heads, hd); halves rotated against each other
    T, hd = x.shape[1], x.shape[-1]
    half = hd // 2
    inv = theta ** (-2.0 * np.arange(half) / hd)
    ang = np.arange(T)[:, None] * inv[None, :]
    cos, sin = jnp.asarray(np.cos(ang))[None, :, None, :], jnp.asarray(np.sin(ang))[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def attention(q, k, v):
    # q, k: (B, T, H or KVH, hd); v: (B, T, KVH, hd_v); the scale 1 / sqrt(hd)
    B, T, H, hd = q.shape
    group = H // k.shape[2]
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(hd)
    mask = np.tril(np.ones((T, T), dtype=bool))
    s = jnp.where(mask[None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhij,bjhd->bihd", p, v)


def mla(p, pre, m, la, h, B, T, rv, att):
    """DeepSeek-V2/V3 multi-head latent attention as their published modeling code writes it:
    queries through an optional low-rank latent with its RMSNorm, keys and values up-projected
    from one normalised latent, a rotary part of each query head and one rotary key (from the
    hidden state) shared by all heads, value heads of their own size. Returns (N, H * v_head_dim).
    rv: the BF16 rounding of values (train.activations bf16) or the identity; att: attention() or
    attention_bf16()."""
    N, H, eps, theta = B * T, m["n_heads"], m["norm_eps"], m["rope_theta"]
    nope, rd, vd = m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"]
    kvl = m["kv_lora_rank"]
    if m["q_lora_rank"] > 0:
        cq = rv(rmsnorm(rv(la(h, p[pre + "wq_a"])), p[pre + "q_norm.weight"][0], eps))
        q = la(cq, p[pre + "wq_b"])
    else:
        q = la(h, p[pre + "wq"])
    q = q.reshape(B, T, H, nope + rd)
    ckv = rv(la(h, p[pre + "wkv_a"]))  # (N, kv_lora + rope): the latent and the shared rotary key
    kv = la(rv(rmsnorm(ckv[:, :kvl], p[pre + "kv_norm.weight"][0], eps)), p[pre + "wkv_b"]).reshape(B, T, H, nope + vd)
    k_pe = rope(ckv[:, kvl:].reshape(B, T, 1, rd), theta)
    q = rv(jnp.concatenate([q[..., :nope], rope(q[..., nope:], theta)], axis=-1))
    k = rv(jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_pe, (B, T, H, rd))], axis=-1))
    return att(q, k, rv(kv[..., nope:])).reshape(N, H * vd)


def make_fp8_kept_swiglu(tile):
    """(g, u, lin_out, w2, r) -> lin_out(r * silu(g) * u, w2) as fp8moe's train.recompute selective
    runs it with blockwise FP8 and cached inputs (model/ffn.h FfnSaved::h1q): the forward from g and
    u as they are; the backward keeps only their 1 x T FP8 values, makes the SwiGLU output again from
    those (w2's gradients read that one) and differentiates the SwiGLU (and the row gates r, where
    given) there."""
    qdq = lambda a: jax.pure_callback(lambda v: tile_quant_dequant(v, tile, 1),
                                      jax.ShapeDtypeStruct(a.shape, jnp.float64), a)

    def tail(g, u, lin_out, w2, r=None):
        r = jnp.ones((g.shape[0], 1)) if r is None else r

        @jax.custom_vjp
        def f(g, u, w2, r):
            return lin_out(r * (jax.nn.silu(g) * u), w2)

        def fwd(g, u, w2, r):
            return f(g, u, w2, r), (qdq(g), qdq(u), w2, r)

        def bwd(res, dy):
            gq, uq, w, r_ = res
            a, swiglu_vjp = jax.vjp(lambda g_, u_, r__: r__ * (jax.nn.silu(g_) * u_), gq, uq, r_)
            da, dw = jax.vjp(lin_out, a, w)[1](dy)
            dg, du, dr = swiglu_vjp(da)
            return dg, du, dw, dr

        f.defvjp(fwd, bwd)
        return f(g, u, w2, r)

    return tail


def plain_swiglu(g, u, lin_out, w2, r=None):
    a = jax.nn.silu(g) * u
    return lin_out(a if r is None else r * a, w2)


def swiglu_ffn(x, w1, w3, w2, lin, fused, lin_out=None, rv=lambda a: a, tail=plain_swiglu, gates=None):
    """fused: fp8moe runs w1 and w3 as one linear layer [w1; w3] (model/ffn.h): one quantization
    of the pair and one of its output gradient (per-tensor: one scale each; blockwise with F a
    multiple of the tile: the two layers' tiles). lin_out: w2's linear layer where it differs; rv:
    the BF16 rounding of the pre-activations (train.activations bf16); tail: the SwiGLU and w2
    (make_fp8_kept_swiglu's where fp8moe keeps the pre-activations in FP8); gates: (M, 1) each row's
    SwiGLU output scaled by it before w2 (train.moe_gates expert), so w2 quantizes the scaled rows."""
    lin_out = lin_out or lin
    if not fused:
        return tail(rv(lin(x, w1)), rv(lin(x, w3)), lin_out, w2, gates)
    F = w1.shape[0]
    h = rv(lin(x, jnp.concatenate([w1, w3], axis=0)))
    return tail(h[:, :F], h[:, F:], lin_out, w2, gates)


def to_bf16(a):
    """FP64 -> the nearest BF16 (round to nearest even, ml_dtypes), as FP64."""
    return np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float64)


def _bf16(a):
    """to_bf16 inside a traced function (a host callback)."""
    return jax.pure_callback(to_bf16, jax.ShapeDtypeStruct(a.shape, jnp.float64), a)


def make_rounding(forward, backward):
    """The identity with BF16 rounding of its value (forward) and of its gradient (backward):
    train.activations bf16's rounding points."""

    @jax.custom_vjp
    def r(x):
        return _bf16(x) if forward else x

    r.defvjp(lambda x: (r(x), None), lambda _, g: (_bf16(g) if backward else g,))
    return r


ROUND_BOTH, ROUND_VALUE, ROUND_GRAD = make_rounding(True, True), make_rounding(True, False), make_rounding(False, True)
IDENTITY = lambda x: x


def make_tensor_wire(grad_dtype):
    """The per-tensor recipes' FP8 rows of the expert all-to-all (fp8moe's model/moe.h MoeWire):
    value(x, rows) quantizes the rows of x at one scale from their amax (the experts' input: every
    routed row of the layer), the gradient passing through; grad(y) passes y and quantizes its
    gradient at one scale from its amax (the gradients of all the experts' outputs together, in
    grad_dtype). The experts' per-tensor layers quantize these values again with their own
    scales, which is exact: with power-of-two scales a smaller amax gives a scale 2^j >= the
    wire's, and values on the wire's FP8 grid stay on it."""
    f64 = lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float64)

    def value(x, rows):
        if len(rows) == 0:
            return x
        quantized = lambda a: jax.pure_callback(lambda v: _qdq(v, np.max(np.abs(v[rows]))), f64(a), a)

        @jax.custom_vjp
        def q(x):
            return quantized(x)
        q.defvjp(lambda x: (quantized(x), None), lambda _, g: (g,))
        return q(x)

    @jax.custom_vjp
    def grad(y):
        return y
    grad.defvjp(lambda y: (y, None),
                lambda _, g: (jax.pure_callback(lambda a: tensor_quant_dequant(a, grad_dtype), f64(g), g),))
    return value, grad


@jax.custom_vjp
def bf16_linear(x, w):
    """x w^T with BF16 operands and FP64 (fp8moe: FP32) accumulation: fp8moe's train.hp_gemm bf16
    (the router, head and eh_proj). The backward rounds dy and reads the rounded x and w."""
    return _bf16_linear_fwd(x, w)[0]


def _bf16_linear_fwd(x, w):
    x16, w16 = _bf16(x), _bf16(w)
    return x16 @ w16.T, (x16, w16)


def _bf16_linear_bwd(res, dy):
    x16, w16 = res
    dy16 = _bf16(dy)
    return dy16 @ w16, dy16.T @ x16


bf16_linear.defvjp(_bf16_linear_fwd, _bf16_linear_bwd)


@jax.custom_vjp
def attention_bf16(q, k, v):
    """Attention as a fused BF16 kernel runs it (fp8moe's attention_forward_bf16 and its backward,
    FlashAttention's, cuDNN's): q, k, v as given (rounded by the caller), the probabilities rounded
    to BF16 before they weight the values, the output rounded. The backward recomputes the
    probabilities, rounds dO, takes D = rowsum(dO * O) from the rounded dO and the KEPT (rounded)
    output, and rounds dS = P (dP - D) and P before the products that make dq, dk and dv."""
    return _attention_bf16_fwd(q, k, v)[0]


def _probabilities(q, k):
    B, T, H, hd = q.shape
    kr = jnp.repeat(k, H // k.shape[2], axis=2)
    s = jnp.einsum("bihd,bjhd->bhij", q, kr) / np.sqrt(hd)
    s = jnp.where(np.tril(np.ones((T, T), dtype=bool))[None, None], s, -jnp.inf)
    return jax.nn.softmax(s, axis=-1)


def _attention_bf16_fwd(q, k, v):
    vr = jnp.repeat(v, q.shape[2] // v.shape[2], axis=2)
    o = _bf16(jnp.einsum("bhij,bjhd->bihd", _bf16(_probabilities(q, k)), vr))
    return o, (q, k, v, o)


def _attention_bf16_bwd(res, do):
    q, k, v, o = res
    B, T, H, hd = q.shape
    KVH, group = k.shape[2], H // k.shape[2]
    kr, vr = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    p = _probabilities(q, k)
    do = _bf16(do)
    dp = jnp.einsum("bihd,bjhd->bhij", do, vr)
    d = jnp.einsum("bihd,bihd->bhi", do, o)
    ds = _bf16(p * (dp - d[..., None])) / np.sqrt(hd)
    dq = jnp.einsum("bhij,bjhd->bihd", ds, kr)
    # jnp.repeat puts query head h on key head h // group: sum each key head's group.
    dk = jnp.einsum("bhij,bihd->bjhd", ds, q).reshape(B, T, KVH, group, hd).sum(axis=3)
    dv = jnp.einsum("bhij,bihd->bjhd", _bf16(p), do).reshape(B, T, KVH, group, v.shape[3]).sum(axis=3)
    return dq, dk, dv


attention_bf16.defvjp(_attention_bf16_fwd, _attention_bf16_bwd)


def capacity_mask(chosen, E, capacity_factor):
    """Which assignments an expert of capacity ceil(factor N k / E) keeps: the first ones in token
    order (a token's slots in their order); no capacity (factor 0) keeps all."""
    N, k = chosen.shape
    kept = np.ones((N, k), dtype=bool)
    if capacity_factor <= 0:
        return kept
    cap = math.ceil(capacity_factor * N * k / E)
    load = np.zeros(E, dtype=np.int64)
    for n in range(N):
        for j in range(k):
            e = chosen[n, j]
            if load[e] >= cap:
                kept[n, j] = False
            else:
                load[e] += 1
    return kept


def group_limited_keys(key, m):
    """Node-limited routing (DeepSeek-V3): each token keeps the topk_group groups (of n_experts /
    n_group consecutive experts) with the largest sum of their two best keys, ties to the lower
    group; the other groups' keys become -inf. Also returns each token's gap between the last kept
    and the first dropped group score (inf without a limit), to tell near-ties apart."""
    key = np.asarray(key, dtype=np.float64)
    G, tg = m.get("n_group", 1), m.get("topk_group", 1)
    N, E = key.shape
    if G <= 1:
        return key, np.full(N, np.inf)
    grouped = key.reshape(N, G, E // G)
    best2 = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)  # (N, G)
    order = np.argsort(-best2, axis=1, kind="stable")
    masked = grouped.copy()
    for n in range(N):
        masked[n, order[n, tg:], :] = -np.inf
    gap = best2[np.arange(N), order[:, tg - 1]] - best2[np.arange(N), order[:, tg]] if tg < G else np.full(N, np.inf)
    return masked.reshape(N, E), gap


def top_k_routing(key, k, m):
    """Each token's k largest selection keys (score + bias) among its allowed groups, ties to the
    lower expert index."""
    masked, _ = group_limited_keys(key, m)
    return np.argsort(-masked, axis=1, kind="stable")[:, :k]


def normalises_gates(m):
    norm = m.get("norm_topk_prob", "auto")
    return norm == "true" or (norm == "auto" and m["gating"] == "sigmoid")


def shift(a, k, fill):
    """a (B, T) moved k positions left within each row, the last k filled."""
    out = np.full_like(a, fill)
    out[:, : a.shape[1] - k] = a[:, k:]
    return out


def forward(p, m, lin_for, tokens, B, T, routing=None):
    """The model's logits (N, V), aux loss, each MoE layer's selection keys and choice (the
    multi-token prediction modules' blocks after the main ones), and each module's logits (N, V).

    p: parameters by name (2-D, FP64); m: the model config; routing: each MoE layer's (N, k) chosen
    experts (from the C++ run, under autograd), or None to choose by the reference's own top-k
    (concrete arrays only: the choice reads the keys' values)."""
    N, D, E, k = B * T, m["d_model"], m["n_experts"], m["top_k"]
    H, KVH, hd = m["n_heads"], m["n_kv_heads"], m["head_dim"]
    # train.activations bf16 (model/moe.h MoeWire, model/transformer.cpp): the residual stream
    # rounded between blocks, forward and backward; the routed experts' rows rounded where they
    # travel in BF16 (their inputs and output gradients where the experts are not blockwise FP8,
    # combine both ways), quantized where they travel in FP8 (which the experts' linear layers
    # do, re-tiling for the weight gradients what was sent).
    bf16 = lin_for.bf16
    fp8_rows = bf16 and lin_for.fp8_experts
    tensor_wire = bf16 and lin_for.tensor_wire  # per-tensor FP8 rows: one scale per exchange
    stream = ROUND_BOTH if bf16 else IDENTITY
    # Inside a block every norm output, query, key, value, attention output, pre-activation and the
    # attention residual: the values (the gradients stay unrounded, as fp8moe's stay FP32).
    rv = ROUND_VALUE if bf16 else IDENTITY
    att = attention_bf16 if bf16 else attention  # its backward reads the kept, rounded output
    expert_in = (ROUND_GRAD if fp8_rows or tensor_wire else ROUND_BOTH) if bf16 else IDENTITY
    expert_out = (ROUND_VALUE if fp8_rows or tensor_wire else ROUND_BOTH) if bf16 else IDENTITY
    state = {"moe_i": 0, "aux": 0.0}
    keys, choices = [], []

    def block(x, pre, dense):
        h = rv(rmsnorm(x, p[pre + "attn_norm.weight"][0], m["norm_eps"]))
        la = lin_for("attention")
        if m.get("attention", "gqa") == "mla":
            a = mla(p, pre + "attn.", m, la, h, B, T, rv, att)
        else:
            q = la(h, p[pre + "attn.wq"]).reshape(B, T, H, hd)
            kk = la(h, p[pre + "attn.wk"]).reshape(B, T, KVH, hd)
            v = rv(la(h, p[pre + "attn.wv"]).reshape(B, T, KVH, hd))
            a = att(rv(rope(q, m["rope_theta"])), rv(rope(kk, m["rope_theta"])), v).reshape(N, H * hd)
        x = rv(x + la(a, p[pre + "attn.wo"]))
        h = rv(rmsnorm(x, p[pre + "ffn_norm.weight"][0], m["norm_eps"]))
        if dense:
            w1 = p[pre + "mlp.w1"]
            f = swiglu_ffn(h, w1, p[pre + "mlp.w3"], p[pre + "mlp.w2"], lin_for("mlp"),
                           lin_for.fuses_w13("mlp", w1.shape[0]), rv=rv, tail=lin_for.swiglu("mlp"))
        else:
            z = lin_for.hp(h, p[pre + "moe.router"])
            prob = jax.nn.sigmoid(z) if m["gating"] == "sigmoid" else jax.nn.softmax(z, axis=-1)
            key = prob + p[pre + "moe.router_bias"][0]
            keys.append(key)
            chosen = routing[state["moe_i"]] if routing is not None else top_k_routing(key, k, m)  # (N, k)
            choices.append(chosen)
            kept = capacity_mask(chosen, E, m.get("capacity_factor", 0.0))
            sel = jnp.take_along_axis(prob, chosen, axis=1)
            gates = sel / jnp.sum(sel, axis=1, keepdims=True) if normalises_gates(m) else sel
            gates = gates * m.get("routed_scaling_factor", 1.0)  # the routed experts' output only
            gates = gates * kept  # a dropped assignment's expert output is not added
            f = jnp.zeros_like(h)
            if m["n_shared_experts"] > 0:
                w1 = p[pre + "moe.shared.w1"]
                f = f + swiglu_ffn(h, w1, p[pre + "moe.shared.w3"], p[pre + "moe.shared.w2"],
                                   lin_for("shared_experts"), lin_for.fuses_w13("shared_experts", w1.shape[0]), rv=rv,
                                   tail=lin_for.swiglu("shared_experts"))
            # Per-tensor FP8 rows: the experts' input at the scale of every routed row's amax; the
            # gradients of all their outputs at one scale (applied to them together below).
            xw = lin_for.wire[0](h, np.nonzero(kept.any(axis=1))[0]) if tensor_wire else h
            placed, outs = [], []
            for e in range(E):
                rows, slots = np.nonzero((chosen == e) & kept)
                if len(rows) == 0:
                    continue
                q_ = f"{pre}moe.experts.{e}."
                lin_in, lin_out = lin_for.expert_linears()
                # train.moe_gates expert: the gates scale the SwiGLU output inside the expert.
                row_gates = gates[rows, slots][:, None] if lin_for.gates_in_experts else None
                outs.append(swiglu_ffn(expert_in(xw[rows]), p[q_ + "w1"], p[q_ + "w3"], p[q_ + "w2"], lin_in,
                                       lin_for.fuses_w13("experts", p[q_ + "w1"].shape[0]), lin_out, rv,
                                       lin_for.swiglu("experts"), row_gates))
                placed.append((rows, slots))
            if outs:
                ys = jnp.concatenate(outs)
                ys = expert_out(lin_for.wire[1](ys) if tensor_wire else ys)
                at = 0
                for rows, slots in placed:
                    y = ys[at:at + len(rows)]
                    f = f.at[rows].add(y if lin_for.gates_in_experts else gates[rows, slots][:, None] * y)
                    at += len(rows)
            if m["aux_loss_coef"] > 0:
                counts = np.bincount(chosen[kept], minlength=E)  # kept assignments only
                fe = counts / (N * k)
                pn = prob if m["gating"] == "softmax" else prob / jnp.sum(prob, axis=1, keepdims=True)
                state["aux"] = state["aux"] + m["aux_loss_coef"] * E * jnp.sum(fe * jnp.mean(pn, axis=0))
            state["moe_i"] += 1
        x = x + f
        return x

    x = stream(p["embed.weight"][tokens])
    for l in range(m["n_layers"]):
        x = block(x, f"layers.{l}.", l < m["first_dense_layers"])
        # The last block's output is rounded, not its gradient (the head's, which no block sends on).
        x = stream(x) if l + 1 < m["n_layers"] else (ROUND_VALUE if bf16 else IDENTITY)(x)
    # Multi-token prediction (DeepSeek-V3 2.2): module k joins the previous depth's hidden state and
    # the embedding of the token k + 1 ahead, [enorm(emb); hnorm(h)] @ eh_proj^T, runs its MoE
    # block, and its own final norm feeds the shared head. The hidden state it reads is the one the
    # head reads, after the final norm (module k > 1: after module k - 1's norm), as the inference
    # implementations that run DeepSeek-V3's MTP weights read it (vLLM's DeepSeekMTP, transformers'
    # MtpLayer).
    mtp_logits = []
    h = rmsnorm(x, p["final_norm.weight"][0], m["norm_eps"])
    main_logits = lin_for.hp(h, p["head.weight"])
    for d in range(m.get("mtp_depth", 0)):
        pre = f"mtp.{d}."
        ahead = shift(tokens.reshape(B, T), d + 1, 0).reshape(N)
        e = rmsnorm(stream(p["embed.weight"][ahead]), p[pre + "enorm.weight"][0], m["norm_eps"])
        # (The first module reads the head's hf rounded under BF16 activations, and its gradient
        # of it is rounded: as a stage of its own receives and sends them, parallel.mtp_own_stage.)
        hn = rmsnorm(stream(h) if d == 0 else h, p[pre + "hnorm.weight"][0], m["norm_eps"])
        h = rmsnorm(block(lin_for.hp(jnp.concatenate([e, hn], axis=-1), p[pre + "eh_proj"]), pre, False),
                    p[pre + "norm.weight"][0], m["norm_eps"])
        mtp_logits.append(lin_for.hp(h, p["head.weight"]))
    return main_logits, state["aux"], keys, choices, mtp_logits


def linear_for(cfg):
    """The linear layer of each class: the recipe's quantized one where FP8 is on, else FP64."""
    lin = make_linear(cfg["recipe"], cfg["tile"], cfg.get("cache_activations", False), cfg.get("format") == "hybrid")

    def lin_for(cls):
        return lin if cls in cfg["fp8_layers"] else (lambda x, w: x @ w.T)

    def fuses_w13(cls, F):
        """Whether fp8moe fuses an FFN's w1 and w3 (model/ffn.h's fuses_w13): always, but for
        blockwise FP8 with a width F that is not a multiple of the tile."""
        return not (cls in cfg["fp8_layers"] and cfg["recipe"] == "blockwise" and F % cfg["tile"] != 0)

    lin_for.fuses_w13 = fuses_w13

    def swiglu(cls):
        """An FFN's SwiGLU and w2: train.recompute selective keeps the pre-activations in FP8 where
        w2 is blockwise FP8 with cached inputs."""
        if (cfg.get("recompute") == "selective" and cfg.get("cache_activations", False)
                and cfg["recipe"] == "blockwise" and cls in cfg["fp8_layers"]):
            return make_fp8_kept_swiglu(cfg["tile"])
        return plain_swiglu

    lin_for.swiglu = swiglu
    # The router, head and eh_proj (train.hp_gemm).
    lin_for.hp = bf16_linear if cfg.get("hp_gemm", "fp32") == "bf16" else (lambda x, w: x @ w.T)
    lin_for.bf16 = cfg.get("activations", "fp32") == "bf16"
    lin_for.gates_in_experts = cfg.get("moe_gates", "combine") == "expert"
    lin_for.fp8_experts = "experts" in cfg["fp8_layers"] and cfg["recipe"] == "blockwise"
    lin_for.tensor_wire = "experts" in cfg["fp8_layers"] and cfg["recipe"] == "current"
    lin_for.wire = make_tensor_wire(ml_dtypes.float8_e5m2 if cfg.get("format") == "hybrid" else ml_dtypes.float8_e4m3fn)

    def expert_linears():
        """The routed experts' input layer (w1, w3) and output layer (w2): with FP8 rows on the
        wire, the weight gradients re-tile the dispatched 1 x T inputs and output gradients."""
        if not (lin_for.bf16 and lin_for.fp8_experts):
            return lin_for("experts"), lin_for("experts")
        return (make_linear("blockwise", cfg["tile"], True),
                make_linear("blockwise", cfg["tile"], cfg.get("cache_activations", False), retile_dy=True))

    lin_for.expert_linears = expert_linears
    return lin_for


def main(d):
    cfg = json.load(open(os.path.join(d, "config.json")))
    m = cfg["model"]
    B, T = cfg["B"], cfg["T"]
    N, E, k = B * T, m["n_experts"], m["top_k"]
    names = cfg["params"]
    shapes = {n: tuple(s) for n, s in zip(names, cfg["shapes"])}
    params = {n: jnp.asarray(np.fromfile(os.path.join(d, "param." + n + ".bin"), dtype=np.float32)
                             .astype(np.float64).reshape(shapes[n])) for n in names}
    tokens = np.fromfile(os.path.join(d, "tokens.bin"), dtype=np.int32)
    targets = np.fromfile(os.path.join(d, "targets.bin"), dtype=np.int32)
    routing = np.fromfile(os.path.join(d, "routing.bin"), dtype=np.int32).reshape(-1, N, k)
    trainable = cfg["trainable"]
    lin_for = linear_for(cfg)

    def mean_ce(logits, tgt):
        keep = tgt != m["pad_id"]
        lse = jax.scipy.special.logsumexp(logits, axis=-1)
        nll = lse - logits[np.arange(N), np.where(keep, tgt, 0)]
        return jnp.sum(jnp.where(keep, nll, 0.0)) / np.sum(keep)

    def loss_fn(p):
        logits, aux, keys, _, mtp_logits = forward(p, m, lin_for, tokens, B, T, routing)
        loss = mean_ce(logits, targets) + aux
        # Module d predicts the targets d + 1 ahead; the last d + 1 positions of a sequence predict
        # nothing (their targets are padding).
        for d, lg in enumerate(mtp_logits):
            ahead = shift(targets.reshape(B, T), d + 1, m["pad_id"]).reshape(N)
            loss = loss + m["mtp_loss_weight"] / len(mtp_logits) * mean_ce(lg, ahead)
        return loss, keys

    (loss, keys), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    # Our own top-k against the C++ choice, outside near-ties.
    mismatches = 0
    for i, key in enumerate(keys):
        key, group_gap = group_limited_keys(key, m)
        order = np.argsort(-key, axis=1, kind="stable")  # stable: ties to the lower index
        for n in range(N):
            if sorted(order[n, :k]) != sorted(routing[i][n]):
                gap = key[n, order[n, k - 1]] - key[n, order[n, k]] if k < E else np.inf
                # FP32 keys of size ~1 carry ~1e-7: a closer pair (of experts or groups) may swap.
                mismatches += int(gap > 1e-6 and group_gap[n] > 1e-6)
    with open(os.path.join(d, "routing_check.txt"), "w") as f:
        f.write(f"{mismatches}\n")
    with open(os.path.join(d, "loss.txt"), "w") as f:
        f.write(repr(float(loss)) + "\n")
    for n in names:
        if trainable[names.index(n)]:
            np.asarray(grads[n], dtype=np.float32).tofile(os.path.join(d, "grad." + n + ".bin"))


if __name__ == "__main__":
    main(sys.argv[1])
