#!/usr/bin/env python3
"""Hugging Face transformers' own DeepseekV3 as the reference of `fp8moe export` / `fp8moe import`.

Run with build/venv-hf/bin/python3 (scripts/requirements-hf.txt). Everything runs on the CPU in
float32, and nothing is downloaded: every model comes from a local directory or a config.

  logits HF_DIR TOKENS_NPY OUT_NPY
      Loads HF_DIR (config.json + *.safetensors, as `fp8moe export` writes it, or as
      `save_pretrained` does) with AutoModelForCausalLM.from_pretrained in float32, eager
      attention, and writes the logits (B, T, V) float32 of the int32 tokens (B, T) to OUT_NPY.
      A DeepSeek-style FP8 checkpoint (config.json has quantization_config.quant_method "fp8":
      F8_E4M3 weights with float32 `weight_scale_inv` 128x128 block scales) is loaded
      dequantized to float32. Exits 1 when transformers reports a missing weight, a weight
      whose shape does not match, or an unexpected one other than those of the MTP layers
      (model.layers.N.* for N >= num_hidden_layers). With --mtp OUT_MTP_NPY, also the teacher-forced
      logits of those MTP layers through transformers' MtpModel (see mtp_logits).
  random CONFIG_JSON OUT_DIR [--seed S]
      A DeepseekV3ForCausalLM with random weights, from a config.json as an exporter would write
      it: every RMSNorm weight 1 + 0.2*randn and every e_score_correction_bias 0.05*randn (so that
      a swapped norm or an ignored bias changes the logits), saved to OUT_DIR as float32
      safetensors with save_pretrained. The routed experts are written per expert
      (mlp.experts.N.{gate,up,down}_proj.weight, DeepSeek's published layout). With
      num_nextn_predict_layers > 0 (transformers' default is 1), also that many random MTP layers
      (model.layers.N.*, N >= num_hidden_layers: a MoE decoder layer, enorm, hnorm, eh_proj,
      shared_head.norm, and shared_head.head / embed_tokens copies, as DeepSeek-V3's release).
  fp8 HF_DIR OUT_DIR
      Quantizes a float checkpoint (as `random` writes it) to DeepSeek-V3's published FP8 form:
      every 2-D weight of a Linear except mlp.gate (the router), lm_head and the embedding
      becomes float8_e4m3fn with a float32 `weight_scale_inv` of shape (ceil(out/128),
      ceil(in/128)) (block amax / 448; weight = fp8 * scale_inv), plus quantization_config in
      config.json. For testing `fp8moe import` on DeepSeek's FP8 layout.
  inspect HF_DIR
      Prints every tensor of the directory's safetensors files: name, dtype, shape.
"""

import argparse
import glob
import json
import math
import os
import re
import shutil
import sys

import numpy as np

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128  # DeepSeek-V3's weight_block_size
# The FP8 config DeepSeek-V3 publishes (its config.json's quantization_config).
FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [BLOCK, BLOCK],
}


def log(*args):
    print("hf_deepseek:", *args, file=sys.stderr, flush=True)


def fail(msg):
    log("FAIL:", msg)
    sys.exit(1)


def import_torch():
    import torch
    import transformers

    torch.set_grad_enabled(False)
    transformers.logging.disable_progress_bar()
    return torch, transformers


def read_config(hf_dir):
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        fail(f"{path} does not exist")
    with open(path) as f:
        return json.load(f)


def safetensors_files(hf_dir):
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        fail(f"no *.safetensors in {hf_dir}")
    return files


# ---------------------------------------------------------------------------------------------
# logits


def is_mtp_key(key, num_hidden_layers):
    m = re.match(r"(?:model\.)?layers\.(\d+)\.", key)
    return m is not None and int(m.group(1)) >= num_hidden_layers


