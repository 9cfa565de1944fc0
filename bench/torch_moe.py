#!/usr/bin/env python3
"""The model of an fp8moe config, trained in PyTorch: the side-by-side reference of bench/gpu-moe.sh.

It reads the fp8moe YAML config for every shape (model.*, train.global_batch / seq_len / lr /
betas / weight_decay / grad_clip, parallel.micro_batches) and trains that model as a PyTorch user
would on one GPU: BF16 autocast over FP32 master weights, fused AdamW (FP32 moments), flash
attention through F.scaled_dot_product_attention (causal; GQA by repeating the key/value heads),
RMSNorm, RoPE (halves rotated against each other), a dense SwiGLU for the first
model.first_dense_layers blocks and an MoE for the rest: sigmoid (or softmax) scores, top-k of the
scores plus the aux-loss-free bias, gates normalised over the chosen k (model.moe.norm_topk_prob),
model.moe.routed_scaling_factor, the bias moved by model.moe.bias_update_rate after every step
towards balance, shared experts always on; fp8moe's initialisation (output projections at
init_std / sqrt(2 n_layers)) and learning-rate schedule (train.warmup_steps, schedule, min_lr,
over train.steps). The routed experts run as
  grouped  one torch._grouped_mm per projection over the tokens sorted by expert (the default
           where it exists: PyTorch >= 2.8 on a GPU with BF16), or
  loop     a Python loop over the experts (what MoE code without a grouped GEMM does).
No group-limited routing, capacity or aux loss (the benchmark config uses none of them).

The data: a Megatron indexed data set (PREFIX.bin + .idx; --data, default the config's data.path)
read whole, windows of seq_len + 1 tokens at random offsets; or random tokens with --data random.

Prints one line per step and then one JSON line:
  {"tokens_per_s", "step_time_s", "peak_mem_bytes", "loss_first", "loss_last", "flops_per_token",
   "mfu_bf16", "params_total", "params_active", ...}
tokens_per_s is the mean over the steps after the --warmup ones (default 3); each step ends with a
synchronisation before it is timed. flops_per_token is fp8moe's own formula (app/step_report.cpp):
3 x (2 x the activated GEMM parameters + 2 x heads x head_dim x seq_len per layer), so that both
programs' MFU share one numerator.

usage: torch_moe.py CONFIG [--steps N] [--warmup N] [--device cuda|cpu] [--dtype bf16|fp32]
                           [--experts grouped|loop] [--compile] [--data PREFIX|random] [--seed S]
                           [--set key=value ...]   (like fp8moe's --set, for model/train keys)
"""
import argparse
import json
import math
import struct
import sys
import time

import torch
import torch.nn.functional as F
import yaml

BF16_DENSE_PEAK = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "B200": 2250e12}


# fp8moe's defaults (`fp8moe defaults`) for the keys this script reads.
M_DEFAULTS = {"vocab_size": 256, "d_model": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 8, "head_dim": 32,
              "rope_theta": 10000.0, "norm_eps": 1e-6, "first_dense_layers": 1, "d_ff_dense": 1024, "init_std": 0.02}
MOE_DEFAULTS = {"n_experts": 8, "top_k": 2, "n_shared_experts": 1, "d_expert": 256, "gating": "sigmoid",
                "bias_update_rate": 0.001, "routed_scaling_factor": 1.0, "norm_topk_prob": "auto", "n_group": 1,
                "capacity_factor": 0.0, "aux_loss_coef": 0.0}
T_DEFAULTS = {"global_batch": 8, "seq_len": 256, "lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 100,
              "schedule": "cosine", "steps": 1000, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
              "weight_decay": 0.1, "grad_clip": 1.0, "seed": 1234}


def learning_rate(t, step):  # model/optimizer.cpp, learning_rate (step from 0)
    if t["warmup_steps"] > 0 and step < t["warmup_steps"]:
        return t["lr"] * (step + 1) / t["warmup_steps"]
    if t["schedule"] == "constant":
        return t["lr"]
    decay = t["steps"] - t["warmup_steps"]
    progress = 1.0 if decay <= 1 else min(1.0, (step - t["warmup_steps"]) / (decay - 1))
    if t["schedule"] == "linear":
        return t["lr"] - (t["lr"] - t["min_lr"]) * progress
    return t["min_lr"] + 0.5 * (t["lr"] - t["min_lr"]) * (1.0 + math.cos(math.pi * progress))


