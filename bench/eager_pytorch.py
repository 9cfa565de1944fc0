#!/usr/bin/env python3
"""The model of configs/tiny.yaml and its AdamW step in eager PyTorch, for a side-by-side speed
comparison with fp8moe (bench/compare-eager.sh). Same shapes: vocab 256, d_model 256, 4 blocks
(1 dense SwiGLU 1024, 3 MoE: 8 experts of 256, top-2 sigmoid gating normalised over the chosen,
1 shared), 8 heads of 32, RoPE, RMSNorm; global batch 8 x 256 tokens in 4 micro-batches. Attention
is F.scaled_dot_product_attention(is_causal=True), which on the CPU is PyTorch's flash-attention
kernel (blocks above the diagonal skipped), as fp8moe's CPU attention skips its causal tiles.

Usage: eager_pytorch.py {fp32|bf16} STEPS [cpu|cuda] [--threads N]
prints three lines:
  tokens_per_s <tokens per step / the median step time of the steps after the first 2 (warm-up)>
  median_step_s <that median, seconds>
  threads <torch.get_num_threads(): N when given (torch.set_num_threads), else PyTorch's default>
bench/compare-eager.sh and bench/gpu-vs-eager.sh read the first. On cuda the model, its optimizer
state and the data live on the GPU, BF16 autocast runs there, and each step ends with
torch.cuda.synchronize() before it is timed (scripts/device-check.sh runs it beside fp8moe on the
same GPU).
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

V, D, L, H, KVH, HD, FF, E, K, DE, T, B, MB = 256, 256, 4, 8, 8, 32, 1024, 8, 2, 256, 256, 8, 4


def rmsnorm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x):  # (b, t, h, d), halves rotated against each other
    half = HD // 2
    inv = 10000.0 ** (-torch.arange(half, dtype=torch.float32, device=x.device) * 2 / HD)
    ang = torch.arange(x.shape[1], dtype=torch.float32, device=x.device)[:, None] * inv[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        p = lambda *s: torch.nn.Parameter(torch.randn(*s) * 0.02)
        self.embed, self.head = p(V, D), p(V, D)
        self.norms = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(D)) for _ in range(2 * L + 1)])
        self.wq = torch.nn.ParameterList([p(H * HD, D) for _ in range(L)])
        self.wk = torch.nn.ParameterList([p(KVH * HD, D) for _ in range(L)])
        self.wv = torch.nn.ParameterList([p(KVH * HD, D) for _ in range(L)])
        self.wo = torch.nn.ParameterList([p(D, H * HD) for _ in range(L)])
        self.dense = torch.nn.ParameterList([p(FF, D), p(FF, D), p(D, FF)])
        self.router = torch.nn.ParameterList([p(E, D) for _ in range(L - 1)])
        swiglu = lambda width: [p(width, D), p(width, D), p(D, width)]  # w1, w3, w2
        self.shared = torch.nn.ParameterList([w for _ in range(L - 1) for w in swiglu(DE)])
        self.experts = torch.nn.ParameterList([w for _ in range((L - 1) * E) for w in swiglu(DE)])

    def ffn(self, x, w1, w3, w2):
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)

    def forward(self, tokens):
        b, t = tokens.shape
        x = self.embed[tokens]
        for l in range(L):
            h = rmsnorm(x, self.norms[2 * l])
            q = rope(F.linear(h, self.wq[l]).view(b, t, H, HD)).transpose(1, 2)
            k = rope(F.linear(h, self.wk[l]).view(b, t, KVH, HD)).transpose(1, 2)
            v = F.linear(h, self.wv[l]).view(b, t, KVH, HD).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # PyTorch's fused causal kernel
            x = x + F.linear(a.transpose(1, 2).reshape(b, t, H * HD), self.wo[l])
            h = rmsnorm(x, self.norms[2 * l + 1])
            if l == 0:
                x = x + self.ffn(h, *self.dense)
                continue
            m = l - 1
            flat = h.reshape(-1, D)
            prob = torch.sigmoid(F.linear(flat.float(), self.router[m]))
            gate, idx = prob.topk(K, dim=-1)
            gate = (gate / gate.sum(-1, keepdim=True)).to(flat.dtype)
            out = self.ffn(flat, *self.shared[3 * m: 3 * m + 3])
            for e in range(E):
                rows, slot = (idx == e).nonzero(as_tuple=True)
                if rows.numel() == 0:
                    continue
                w = self.experts[3 * (m * E + e): 3 * (m * E + e) + 3]
                out = out.index_add(0, rows, (gate[rows, slot, None] * self.ffn(flat[rows], *w)).to(out.dtype))
            x = x + out.view(b, t, D)
        return F.linear(rmsnorm(x, self.norms[2 * L]), self.head)


def main():
    ap = argparse.ArgumentParser(description="tiny.yaml's model and AdamW step in eager PyTorch")
    ap.add_argument("mode", choices=["fp32", "bf16"])
    ap.add_argument("steps", type=int)
    ap.add_argument("device", nargs="?", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads(N) (default: PyTorch's own)")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error("STEPS must be at least 3: the first 2 are warm-up")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    mode, steps, device = args.mode, args.steps, args.device
    torch.manual_seed(0)
    model = Model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    data = torch.randint(0, V, (steps, B, T + 1), device=device)
    times = []
    for s in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for mb in range(MB):
            chunk = data[s, mb * (B // MB):(mb + 1) * (B // MB)]
            with torch.autocast(device, dtype=torch.bfloat16, enabled=(mode == "bf16")):
                logits = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, V), chunk[:, 1:].reshape(-1)) / MB
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    # NOTE: the median, not the mean: one step slowed by the machine's other work moves it little.
    step_s = statistics.median(times[2:])
    print(f"tokens_per_s {B * T / step_s:.1f}")
    print(f"median_step_s {step_s:.4f}")
    print(f"threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