def check_fp8_blocks(hf_dir, version):
    """transformers (5.24's Fp8Dequantize._dequantize_one, integrations/finegrained_fp8.py) takes the
    block of a weight (R, C) with scale grid (r, c) as (R / r, C / c), not DeepSeek's 128 x 128 with
    a ragged last block: a dimension over 128 that is not a multiple of 128 either fails to load or,
    worse, loads silently wrong (e.g. 144 rows, 2 scale rows: blocks of 72). Refuse those."""
    shapes = {}
    for path in safetensors_files(hf_dir):
        shapes.update({k: v[1] for k, v in read_header(path).items()})
    bad = []
    for name in sorted(shapes):
        w = name[: -len("_scale_inv")]
        if not name.endswith("_scale_inv") or w not in shapes:
            continue
        shape, grid = shapes[w], shapes[name]
        for n, g in zip(shape[-2:], grid[-2:]):
            if g != math.ceil(n / BLOCK):
                fail(f"{name}: scale grid {grid} for a weight {shape}: expected ceil(dim/{BLOCK}) blocks")
            if g > 1 and n != g * BLOCK:
                bad.append(f"{w} {tuple(shape)}")
                break
    if bad:
        fail(
            f"transformers {version} dequantizes FP8 blocks as dim / scale-grid, which is DeepSeek's "
            f"{BLOCK}x{BLOCK} blocking only for dims that are < {BLOCK} or multiples of {BLOCK}; "
            f"these weights are not: {bad}"
        )