def load_config(path, sets):
    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    for s in sets:
        key, _, value = s.partition("=")
        node = cfg
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = yaml.safe_load(value)
    m = dict(M_DEFAULTS)
    m.update(cfg.get("model", {}))
    moe = dict(MOE_DEFAULTS)
    moe.update(m.get("moe", {}) or {})
    m["moe"] = moe
    t = dict(T_DEFAULTS)
    t.update(cfg.get("train", {}))
    par = {"micro_batches": 1}
    par.update(cfg.get("parallel", {}))
    data = cfg.get("data", {}) or {}
    # PyYAML reads 3e-4 (no dot) as a string where yaml-cpp reads a number: a string given for a key
    # whose default is a number is read as one.
    for section, defaults in ((m, M_DEFAULTS), (moe, MOE_DEFAULTS), (t, T_DEFAULTS), (par, {"micro_batches": 1})):
        for k, d in defaults.items():
            if isinstance(d, (int, float)) and not isinstance(d, bool) and isinstance(section[k], str):
                try:
                    section[k] = type(d)(float(section[k])) if isinstance(d, float) else int(section[k])
                except ValueError:
                    sys.exit(f"torch_moe.py: {k}: expected a number, got {section[k]!r}")
    if moe["n_group"] != 1 or moe["capacity_factor"] != 0 or moe["aux_loss_coef"] != 0:
        sys.exit("torch_moe.py: group-limited routing, capacity and the aux loss are not modelled here")
    return m, t, par, data


def flops_per_token(m, T):  # app/step_report.cpp, model_flops_per_token
    D, q, kv = m["d_model"], m["n_heads"] * m["head_dim"], m["n_kv_heads"] * m["head_dim"]
    moe = m["moe"]
    per_layer = 2 * (D * q + 2 * D * kv + q * D) + 2.0 * q * T
    total = 0.0
    for layer in range(m["n_layers"]):
        if layer < m["first_dense_layers"]:
            ffn = 2 * 3 * D * m["d_ff_dense"]
        else:
            ffn = 2 * 3 * D * moe["d_expert"] * (moe["top_k"] + moe["n_shared_experts"]) + 2 * D * moe["n_experts"]
        total += per_layer + ffn
    total += 2 * D * m["vocab_size"]
    return 3.0 * total


def read_tokens(prefix):
    """The whole token stream of a Megatron indexed data set, as int64."""
    with open(prefix + ".idx", "rb") as f:
        head = f.read(34)
    if head[:9] != b"MMIDIDX\x00\x00":
        sys.exit(f"torch_moe.py: {prefix}.idx is not a Megatron indexed data set")
    code = head[17]
    dtypes = {1: torch.uint8, 2: torch.int8, 3: torch.int16, 4: torch.int32, 5: torch.int64, 8: torch.int16}
    if code not in dtypes:
        sys.exit(f"torch_moe.py: {prefix}.idx: token dtype code {code} is not an integer type")
    with open(prefix + ".bin", "rb") as f:
        raw = bytearray(f.read())
    tokens = torch.frombuffer(raw, dtype=dtypes[code]).to(torch.int64)
    if code == 8:  # uint16, read as int16
        tokens = tokens & 0xFFFF
    return tokens


