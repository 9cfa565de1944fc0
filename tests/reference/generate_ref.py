#!/usr/bin/env python3
"""Greedy generation by the independent reference (model_ref.py's forward, FP64, the checkpoint's
FP8 recipe), checked against what `fp8moe generate --temperature 0` printed.

Usage: generate_ref.py CHECKPOINT_H5 PROMPT TOKENS PRINTED_FILE
Reads the weights and the model config from the checkpoint with h5py (no fp8moe code), feeds token
0 (a document start) and the prompt's bytes, and appends the argmax of the last position's logits
TOKENS times (stopping at token 0), routing with its own top-k. Then compares its tokens with the
bytes of the printed line (fp8moe writes invalid UTF-8 and control bytes other than newline and
tab as \\xNN; they are read back). They may part only where the reference's two largest logits are
a near-tie (within 1e-4: FP32 and FP64 arithmetic may pick either); the rest is then not compared.
Prints a line saying how many tokens agreed; exit 0 on agreement.
"""
import sys

import h5py
import numpy as np

import model_ref


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


def main(h5_path, prompt, tokens, printed_path):
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
    params = {n: np.asarray(d, dtype=np.float64) for n, d in f["params"].items()}
    window = int(c["train.seq_len"])

    ctx = [0] + [b for b in prompt.encode() if b]
    generated, gaps = [], []
    for _ in range(tokens):
        x = np.asarray(ctx[-window:], dtype=np.int32)
        logits, _, _, _ = model_ref.forward(params, m, lin_for, x, 1, len(x))
        last = np.asarray(logits)[-1]
        order = np.argsort(-last, kind="stable")
        gaps.append(last[order[0]] - last[order[1]])
        if order[0] == 0:
            break
        ctx.append(int(order[0]))
        generated.append(int(order[0]))

    printed = open(printed_path, encoding="utf-8", errors="surrogateescape").read().rstrip("\n")
    got = unprintable(printed)
    head = bytes(b for b in prompt.encode() if b)
    if not got.startswith(head):
        sys.exit(f"generate_ref.py: the printed line does not start with the prompt: {printed!r}")
    got = got[len(head):]
    for i, (t, g) in enumerate(zip(generated, gaps)):
        if i < len(got) and got[i] == t:
            continue
        if g < 1e-4:
            print(f"generate_ref: {i} tokens agree with the reference, then a near-tie (top-2 logit gap {g:.2e}): "
                  "not compared further")
            return 0
        sys.exit(f"generate_ref.py: token {i + 1}: the reference's argmax is {t} (top-2 logit gap {g:.2e}), fp8moe "
                 f"printed {got[i] if i < len(got) else 'nothing'}\nreference: {printable(head + bytes(generated))!r}\n"
                 f"fp8moe:    {printed!r}")
    if len(got) != len(generated):
        sys.exit(f"generate_ref.py: fp8moe printed {len(got)} tokens, the reference generated {len(generated)}: "
                 f"{printed!r}")
    print(f"generate_ref: all {len(generated)} generated tokens agree with the reference (smallest top-2 logit gap "
          f"{min(gaps):.2e})")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