def cmd_logits(args):
    torch, transformers = import_torch()
    from transformers import AutoModelForCausalLM

    config = read_config(args.hf_dir)
    qc = config.get("quantization_config")
    kwargs = {}
    if qc is not None:
        if qc.get("quant_method") != "fp8":
            fail(f"quantization_config.quant_method {qc.get('quant_method')!r}: only 'fp8' is handled")
        from transformers import FineGrainedFP8Config

        # dequantize=True: transformers converts every F8_E4M3 weight with its weight_scale_inv
        # to a plain Linear weight at load time (no FP8 kernel, so it runs on a CPU).
        kwargs["quantization_config"] = FineGrainedFP8Config(
            weight_block_size=tuple(qc.get("weight_block_size", [BLOCK, BLOCK])),
            activation_scheme=qc.get("activation_scheme", "dynamic"),
            modules_to_not_convert=qc.get("modules_to_not_convert"),
            dequantize=True,
        )
        log("FP8 checkpoint: loading it dequantized")

    if qc is not None:
        check_fp8_blocks(args.hf_dir, transformers.__version__)
        if args.mtp is not None:
            # MtpModel.from_pretrained (modeling_layers.py) loads with no quantizer: it would take the
            # raw E4M3 values and drop weight_scale_inv (checked: logits off by the scales).
            fail(f"--mtp on an FP8 checkpoint: transformers {transformers.__version__}'s MtpModel does not dequantize it")
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            args.hf_dir,
            dtype=torch.float32,
            attn_implementation="eager",
            output_loading_info=True,
            local_files_only=True,
            **kwargs,
        )
    except Exception as e:  # a shape mismatch or a failed expert merge raises (see the LOAD REPORT above)
        fail(f"transformers could not load {args.hf_dir}: {type(e).__name__}: {e}")
    model.eval()
    n_layers = model.config.num_hidden_layers

    missing = sorted(info.get("missing_keys", []))
    unexpected = sorted(info.get("unexpected_keys", []))
    mismatched = sorted(info.get("mismatched_keys", []))
    mtp = [k for k in unexpected if is_mtp_key(k, n_layers)]
    other = [k for k in unexpected if not is_mtp_key(k, n_layers)]
    log(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters())} parameters")
    log(f"missing keys ({len(missing)}): {missing}")
    log(f"unexpected keys, MTP layers (ignored) ({len(mtp)}): {mtp}")
    log(f"unexpected keys, other ({len(other)}): {other}")
    log(f"mismatched keys ({len(mismatched)}): {mismatched}")
    if info.get("error_msgs"):
        log(f"error messages: {info['error_msgs']}")
    bad = []
    if missing:
        bad.append(f"{len(missing)} missing")
    if other:
        bad.append(f"{len(other)} unexpected")
    if mismatched:
        bad.append(f"{len(mismatched)} mismatched")
    if info.get("error_msgs"):
        bad.append("loading errors")
    if bad:
        fail("the checkpoint does not match transformers' DeepseekV3: " + ", ".join(bad))
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.is_floating_point() and p.dtype != torch.float32:
            fail(f"{name} is {p.dtype} after loading, expected float32")

    tokens = np.load(args.tokens)
    if tokens.ndim != 2 or tokens.dtype.kind not in "iu":
        fail(f"{args.tokens}: expected integer tokens of shape (B, T), got {tokens.dtype} {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= model.config.vocab_size):
        fail(f"{args.tokens}: token ids outside [0, {model.config.vocab_size})")
    input_ids = torch.from_numpy(tokens.astype(np.int64))
    out = model(input_ids=input_ids, use_cache=False, output_hidden_states=args.mtp is not None)
    logits = out.logits.to(torch.float32).numpy()
    np.save(args.out, logits)
    log(f"wrote logits {logits.shape} to {args.out}")
    if args.mtp is not None:
        mtp_logits(torch, model, input_ids, out.hidden_states[-1], args.mtp)


def mtp_logits(torch, model, input_ids, last_hidden, out_path):
    """Teacher-forced logits of the MTP layers (model.layers.N.*, N >= num_hidden_layers), through
    transformers' own MtpModel (modeling_layers.py, what generate(use_mtp=True) drafts with).
    Depth d (0-based) at position t sees the token t + d + 1 and depth d - 1's output at t (depth 0:
    the main model's last hidden state AFTER its final norm, as transformers and vLLM pass it); its
    logits are shared_head(post_norm(block(eh_proj([enorm(emb); hnorm(h)])))). Written as
    (depths, B, T, V) float32, NaN where t + d + 1 >= T."""
    from transformers.modeling_layers import MtpModel

    n_layers = model.config.num_hidden_layers
    depth = int(getattr(model.config, "num_mtp_layers", 0) or 0)
    if depth < 1:
        fail("--mtp: the config has num_nextn_predict_layers 0")
    # DeepseekV3 only lists r"model\.layers\.61.*" (DeepSeek-V3's own size) as its MTP keys;
    # MtpModel.from_pretrained finds the MTP weights through that list, so name this model's.
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{i}\..*" for i in range(n_layers, n_layers + depth)]
    try:  # raises when an MTP weight is missing (its loading report is logged above)
        mtp = MtpModel.from_pretrained(model)
    except Exception as e:
        fail(f"--mtp: transformers could not load the MTP layers: {type(e).__name__}: {e}")
    mtp.eval()
    B, T = input_ids.shape
    V = model.config.vocab_size
    result = np.full((depth, B, T, V), np.nan, dtype=np.float32)
    h = last_hidden
    for d in range(depth):
        n = T - d - 1
        if n <= 0:
            break
        ids = input_ids[:, d + 1 :]
        pos = (torch.arange(n) + d + 1).unsqueeze(0).expand(B, -1)
        h = mtp.forward_layer(d, h[:, :n], pos, None, input_ids=ids)
        result[d, :, :n] = mtp._project_to_logits(h).to(torch.float32).numpy()
    np.save(out_path, result)
    log(f"wrote MTP logits {result.shape} to {out_path}")


# ---------------------------------------------------------------------------------------------
# random


def cmd_random(args):
    torch, transformers = import_torch()
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    with open(args.config) as f:
        d = json.load(f)
    if d.get("model_type", "deepseek_v3") != "deepseek_v3":
        fail(f"{args.config}: model_type {d.get('model_type')!r}, expected deepseek_v3")
    if d.get("quantization_config") is not None:
        fail(f"{args.config}: has a quantization_config; `random` writes float32 (use `fp8` after it)")
    d = {k: v for k, v in d.items() if k not in ("architectures", "model_type", "transformers_version")}
    config = DeepseekV3Config(**d)
    config.architectures = ["DeepseekV3ForCausalLM"]

    n_layers = config.num_hidden_layers
    n_mtp = int(config.num_mtp_layers or 0)  # num_nextn_predict_layers; transformers' default is 1
    if n_mtp and config.first_k_dense_replace > n_layers:
        fail("first_k_dense_replace > num_hidden_layers: the MTP layers would not be MoE layers")
    # The MTP layers are decoder layers n_layers .. n_layers + n_mtp - 1 of a deeper model (DeepSeek's
    # layout: model.layers.{N}.* after the main layers) plus enorm, hnorm, eh_proj, shared_head.
    big = config
    if n_mtp:
        big = DeepseekV3Config(**{**d, "num_hidden_layers": n_layers + n_mtp})
        big.architectures = config.architectures

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(big, dtype=torch.float32)
    model.eval()
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RMSNorm,
        DeepseekV3TopkRouter,
    )

    n_norms = n_bias = 0
    for module in model.modules():
        if isinstance(module, DeepseekV3RMSNorm):
            module.weight.copy_(1.0 + 0.2 * torch.randn_like(module.weight))
            n_norms += 1
        elif isinstance(module, DeepseekV3TopkRouter):
            module.e_score_correction_bias.copy_(0.05 * torch.randn_like(module.e_score_correction_bias))
            n_bias += 1
    model.save_pretrained(args.out_dir)  # safetensors; routed experts saved per expert
    if n_mtp:
        add_mtp_tensors(torch, model, config, n_layers, n_mtp, args.out_dir)
    log(
        f"saved {type(model).__name__} (seed {args.seed}, {n_layers} layers + {n_mtp} MTP, {n_norms} norms, "
        f"{n_bias} router biases) to {args.out_dir}"
    )