def rmsnorm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class Block(torch.nn.Module):
    def __init__(self, m, dense, std):
        super().__init__()
        D, H, KVH, HD = m["d_model"], m["n_heads"], m["n_kv_heads"], m["head_dim"]
        # fp8moe's init (model/param_table.cpp): the output projections (wo, w2) at std / sqrt(2 L).
        out_std = std / math.sqrt(2.0 * m["n_layers"])
        p = lambda *s: torch.nn.Parameter(torch.randn(*s) * std)
        po = lambda *s: torch.nn.Parameter(torch.randn(*s) * out_std)
        self.m, self.dense = m, dense
        self.attn_norm, self.mlp_norm = torch.nn.Parameter(torch.ones(D)), torch.nn.Parameter(torch.ones(D))
        self.wqkv = p((H + 2 * KVH) * HD, D)
        self.wo = po(D, H * HD)
        moe = m["moe"]
        if dense:
            F_ = m["d_ff_dense"]
            self.w13, self.w2 = p(2 * F_, D), po(D, F_)
        else:
            E, DE, S = moe["n_experts"], moe["d_expert"], moe["n_shared_experts"]
            self.router = p(E, D)
            self.register_buffer("bias", torch.zeros(E))
            self.register_buffer("load", torch.zeros(E))
            self.e13 = p(E, D, 2 * DE)  # grouped layout: x (rows, D) @ e13[e] (D, 2 DE)
            self.e2 = po(E, DE, D)
            if S:
                self.s13, self.s2 = p(2 * S * DE, D), po(D, S * DE)

    def attention(self, x, rope):
        m = self.m
        b, t, _ = x.shape
        H, KVH, HD = m["n_heads"], m["n_kv_heads"], m["head_dim"]
        qkv = F.linear(x, self.wqkv).view(b, t, H + 2 * KVH, HD)
        q, k, v = qkv[:, :, :H], qkv[:, :, H:H + KVH], qkv[:, :, H + KVH:]
        cos, sin = rope
        half = HD // 2

        def rot(z):
            a, c = z[..., :half], z[..., half:]
            return torch.cat([a * cos - c * sin, a * sin + c * cos], dim=-1)

        q, k = rot(q).transpose(1, 2), rot(k).transpose(1, 2)
        v = v.transpose(1, 2)
        if KVH != H:
            k, v = k.repeat_interleave(H // KVH, dim=1), v.repeat_interleave(H // KVH, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear(o.transpose(1, 2).reshape(b, t, H * HD), self.wo)

    def experts(self, x, experts_mode):
        moe = self.m["moe"]
        E, K = moe["n_experts"], moe["top_k"]
        with torch.autocast(x.device.type, enabled=False):  # the router in FP32, as fp8moe's
            logits = F.linear(x.float(), self.router.float())
        scores = torch.sigmoid(logits) if moe["gating"] == "sigmoid" else torch.softmax(logits, dim=-1)
        chosen = torch.topk(scores + self.bias, K, dim=-1).indices
        gates = scores.gather(-1, chosen)
        norm = moe["norm_topk_prob"]
        if norm is True or norm == "true" or (norm == "auto" and moe["gating"] == "sigmoid"):
            gates = gates / gates.sum(-1, keepdim=True)
        gates = gates * moe["routed_scaling_factor"]
        flat = chosen.reshape(-1)
        # Counts by scatter_add (a static shape, which torch.compile keeps in one graph; bincount's is not).
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        with torch.no_grad():
            self.load += counts.float()
        order = torch.argsort(flat, stable=True)
        rows = x[order // K]
        if torch.is_autocast_enabled(x.device.type):  # _grouped_mm is not autocast: its operands in BF16
            rows = rows.to(torch.get_autocast_dtype(x.device.type))
        DE = moe["d_expert"]
        if experts_mode == "grouped":
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = torch._grouped_mm(rows, self.e13.to(rows.dtype), offs=offs)
            h = F.silu(h[:, :DE]) * h[:, DE:]
            y = torch._grouped_mm(h, self.e2.to(rows.dtype), offs=offs)
        else:
            outs, start = [], 0
            for e, c in enumerate(counts.tolist()):
                r = rows[start:start + c]
                h = r @ self.e13[e].to(r.dtype)
                outs.append((F.silu(h[:, :DE]) * h[:, DE:]) @ self.e2[e].to(r.dtype))
                start += c
            y = torch.cat(outs)
        out = torch.zeros(flat.numel(), x.shape[-1], dtype=y.dtype, device=x.device)
        out[order] = y
        out = (out.view(-1, K, x.shape[-1]) * gates.unsqueeze(-1).to(y.dtype)).sum(1)
        return out

    def forward(self, x, rope, experts_mode):
        eps = self.m["norm_eps"]
        x = x + self.attention(rmsnorm(x, self.attn_norm, eps), rope)
        h = rmsnorm(x, self.mlp_norm, eps)
        if self.dense:
            a, g = F.linear(h, self.w13).chunk(2, dim=-1)
            return x + F.linear(F.silu(a) * g, self.w2)
        b, t, D = h.shape
        flat = h.reshape(b * t, D)
        y = self.experts(flat, experts_mode)
        if hasattr(self, "s13"):
            a, g = F.linear(flat, self.s13).chunk(2, dim=-1)
            y = y + F.linear(F.silu(a) * g, self.s2)
        return x + y.view(b, t, D)


class Model(torch.nn.Module):
    def __init__(self, m, experts_mode):
        super().__init__()
        std = m["init_std"]
        self.m, self.experts_mode = m, experts_mode
        self.embed = torch.nn.Parameter(torch.randn(m["vocab_size"], m["d_model"]) * std)
        self.head = torch.nn.Parameter(torch.randn(m["vocab_size"], m["d_model"]) * std)
        self.final_norm = torch.nn.Parameter(torch.ones(m["d_model"]))
        self.blocks = torch.nn.ModuleList(
            [Block(m, layer < m["first_dense_layers"], std) for layer in range(m["n_layers"])])

    def forward(self, tokens, targets, rope):
        x = F.embedding(tokens, self.embed)
        for blk in self.blocks:
            x = blk(x, rope, self.experts_mode)
        logits = F.linear(rmsnorm(x, self.final_norm, self.m["norm_eps"]), self.head)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def count_params(m):
    D, q, kv, moe = m["d_model"], m["n_heads"] * m["head_dim"], m["n_kv_heads"] * m["head_dim"], m["moe"]
    attn = D * (q + 2 * kv) + q * D + 2 * D
    total = active = 2 * m["vocab_size"] * D + D
    for layer in range(m["n_layers"]):
        if layer < m["first_dense_layers"]:
            f = 3 * D * m["d_ff_dense"]
            total, active = total + attn + f, active + attn + f
        else:
            per = 3 * D * moe["d_expert"]
            shared = per * moe["n_shared_experts"] + D * moe["n_experts"]
            total += attn + shared + per * moe["n_experts"]
            active += attn + shared + per * moe["top_k"]
    return total, active


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--experts", choices=["grouped", "loop"], default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--data", default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    a = ap.parse_args()
    if a.steps <= a.warmup:
        sys.exit("torch_moe.py: --steps must exceed --warmup")
    m, t, par, data = load_config(a.config, a.sets)
    dev = torch.device(a.device)
    grouped_ok = hasattr(torch, "_grouped_mm") and dev.type == "cuda" and a.dtype == "bf16"
    experts_mode = a.experts or ("grouped" if grouped_ok else "loop")
    if experts_mode == "grouped" and not grouped_ok:
        sys.exit("torch_moe.py: --experts grouped needs torch._grouped_mm on a GPU with --dtype bf16")
    torch.manual_seed(t["seed"] if a.seed is None else a.seed)
    B, T, M = t["global_batch"], t["seq_len"], par["micro_batches"]
    if B % M:
        sys.exit("torch_moe.py: train.global_batch must be a multiple of parallel.micro_batches")
    prefix = a.data if a.data is not None else data.get("path", "")
    if isinstance(prefix, list):
        sys.exit("torch_moe.py: a data blend is not supported; give --data PREFIX")
    if prefix == "random":
        stream = None
    else:
        stream = read_tokens(prefix)
        if stream.numel() < T + 2:
            sys.exit(f"torch_moe.py: {prefix} has {stream.numel()} tokens, fewer than seq_len + 2")
        if int(stream.max()) >= m["vocab_size"]:
            sys.exit(f"torch_moe.py: {prefix} has token ids >= model.vocab_size")

    model = Model(m, experts_mode).to(dev)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    fused = dev.type == "cuda"
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=learning_rate(t, 0), betas=(t["beta1"], t["beta2"]), eps=t["eps"], fused=fused)
    HD = m["head_dim"]
    inv = m["rope_theta"] ** (-torch.arange(HD // 2, dtype=torch.float32, device=dev) * 2 / HD)
    ang = torch.arange(T, dtype=torch.float32, device=dev)[:, None] * inv[None, :]
    rope32 = (ang.cos()[None, :, None, :], ang.sin()[None, :, None, :])
    amp = torch.bfloat16 if a.dtype == "bf16" else None
    rope = tuple(r.to(amp) for r in rope32) if amp else rope32
    fwd = torch.compile(model) if a.compile else model
    gen = torch.Generator().manual_seed(t["seed"] + 1)

    def batch():
        if stream is None:
            seq = torch.randint(0, m["vocab_size"], (B // M, T + 1), generator=gen)
        else:
            starts = torch.randint(0, stream.numel() - T - 1, (B // M,), generator=gen)
            seq = torch.stack([stream[s:s + T + 1] for s in starts.tolist()])
        seq = seq.to(dev, non_blocking=True)
        return seq[:, :-1], seq[:, 1:]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    moe_blocks = [b for b in model.blocks if not b.dense]
    for step in range(a.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(t, step)
        sync()
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(M):
            x, y = batch()
            with torch.autocast(dev.type, dtype=amp, enabled=amp is not None):
                loss = fwd(x, y, rope) / M
            loss.backward()
            total += loss.detach()
        if t["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # the aux-loss-free bias: towards the mean load, by a fixed step
            for b in moe_blocks:
                b.bias += m["moe"]["bias_update_rate"] * torch.sign(b.load.mean() - b.load)
                b.load.zero_()
        loss_value = float(total)
        sync()
        dt = time.perf_counter() - t0
        times.append(dt)
        losses.append(loss_value)
        print(f"step {step + 1:4d}/{a.steps}  loss {loss_value:.4f}  {B * T / dt:9.0f} tok/s  {dt:.3f} s/step",
              flush=True)
    timed = times[a.warmup:]
    step_s = sum(timed) / len(timed)
    tps = B * T / step_s
    fpt = flops_per_token(m, T)
    total_p, active_p = count_params(m)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    peak = next((v for k, v in BF16_DENSE_PEAK.items() if k in name), None)
    out = {"tokens_per_s": tps, "step_time_s": step_s, "loss_first": losses[0], "loss_last": losses[-1],
           "peak_mem_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
           "flops_per_token": fpt, "mfu_bf16": tps * fpt / peak if peak else None, "device": name,
           "experts": experts_mode, "compile": a.compile, "dtype": a.dtype, "torch": torch.__version__,
           "params_total": total_p, "params_active": active_p, "steps": a.steps, "warmup": a.warmup}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
