#!/usr/bin/env python3
"""Generation by the independent reference (model_ref.py's forward, FP64, the checkpoint's FP8
recipe), checked token by token against what `fp8moe generate` printed.

Usage: generate_ref.py CHECKPOINT_H5 PROMPT TOKENS TEMPERATURE TOP_K SEED PRINTED_FILE
Reads the weights and the model config from the checkpoint with h5py (no fp8moe code), feeds token
0 (a document start), the prompt's bytes and the bytes fp8moe printed, and at each of the TOKENS
steps draws a token from its own logits (one causal forward, routing with its own top-k) given the
tokens before it, as fp8moe saw them; fp8moe must have printed that token (or stopped, at 0).
A token is drawn as the README says (under Training): the TOP_K largest logits (0: all; ties to
the lower id), weights exp((l - l_max) / TEMPERATURE), the first whose cumulative weight exceeds
u times their sum, u = (x + 0.5) 2^-32 with x the first word of
Philox4x32-10 at counter (step, 0, 0x47454E, 0) and key (SEED mod 2^32, SEED >> 32), implemented
here from Random123's specification; TEMPERATURE 0 takes the largest logit. The printed bytes are
read back (fp8moe writes invalid UTF-8 and control bytes other than newline and tab as \\xNN). The
two may part only at a near-tie, where FP32 and FP64 arithmetic may choose differently: greedy, the
two largest logits within 1e-4; sampled, u within 1e-4 of a cumulative boundary or the k-th and
next logit within 1e-4 (FP32 logits of size ~10 carry errors ~1e-5). The rest is then not compared.
Prints how many tokens agreed; exit 0 on agreement.
"""
import os
import sys

import h5py
import numpy as np

import model_ref

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "io"))
from check_checkpoint import read_tensors  # noqa: E402  (the checkpoint's layout, from the README)


M0, M1, W0, W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
MASK = 0xFFFFFFFF


def philox4x32_10(counter, key):
    """Random123's Philox4x32 with 10 rounds (Salmon et al., SC 2011)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
        p0, p1 = M0 * c0, M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & MASK, p1 & MASK, ((p0 >> 32) ^ c3 ^ k1) & MASK, p0 & MASK
    return c0, c1, c2, c3


assert philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)  # Random123's KAT


def draw(logits, temperature, top_k, u):
    """The token, and how far the choice is from changing (the margin the near-tie rule reads)."""
    order = np.argsort(-logits, kind="stable")
    if temperature <= 0:
        return int(order[0]), float(logits[order[0]] - logits[order[1]])
    k = min(top_k, len(logits)) if top_k > 0 else len(logits)
    w = np.exp((logits[order[:k]] - logits[order[0]]) / temperature)
    cdf = np.cumsum(w) / np.sum(w)
    j = min(int(np.searchsorted(cdf, u, side="right")), k - 1)
    margin = float(np.min(np.abs(cdf[:-1] - u))) if k > 1 else np.inf
    if k < len(logits):
        margin = min(margin, float(logits[order[k - 1]] - logits[order[k]]))
    return int(order[j]), margin


def parse_config(text):
    """The two levels of the effective config (YAML of `key: value` lines, nested by indentation)."""
    cfg, path = {}, []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        key, _, value = line.strip().partition(":")
        path = path[:depth] + [key]
        value = value.strip()
        if value:
            cfg[".".join(path)] = value
    return cfg


def printable(data):
    out, i = [], 0
    while i < len(data):
        c = data[i]
        n = 1 if c < 0x80 else 2 if c >> 5 == 0x6 else 3 if c >> 4 == 0xE else 4 if c >> 3 == 0x1E else 0
        try:
            text = data[i:i + n].decode("utf-8") if n and i + n <= len(data) else None
        except UnicodeDecodeError:
            text = None
        if text is None or (n == 1 and c < 0x20 and c not in (0x0A, 0x09)) or c == 0x7F:
            out.append("\\x%02X" % c)
            i += 1
        else:
            out.append(text)
            i += n
    return "".join(out)


def unprintable(text):
    """The bytes behind printable()'s text: \\xNN escapes back to bytes, the rest UTF-8."""
    out, i = bytearray(), 0
    while i < len(text):
        if text.startswith("\\x", i) and i + 4 <= len(text):
            out.append(int(text[i + 2:i + 4], 16))
            i += 4
        else:
            out += text[i].encode("utf-8", errors="surrogateescape")
            i += 1
    return bytes(out)