def add_mtp_tensors(torch, model, config, n_layers, n_mtp, out_dir):
    """Turns the saved (n_layers + n_mtp)-layer model into an n_layers one whose checkpoint also
    holds DeepSeek-style MTP layers: model.layers.{N}.{decoder layer, enorm, hnorm, eh_proj,
    shared_head.norm, shared_head.head, embed_tokens} (the last two copies of lm_head and of the
    embedding, as DeepSeek-V3's release has them)."""
    from safetensors.torch import load_file, save_file

    config.save_pretrained(out_dir)  # the n_layers config over the deeper one
    H = config.hidden_size
    extra = {}
    for i in range(n_layers, n_layers + n_mtp):
        pre = f"model.layers.{i}."
        extra[pre + "enorm.weight"] = 1.0 + 0.2 * torch.randn(H)
        extra[pre + "hnorm.weight"] = 1.0 + 0.2 * torch.randn(H)
        extra[pre + "eh_proj.weight"] = config.initializer_range * torch.randn(H, 2 * H)
        extra[pre + "shared_head.norm.weight"] = 1.0 + 0.2 * torch.randn(H)
        extra[pre + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
        extra[pre + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    index = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.exists(index):  # sharded: the MTP extras go into a shard of their own
        with open(index) as f:
            idx = json.load(f)
        save_file(extra, os.path.join(out_dir, "model-mtp.safetensors"), metadata={"format": "pt"})
        idx["weight_map"].update({k: "model-mtp.safetensors" for k in extra})
        with open(index, "w") as f:
            json.dump(idx, f, indent=2)
    else:
        path = os.path.join(out_dir, "model.safetensors")
        tensors = load_file(path)
        tensors.update(extra)
        save_file(tensors, path, metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------
# fp8


def quantize_block_fp8(torch, w):
    """(fp8, scale_inv): w ~= fp8 * scale_inv blockwise, DeepSeek-V3's 128x128 weight blocks."""
    out_f, in_f = w.shape
    rb, cb = math.ceil(out_f / BLOCK), math.ceil(in_f / BLOCK)
    padded = torch.zeros(rb * BLOCK, cb * BLOCK, dtype=torch.float32)
    padded[:out_f, :in_f] = w.to(torch.float32)
    blocks = padded.view(rb, BLOCK, cb, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(rb * BLOCK, cb * BLOCK)[:out_f, :in_f].to(torch.float8_e4m3fn)
    return q.contiguous(), scale_inv.contiguous()


def fp8_quantized_name(name):
    """Whether DeepSeek-V3's FP8 release stores this tensor in FP8 (with a weight_scale_inv)."""
    if not name.endswith(".weight"):
        return False
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return False
    if name.endswith("mlp.gate.weight") or "norm" in name.rsplit(".", 2)[-2]:
        return False
    if name.endswith(("eh_proj.weight", "shared_head.head.weight", "embed_tokens.weight")):
        return False  # the MTP layer's projections and heads stay unquantized (BF16) in DeepSeek's release
    return True


def cmd_fp8(args):
    torch, _ = import_torch()
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = read_config(args.hf_dir)
    if config.get("quantization_config") is not None:
        fail(f"{args.hf_dir} is already quantized")
    os.makedirs(args.out_dir, exist_ok=True)
    weight_map = {}
    for path in safetensors_files(args.hf_dir):
        out = {}
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if t.ndim == 2 and fp8_quantized_name(name):
                    q, s = quantize_block_fp8(torch, t)
                    out[name] = q
                    out[name + "_scale_inv"] = s
                else:
                    out[name] = t.contiguous()
        base = os.path.basename(path)
        save_file(out, os.path.join(args.out_dir, base), metadata={"format": "pt"})
        for name in out:
            weight_map[name] = base
    total = sum(os.path.getsize(os.path.join(args.out_dir, b)) for b in set(weight_map.values()))
    with open(os.path.join(args.out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    # A single-file checkpoint plus an index is fine for transformers; drop a stale copy of either.
    config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    gen = os.path.join(args.hf_dir, "generation_config.json")
    if os.path.exists(gen):
        shutil.copy(gen, args.out_dir)
    n_fp8 = sum(1 for k in weight_map if k.endswith("_scale_inv"))
    log(f"wrote {n_fp8} FP8 weights (+ weight_scale_inv) to {args.out_dir}")


# ---------------------------------------------------------------------------------------------
# inspect


def read_header(path):
    """{name: (dtype, shape)} from a safetensors header (F8_E4M3 included, which numpy cannot hold)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: (v["dtype"], list(v["shape"])) for k, v in header.items() if k != "__metadata__"}


def cmd_inspect(args):
    from safetensors import safe_open

    for path in safetensors_files(args.hf_dir):
        print(f"# {os.path.basename(path)}")
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
        if meta:
            print(f"# metadata {meta}")
        for name, (dtype, shape) in sorted(read_header(path).items()):
            print(f"{name}\t{dtype}\t{tuple(shape)}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("logits", help="logits of transformers' DeepseekV3 loaded from HF_DIR")
    s.add_argument("hf_dir")
    s.add_argument("tokens")
    s.add_argument("out")
    s.add_argument("--mtp", metavar="OUT_MTP_NPY", help="also the MTP layers' logits (depths, B, T, V)")
    s.set_defaults(func=cmd_logits)
    s = sub.add_parser("random", help="a random DeepseekV3ForCausalLM saved with save_pretrained")
    s.add_argument("config")
    s.add_argument("out_dir")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_random)
    s = sub.add_parser("fp8", help="DeepSeek-V3's block-FP8 form of a float checkpoint")
    s.add_argument("hf_dir")
    s.add_argument("out_dir")
    s.set_defaults(func=cmd_fp8)
    s = sub.add_parser("inspect", help="name, dtype, shape of every tensor")
    s.add_argument("hf_dir")
    s.set_defaults(func=cmd_inspect)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
