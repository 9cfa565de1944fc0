#!/usr/bin/env python3
"""Compares the runs scripts/loss-bits.sh made with two binaries: BEFORE/<case> against AFTER/<case>.

For each case: the loss bits of every metrics line ([%a]), every field of the JSONL records but the
timings and the host's memory, the final checkpoint (every dataset's bytes, every attribute but
`created`; `config` line by line, keys only one side has reported apart: a new key is not a changed
number; across two format versions, every tensor's bytes by name), and the greedy generation's
text. Prints one line per case; exits 1 on any difference.
"""
import json
import re
import sys
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "io"))
from check_checkpoint import read_tensors  # noqa: E402  (a checkpoint's tensors by name, any format)

TIMING = {"tokens_per_s", "step_time_s", "mfu", "peak_mem_bytes", "pipeline_bubble", "eta_s"}


def loss_bits(text):
    return re.findall(r"^step +(\d+)/\d+ .*\[(.*)\]$", text, re.M)


def records(path):
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        out.append({k: v for k, v in r.items() if k not in TIMING})
    return out


def config_keys(text):
    """The config attribute as {dotted key: value} (the YAML is two levels deep)."""
    keys, section = {}, ""
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line.startswith(" "):
            section = line.rstrip(":").strip()
            continue
        k, _, v = line.strip().partition(":")
        keys[section + "." + k] = v.strip()
    return keys


def tensor_differences(fa, fb):
    """Files of two format versions: every tensor's bytes by name (stacked datasets split), the
    other datasets' by path."""
    diffs = []
    for group in ("params", "optim/m", "optim/v"):
        ta = read_tensors(fa[group]) if group in fa else {}
        tb = read_tensors(fb[group]) if group in fb else {}
        if set(ta) != set(tb):
            diffs.append(f"{group}: tensors differ: {sorted(set(ta) ^ set(tb))[:8]}")
        for n in sorted(set(ta) & set(tb)):
            if ta[n].dtype != tb[n].dtype or ta[n].shape != tb[n].shape or ta[n].tobytes() != tb[n].tobytes():
                diffs.append(f"{group}/{n}")
    for g in ("fp8",):
        if (g in fa) != (g in fb):
            diffs.append(f"/{g} on one side only")
        elif g in fa:
            for n in sorted(set(fa[g]) | set(fb[g])):
                if n not in fa[g] or n not in fb[g] or fa[g][n][()].tobytes() != fb[g][n][()].tobytes():
                    diffs.append(f"dataset {g}/{n}")
    return diffs


def checkpoint_differences(a, b):
    diffs, notes = [], []
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        va, vb = int(fa.attrs["format_version"]), int(fb.attrs["format_version"])
        if va != vb:  # another layout of the same tensors: compared tensor by tensor
            notes.append(f"checkpoint format {va} before, {vb} after: compared tensor by tensor")
            return tensor_differences(fa, fb), notes
        names_a, names_b = [], []
        fa.visit(names_a.append)
        fb.visit(names_b.append)
        if names_a != names_b:
            diffs.append(f"objects differ: {sorted(set(names_a) ^ set(names_b))[:8]}")
        for obj in [""] + [n for n in names_a if n in fb]:
            oa, ob = fa[obj] if obj else fa, fb[obj] if obj else fb
            if isinstance(oa, h5py.Dataset):
                da, db = oa[()], ob[()]
                if da.dtype != db.dtype or da.shape != db.shape or da.tobytes() != db.tobytes():
                    diffs.append(f"dataset {obj}")
            attrs = set(oa.attrs) | set(ob.attrs)
            for k in sorted(attrs - {"created"}):
                if k not in oa.attrs or k not in ob.attrs:
                    diffs.append(f"attribute {obj}@{k} on one side only")
                    continue
                va, vb = oa.attrs[k], ob.attrs[k]
                if k == "config":
                    ca, cb = config_keys(str(va)), config_keys(str(vb))
                    for key in sorted(set(ca) | set(cb)):
                        if key in ca and key in cb:
                            if ca[key] != cb[key]:
                                diffs.append(f"config {key}: {ca[key]} / {cb[key]}")
                        else:
                            notes.append(f"config key {key} only {'before' if key in ca else 'after'}")
                elif np.asarray(va).tobytes() != np.asarray(vb).tobytes():
                    diffs.append(f"attribute {obj}@{k}")
    return diffs, notes


def compare(before, after):
    diffs, notes = [], []
    ta, tb = (before / "train.txt").read_text(), (after / "train.txt").read_text()
    la, lb = loss_bits(ta), loss_bits(tb)
    if not la:
        diffs.append("no metrics lines")
    if la != lb:
        diffs.append(f"loss bits: {la} / {lb}")
    ra, rb = records(before / "metrics.jsonl"), records(after / "metrics.jsonl")
    for i, (x, y) in enumerate(zip(ra, rb)):
        for k in sorted(set(x) | set(y)):
            if x.get(k) != y.get(k):
                diffs.append(f"step {i + 1} {k}: {x.get(k)} / {y.get(k)}")
    if len(ra) != len(rb):
        diffs.append(f"{len(ra)} / {len(rb)} metrics records")
    ck = sorted(before.glob("ck/step_*/checkpoint.h5"))
    if not ck:
        diffs.append("no checkpoint")
    for a in ck:
        b = after / a.relative_to(before)
        if not b.exists():
            diffs.append(f"{b} missing")
            continue
        d, n = checkpoint_differences(a, b)
        diffs += d
        notes += n
    ga, gb = before / "generate.txt", after / "generate.txt"
    if ga.exists() and ga.read_text() != gb.read_text():
        diffs.append("generate output")
    return len(la), diffs, notes


def main():
    before, after = Path(sys.argv[1]), Path(sys.argv[2])
    failed, notes = 0, set()
    for case in sorted(p.name for p in before.iterdir() if p.is_dir()):
        steps, diffs, n = compare(before / case, after / case)
        notes.update(n)
        status = "same" if not diffs else "DIFFERENT"
        print(f"{case:45s} {steps} steps  {status}")
        for d in diffs[:10]:
            print(f"    {d}")
        failed += bool(diffs)
    for n in sorted(notes):
        print(f"note: {n}")
    print(f"compare-runs: {failed} case(s) differ" if failed else "compare-runs: every case is the same, bit for bit")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