def main(h5_path, prompt, tokens, temperature, top_k, seed, printed_path):
    f = h5py.File(h5_path, "r")
    attr = f.attrs["config"]
    c = parse_config(attr.decode() if isinstance(attr, bytes) else attr)
    m = {key: float(c["model." + key]) for key in ("rope_theta", "norm_eps")}
    for key in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "first_dense_layers"):
        m[key] = int(c["model." + key])
    for key in ("n_experts", "top_k", "n_shared_experts"):
        m[key] = int(c["model.moe." + key])
    m["gating"] = c["model.moe.gating"]
    m["aux_loss_coef"] = 0.0  # the loss is not needed here
    m["capacity_factor"] = 0.0  # generation keeps every assignment (no capacity at inference)
    layers = c["fp8.layers"].strip("[]").replace(" ", "").split(",")
    recipe = c["fp8.recipe"]
    if recipe not in ("off", "blockwise", "current"):
        sys.exit(f"generate_ref.py: recipe {recipe} is not modelled")
    lin_for = model_ref.linear_for({"recipe": recipe, "tile": int(c["fp8.tile"]), "fp8_layers": layers,
                                    "cache_activations": False, "format": c["fp8.format"]})
    params = read_tensors(f["params"], np.float64)  # README "Checkpoints": stacked datasets split
    window = int(c["train.seq_len"])

    printed = open(printed_path, encoding="utf-8", errors="surrogateescape").read()
    printed = printed[:-1] if printed.endswith("\n") else printed  # the line's own newline
    head = bytes(b for b in prompt.encode() if b)
    got = unprintable(printed)
    if not got.startswith(head):
        sys.exit(f"generate_ref.py: the printed line does not start with the prompt: {printed!r}")
    got = list(got[len(head):])
    if len(got) > tokens:
        sys.exit(f"generate_ref.py: fp8moe printed {len(got)} tokens, more than the {tokens} asked for: {printed!r}")

    # Teacher forcing: the reference's draw at each step, given fp8moe's tokens before it. While the
    # two agree that is the reference's own generation; the first disagreement ends the comparison.
    ctx = [0] + list(head)
    full = ctx + got
    whole = None
    if len(full) <= window:  # one causal forward gives every step's logits
        whole = np.asarray(model_ref.forward(params, m, lin_for, np.asarray(full, dtype=np.int32), 1, len(full))[0])
    margins = []
    for i in range(min(tokens, len(got) + 1)):
        if whole is not None:
            logits = whole[len(ctx) + i - 1]
        else:
            x = np.asarray(full[:len(ctx) + i][-window:], dtype=np.int32)
            logits = np.asarray(model_ref.forward(params, m, lin_for, x, 1, len(x))[0])[-1]
        u = (philox4x32_10((i, 0, 0x47454E, 0), (seed & MASK, seed >> 32))[0] + 0.5) * 2.0**-32
        token, margin = draw(logits, temperature, top_k, u)
        printed_token = got[i] if i < len(got) else 0  # fp8moe stops without printing at token 0
        if token == printed_token:
            margins.append(margin)
            if token == 0:
                break
            continue
        if margin < 1e-4:
            print(f"generate_ref: {i} tokens agree with the reference, then a near-tie (margin {margin:.2e}): "
                  "not compared further")
            return 0
        sys.exit(f"generate_ref.py: token {i + 1}: the reference draws {token} (margin {margin:.2e}), fp8moe "
                 f"{'printed ' + str(printed_token) if i < len(got) else 'stopped'}: {printed!r}")
    print(f"generate_ref: all {len(got)} generated tokens agree with the reference (smallest margin "
          f"{min(margins):.2e}): {printed!r}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 8:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]),
                  sys.argv[7]))
