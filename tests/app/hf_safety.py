"""fp8moe export / import never lose or mix what is there, and refuse bad input with exit 2 and one
line `fp8moe: error: ...` (README "Hugging Face export and import"). One ctest entry per case,
each a few seconds on one process (a 2-block MLA model trained 2 or 3 steps):

  reexport_damaged       a re-export from a damaged checkpoint (a flipped byte: checksum mismatch)
                         fails with exit 2 and leaves the earlier export, and a file the user put
                         beside it, byte for byte as they were; the next good export replaces the
                         weights and keeps the user's file and the directory's mode and owner
  reexport_killed        an export killed (SIGKILL, FP8MOE_EXPORT_KILL) at each point of its life
                         (lock taken, first shard written, all written and verified, swapped in;
                         and without the atomic exchange, between its two renames) leaves the
                         directory the whole old export or the whole new one, never a mix; the
                         next export cleans what the dead one left, and first puts back a
                         directory that a death between the two renames left set aside
  reexport_full_disk     (root: a tmpfs) a re-export that does not fit: exit 1, the old export intact,
                         no temporary left; with room, the export goes through
  export_lock            two exports into one directory at once: the second is refused at once
                         (exit 2) naming the first's host and pid; the directory is the first's
                         export; the lock of an export that was killed is taken over
  import_into_checkpoints  import into a directory holding step_* or latest: exit 2 naming them,
                         nothing written; into an empty directory (or one with other files): done
  nonfinite              import refuses NaN / Inf values (F32, BF16, an E4M3 NaN byte) and FP8
                         weight_scale_inv of NaN, -1, 0 and 3e38 (3e38 x 448 overflows FP32),
                         naming the tensor and the index; export refuses a checkpoint (valid
                         checksums) holding NaN or Inf, naming the parameter and the index
  max_shard_size         --max-shard-size takes a whole number of bytes (5e9 style too); nan, 0, -5,
                         inf, 5GB, 1.5 are fp8moe's one-line error with exit 2
  bad_output_path        export and import into a regular file, under a regular file and (root) under
                         a read-only mount: exit 2 naming the path
  header_limit           a safetensors header over the 100 MB limit is refused naming the limit; a
                         config.json or a .safetensors that is a FIFO is refused at once, not waited on

Hostile safetensors files are made here from the format's description (8-byte little-endian header
length, JSON header, data), patching the bytes of a tensor that the header locates. Checkpoints are
changed with h5py, the checksum recomputed with tests/io/check_checkpoint.py's independent formula
where the change must not be caught as damage. Exit 77 (SKIPPED) where a case needs root.
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "io"))
from check_checkpoint import checksum, stored_tensors  # noqa: E402  (the checkpoint format's checksum, written from the README)

MODEL = """
model:
  vocab_size: 256
  d_model: 64
  n_layers: 2
  n_heads: 4
  attention: mla
  q_lora_rank: 0
  kv_lora_rank: 32
  qk_nope_head_dim: 16
  qk_rope_head_dim: 8
  v_head_dim: 16
  first_dense_layers: 1
  d_ff_dense: 128
  moe:
    n_experts: 4
    top_k: 2
    n_shared_experts: 1
    d_expert: 32
train: {{steps: {steps}, global_batch: 2, seq_len: 16, lr: 1.0e-2, warmup_steps: 1, seed: {seed}}}
fp8: {{recipe: off}}
data: {{path: {data}}}
checkpoint: {{dir: {ckpt}}}
eval: {{every: 0}}
log: {{every: 1}}
"""
# A tensor of the routed experts (32 x 64), in fp8moe's name and the files'.
OURS, THEIRS = "layers.1.moe.experts.2.w3", "model.layers.1.mlp.experts.2.up_proj.weight"


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)


class Env:
    def __init__(self, args, tmp):
        self.exe, self.tmp, self.cache = args.fp8moe, tmp, {}
        run([self.exe, "prepare-data", "--input", "/usr/share/common-licenses/GPL-3", "--output",
             os.path.join(tmp, "data", "d")])

    def config(self, name="good", steps=2, seed=1):
        path = os.path.join(self.tmp, name + ".yaml")
        with open(path, "w") as f:
            f.write(MODEL.format(steps=steps, seed=seed, data=os.path.join(self.tmp, "data", "d.train"),
                                 ckpt=os.path.join(self.tmp, "ck-" + name)))
        return path

    def checkpoint(self, name="good"):
        """Two checkpoints of the model: `good` (2 steps, seed 1) and `good2` (3 steps, seed 7)."""
        if name not in self.cache:
            steps, seed = (2, 1) if name == "good" else (3, 7)
            run([self.exe, "train", self.config(name, steps, seed)])
            self.cache[name] = os.path.join(self.tmp, "ck-" + name)
        return self.cache[name]

    def export(self, ckpt, out, *more, expect=0, env=None):
        return run([self.exe, "export", ckpt, out, *more], expect=expect, env=env)

    def import_(self, hf, ckpt, expect=0):
        return run([self.exe, "import", hf, ckpt, "--config", self.config()], expect=expect)


def run(cmd, expect=0, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=None if env is None else {**os.environ, **env},
                       timeout=120)
    if expect is not None and r.returncode != expect:
        raise Failure(f"{' '.join(cmd)}: exit {r.returncode}, expected {expect}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r


def error_line(r, *words, status=2):
    """The run's one stderr line, `fp8moe: error: ...` holding every word; exit `status`."""
    lines = r.stderr.strip().splitlines()
    check(r.returncode == status, f"exit {r.returncode}, expected {status}: {r.stderr.strip()[:500]}")
    check(len(lines) == 1 and lines[0].startswith("fp8moe: error: "),
          f"expected one line 'fp8moe: error: ...' on stderr, got {len(lines)}: {r.stderr.strip()[:500]}")
    for w in words:
        check(w in lines[0], f"the message does not name {w!r}: {lines[0]}")
    return lines[0]


def snapshot(d):
    """Every file under d (relative path -> SHA-256); None when d does not exist."""
    if not os.path.isdir(d):
        return None
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, d)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def leftovers(target):
    """What exports left beside `target` besides its lock file."""
    parent, name = os.path.split(os.path.abspath(target))
    return sorted(f for f in os.listdir(parent) if f.startswith("." + name + ".") and f != "." + name + ".lock")


def user_file(d):
    """A file the user put beside an export (a tokenizer copied by hand)."""
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        f.write('{"model": {"type": "byte-level"}}\n')


def reference_export(env, tmp, ckpt, name, *more):
    """What the directory should hold after exporting ckpt (with the user's file)."""
    d = os.path.join(tmp, "ref-" + name)
    env.export(ckpt, d, *more)
    user_file(d)
    return snapshot(d)


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    step = open(os.path.join(dst, "latest")).read().strip()
    return os.path.join(dst, step, "checkpoint.h5")


def where_stored(h5, name):
    """(dataset, slot) of parameter `name` in checkpoint file h5 (README "Checkpoints"): its slot of
    a stacked dataset, or its own dataset (slot None)."""
    with h5py.File(h5, "r") as f:
        dataset, slot = stored_tensors(f["params"])[name]
    return "params/" + dataset, slot


def damage_checkpoint(src, dst, name):
    """A copy of checkpoint src with one byte of parameter `name`'s data flipped in the file."""
    h5 = copy_checkpoint(src, dst)
    dataset, slot = where_stored(h5, name)
    with h5py.File(h5, "r") as f:
        d = f[dataset]
        per = d.size // d.shape[0] if slot is not None else d.size
        at = d.id.get_offset() + d.dtype.itemsize * ((slot or 0) * per + per // 2)
    with open(h5, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    return dst


def poison_checkpoint(src, dst, name, index, value):
    """A copy of checkpoint src whose parameter `name` holds `value` at `index`, with a valid
    checksum."""
    h5 = copy_checkpoint(src, dst)
    dataset, slot = where_stored(h5, name)
    with h5py.File(h5, "r+") as f:
        d = f[dataset]
        v = d[()]
        if slot is None:
            v[index] = value
            d[...] = v
            d.attrs["checksum"] = np.uint64(checksum(v.view(np.uint32).reshape(-1)))
        else:
            v[slot][index] = value
            d[...] = v
            sums = np.array(d.attrs["checksums"], dtype=np.uint64)
            sums[slot] = np.uint64(checksum(v[slot].view(np.uint32).reshape(-1)))
            d.attrs["checksums"] = sums
    return dst


# ---------------------------------------------------------------- safetensors by hand

def tensor_location(path, name):
    """(byte offset in the file, dtype, shape) of tensor `name`, from the file's header."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    t = header[name]
    return 8 + n + t["data_offsets"][0], t["dtype"], t["shape"]


def patch_tensor(hf_dir, name, index, raw):
    """Writes the bytes `raw` over element `index` (flat) of tensor `name` in its file."""
    index_json = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))
    path = os.path.join(hf_dir, index_json["weight_map"][name])
    at, dtype, _ = tensor_location(path, name)
    size = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1}[dtype]
    with open(path, "r+b") as f:
        f.seek(at + size * index)
        f.write(raw)


def f32(x):
    return struct.pack("<f", x)


# ---------------------------------------------------------------- cases

def case_reexport_damaged(env, tmp):
    good, good2 = env.checkpoint("good"), env.checkpoint("good2")
    damaged = damage_checkpoint(good2, os.path.join(tmp, "damaged"), "layers.1.moe.experts.3.w2")
    keep = os.path.join(tmp, "hf", "keep")
    # The user's directory, with a mode (and as root an owner) of its own, which the replaced
    # directory keeps.
    os.makedirs(keep)
    os.chmod(keep, 0o750)
    owner = 65534 if os.geteuid() == 0 else os.getuid()
    os.chown(keep, owner, owner)
    env.export(good, keep, "--max-shard-size", "100000")
    user_file(keep)
    before = snapshot(keep)
    check(len([f for f in before if f.endswith(".safetensors")]) == 3, f"expected 3 shards: {sorted(before)}")
    r = env.export(damaged, keep, "--max-shard-size", "100000", expect=None)
    line = error_line(r, "checksum mismatch", "layers.1.moe.experts.w2, expert 3")
    check(snapshot(keep) == before, "the failed export changed the earlier export")
    check(leftovers(keep) == [], f"the failed export left {leftovers(keep)}")
    # A good export replaces the weights (one shard now: the three old ones go) and keeps the user's file.
    want = reference_export(env, tmp, good2, "good2")
    env.export(good2, keep)
    check(snapshot(keep) == want, f"after a good export: {sorted(snapshot(keep))}, expected {sorted(want)}")
    check(leftovers(keep) == [], f"the good export left {leftovers(keep)}")
    st = os.stat(keep)
    check(st.st_mode & 0o7777 == 0o750 and st.st_uid == owner, f"the directory's mode {st.st_mode:o}, owner {st.st_uid}")
    print(f"re-export from a damaged checkpoint: exit 2, the earlier export and the user's file as they were "
          f"({line[:160]}); the next export replaced the 3 shards by 1 and kept tokenizer.json, the directory's "
          f"mode 750 and owner {owner}")


def case_reexport_killed(env, tmp):
    good, good2 = env.checkpoint("good"), env.checkpoint("good2")
    damaged = damage_checkpoint(good2, os.path.join(tmp, "damaged"), "layers.1.moe.experts.3.w2")
    keep = os.path.join(tmp, "hf", "keep")
    old = reference_export(env, tmp, good, "good", "--max-shard-size", "100000")
    new = reference_export(env, tmp, good2, "good2")
    report = []
    # With the atomic exchange of the two directories (renameat2 RENAME_EXCHANGE), and without it
    # (two renames: the old directory aside, then the new one in), as on file systems that lack it.
    for mode, points in (("exchange", ("locked", "shard", "written", "swapped")),
                         ("two renames", ("written", "aside", "swapped"))):
        env_mode = {"FP8MOE_EXPORT_NO_EXCHANGE": "1"} if mode == "two renames" else {}
        for point in points:
            shutil.rmtree(keep, ignore_errors=True)
            env.export(good, keep, "--max-shard-size", "100000")
            user_file(keep)
            check(snapshot(keep) == old, "the set-up export")
            r = env.export(good2, keep, expect=None, env={**env_mode, "FP8MOE_EXPORT_KILL": point})
            check(r.returncode == -signal.SIGKILL, f"{mode}, {point}: exit {r.returncode}, not killed: {r.stderr[-500:]}")
            got, left = snapshot(keep), leftovers(keep)
            if point == "aside":
                # Between the two renames: the old export whole beside the missing directory; the
                # next export puts it back before it does anything, so that its own failure (a
                # damaged checkpoint) leaves the old export where it was.
                aside = [f for f in left if ".old-" in f]
                check(got is None and len(aside) == 1 and snapshot(os.path.join(os.path.dirname(keep), aside[0])) == old,
                      f"{mode}, {point}: {sorted(got or [])}, beside it {left}")
                error_line(env.export(damaged, keep, expect=None), "checksum mismatch")
                check(snapshot(keep) == old and leftovers(keep) == [], f"{mode}, {point}: the old export not put back")
                report.append(f"{mode}, {point}: the old export whole beside the directory, put back by the next export")
            else:
                survivor = new if point == "swapped" else old
                check(got == survivor, f"{mode}, killed at {point}: the directory holds {sorted(got or [])}, expected "
                                       f"the {'old' if survivor is old else 'new'} export {sorted(survivor)}")
                report.append(f"{mode}, {point}: {'old' if survivor is old else 'new'} export whole, "
                              f"{len(left)} temporary cleaned")
            env.export(good2, keep, env=env_mode)
            check(snapshot(keep) == new, f"{mode}: after the export killed at {point}: the next one is not the new export")
            check(leftovers(keep) == [], f"{mode}: after the export killed at {point}: {leftovers(keep)} left")
    print("killed exports:\n  " + "\n  ".join(report))


def case_reexport_full_disk(env, tmp):
    if os.geteuid() != 0:
        print("[  SKIPPED ] needs root to mount a tmpfs")
        return 77
    good, good2 = env.checkpoint("good"), env.checkpoint("good2")
    fs = os.path.join(tmp, "fs")
    os.makedirs(fs)
    # One BF16 export (250 KB) fits in 400 KB; the FP32 export (500 KB) does not.
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", fs]).returncode != 0:
        print("[  SKIPPED ] cannot mount a tmpfs")
        return 77
    try:
        keep = os.path.join(fs, "keep")
        env.export(good, keep)
        user_file(keep)
        before = snapshot(keep)
        line = error_line(env.export(good2, keep, "--dtype", "fp32", expect=None), "No space left on device", status=1)
        check(snapshot(keep) == before, "the export on a full disk changed the earlier export")
        check(leftovers(keep) == [], f"the export on a full disk left {leftovers(keep)}")
        subprocess.run(["mount", "-o", "remount,size=2000k", fs], check=True)
        env.export(good2, keep, "--dtype", "fp32")
        check(os.path.exists(os.path.join(keep, "tokenizer.json")), "the user's file went")
    finally:
        subprocess.run(["umount", fs])
    print(f"re-export on a full disk: exit 1, the earlier export as it was ({line[:150]}); with room it went through")


def stopped(pid, timeout=20):
    t0 = time.time()
    while time.time() - t0 < timeout:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return True
        time.sleep(0.02)
    return False


def case_export_lock(env, tmp):
    good, good2 = env.checkpoint("good"), env.checkpoint("good2")
    keep = os.path.join(tmp, "hf", "keep")
    want = reference_export(env, tmp, good, "good", "--max-shard-size", "100000")
    # The first export stops itself once it holds the lock; the second starts meanwhile.
    a = subprocess.Popen([env.exe, "export", good, keep, "--max-shard-size", "100000"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "FP8MOE_EXPORT_STOP": "locked"})
    try:
        check(stopped(a.pid), "the first export did not stop after taking the lock")
        t0 = time.time()
        r = env.export(good2, keep, expect=None)
        took = time.time() - t0
        line = error_line(r, f"pid {a.pid}", socket.gethostname(), "another export")
        check(took < 10, f"the second export took {took:.1f} s to be refused")
    finally:
        os.kill(a.pid, signal.SIGCONT)
        out, err = a.communicate(timeout=60)
    check(a.returncode == 0, f"the first export: exit {a.returncode}: {err}")
    user_file(keep)
    check(snapshot(keep) == want, f"the directory is not the first export's: {sorted(snapshot(keep))}")
    # The lock of a killed export is free: the next export takes it.
    c = subprocess.Popen([env.exe, "export", good2, keep], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**os.environ, "FP8MOE_EXPORT_STOP": "locked"})
    check(stopped(c.pid), "the export to kill did not stop after taking the lock")
    os.kill(c.pid, signal.SIGKILL)
    c.wait()
    env.export(good2, keep)
    check(snapshot(keep) == reference_export(env, tmp, good2, "good2"), "after the killed holder: not good2's export")
    check(leftovers(keep) == [], f"left: {leftovers(keep)}")
    print(f"two exports at once: the second refused in {took:.2f} s ({line[:200]}); the directory is the first's; "
          f"a killed holder's lock taken over")


def case_import_into_checkpoints(env, tmp):
    good = env.checkpoint("good")
    hf = os.path.join(tmp, "hf32")
    env.export(good, hf, "--dtype", "fp32")
    step = os.path.join(good, open(os.path.join(good, "latest")).read().strip())
    cases = []
    for what, names in (("a step_00000004 without latest", ["step_00000004"]), ("latest alone", ["latest"]),
                        ("a step_00000000", ["step_00000000"]), ("both", ["step_00000004", "latest"])):
        dest = os.path.join(tmp, "dest-" + str(len(cases)))
        os.makedirs(dest)
        for n in names:
            if n == "latest":
                open(os.path.join(dest, n), "w").write("step_00000004\n")
            else:
                shutil.copytree(step, os.path.join(dest, n))
        before = snapshot(dest)
        line = error_line(env.import_(hf, dest, expect=None), "already holds checkpoints", *names)
        check(snapshot(dest) == before, f"{what}: the directory changed")
        cases.append(f"{what}: {line[15:140]}")
    for what, extra in (("an empty directory", None), ("a directory with another file", "notes.txt")):
        dest = os.path.join(tmp, "dest-" + what.replace(" ", "-"))
        os.makedirs(dest)
        if extra:
            open(os.path.join(dest, extra), "w").write("mine\n")
        env.import_(hf, dest)
        check(open(os.path.join(dest, "latest")).read().strip() == "step_00000000", f"{what}: no latest")
        check(not extra or os.path.exists(os.path.join(dest, extra)), f"{what}: the other file went")
    print("import refused with exit 2, nothing written:\n  " + "\n  ".join(cases) +
          "\nimported into an empty directory and one with another file")


def case_nonfinite(env, tmp):
    good = env.checkpoint("good")
    hf = {}
    for dtype in ("fp32", "bf16", "fp8"):
        hf[dtype] = os.path.join(tmp, "hf-" + dtype)
        env.export(good, hf[dtype], "--dtype", dtype)
    scale = THEIRS + "_scale_inv"  # (1, 1): the 32 x 64 weight is one partial 128 x 128 block
    variants = [
        ("F32 NaN", "fp32", THEIRS, 5, f32(float("nan")), THEIRS, "[0, 5]"),
        ("F32 -Inf", "fp32", THEIRS, 3 * 64 + 1, f32(float("-inf")), THEIRS, "[3, 1]"),
        ("BF16 +Inf", "bf16", "model.norm.weight", 7, struct.pack("<H", 0x7F80), "model.norm.weight", "[7]"),
        ("E4M3 NaN byte", "fp8", THEIRS, 10, b"\x7f", THEIRS, "[0, 10]"),
    ] + [(f"weight_scale_inv {v}", "fp8", scale, 0, f32(v), scale, "[0, 0]") for v in (float("nan"), -1.0, 0.0, 3e38)]
    report = []
    for i, (what, dtype, name, index, raw, named, at) in enumerate(variants):
        bad = os.path.join(tmp, f"bad-{i}")
        shutil.copytree(hf[dtype], bad)
        patch_tensor(bad, name, index, raw)
        dest = os.path.join(tmp, f"bad-{i}-ck")
        line = error_line(env.import_(bad, dest, expect=None), named, at)
        check(not os.path.exists(os.path.join(dest, "latest")), f"{what}: a checkpoint was written")
        report.append(f"{what}: {line[15:200]}")
    env.import_(hf["fp8"], os.path.join(tmp, "fp8-ck"))  # the unpatched FP8 export imports
    # Export: a checkpoint whose checksums are right but which holds NaN or Inf.
    keep = os.path.join(tmp, "hf-keep")
    env.export(good, keep)
    before = snapshot(keep)
    for value, word in ((np.nan, "NaN"), (np.inf, "inf")):
        bad = poison_checkpoint(good, os.path.join(tmp, f"ck-{word}"), OURS, (0, 5), value)
        run([env.exe, "ckpt", "verify", bad])  # its checksums are valid: not damage
        line = error_line(env.export(bad, keep, expect=None), OURS, "[0, 5]")
        check(snapshot(keep) == before, "a refused export changed the directory")
        report.append(f"export of a checkpoint with {word}: {line[15:200]}")
    print("refused with exit 2:\n  " + "\n  ".join(report))


def case_max_shard_size(env, tmp):
    good = env.checkpoint("good")
    out = os.path.join(tmp, "out")
    report = []
    for value in ("nan", "0", "-5", "inf", "5GB", "1.5", "-inf", "0x10", "1e400", "1e19"):
        r = run([env.exe, "export", good, out, "--max-shard-size=" + value], expect=None)
        line = error_line(r, "--max-shard-size", "bytes")
        check(not re.search(r"[0-9]{25}", line), f"{value}: a bound of many digits: {line}")
        check(not os.path.exists(out), f"{value}: the export ran")
        report.append(f"{value!r}: {line[15:170]}")
    r = run([env.exe, "export", good, out, "--max-shard-size", "-5"], expect=None)
    error_line(r, "--max-shard-size")
    help_text = run([env.exe, "export", "--help"]).stdout
    check(re.search(r"--max-shard-size[^\n]*\n?[^\n]*bytes", help_text), "--help does not say bytes")
    for value, shards in (("5e9", 1), ("100000", 3), ("1e5", 3)):
        shutil.rmtree(out, ignore_errors=True)
        env.export(good, out, "--max-shard-size", value)
        n = len([f for f in os.listdir(out) if f.endswith(".safetensors")])
        check(n == shards, f"--max-shard-size {value}: {n} shards, expected {shards}")
    print("--max-shard-size refused with exit 2:\n  " + "\n  ".join(report) + "\naccepted: 5e9 (1 shard), 100000 and 1e5 (3)")


def case_bad_output_path(env, tmp):
    good = env.checkpoint("good")
    hf = os.path.join(tmp, "hf32")
    env.export(good, hf, "--dtype", "fp32")
    afile = os.path.join(tmp, "a-file")
    open(afile, "w").write("not a directory\n")
    paths = [("a regular file", afile, "is not a directory"),
             ("under a regular file", os.path.join(afile, "sub"), afile + " is not a directory")]
    ro, mounted = os.path.join(tmp, "ro"), False
    if os.geteuid() == 0:
        os.makedirs(os.path.join(ro, "existing"))
        if subprocess.run(["mount", "--bind", ro, ro]).returncode == 0:
            mounted = subprocess.run(["mount", "-o", "remount,bind,ro", ro]).returncode == 0
            if not mounted:
                subprocess.run(["umount", ro])
        if mounted:
            paths += [("under a read-only mount", os.path.join(ro, "new"), "Read-only file system"),
                      ("an existing directory on a read-only mount", os.path.join(ro, "existing"),
                       "Read-only file system")]
    report = []
    try:
        for what, path, word in paths:
            for cmd, r in (("export", env.export(good, path, expect=None)), ("import", env.import_(hf, path, expect=None))):
                line = error_line(r, path, word)
                report.append(f"{cmd} {what}: {line[15:170]}")
        check(open(afile).read() == "not a directory\n", "the file changed")
    finally:
        if mounted:
            subprocess.run(["umount", ro])
    print("refused with exit 2:\n  " + "\n  ".join(report) + ("" if mounted else "\n(not root: no read-only mount)"))


def case_header_limit(env, tmp):
    good = env.checkpoint("good")
    hf = os.path.join(tmp, "hf32")
    env.export(good, hf, "--dtype", "fp32")
    big = os.path.join(tmp, "big")
    os.makedirs(big)
    shutil.copy(os.path.join(hf, "config.json"), big)
    # The header length of a 300 MB header in a file that holds it (sparse: nothing is written).
    with open(os.path.join(big, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", 314583712) + b'{"t": ')
        f.truncate(325657832)
    line = error_line(env.import_(big, os.path.join(big, "ck"), expect=None), "314583712", "limit", "100000000")
    print(f"a 300 MB header: exit 2 ({line[15:]})")
    # Special files where the directory's files belong: refused before a read (run() times out at 120 s).
    shard = sorted(f for f in os.listdir(hf) if f.endswith(".safetensors"))[0]
    for name in ("config.json", shard):
        odd = os.path.join(tmp, "fifo-" + name)
        os.makedirs(odd)
        shutil.copy(os.path.join(hf, "config.json"), odd)
        for f in os.listdir(hf):
            if f.endswith(".safetensors") or f.endswith(".index.json"):
                shutil.copy(os.path.join(hf, f), odd)
        target = os.path.join(odd, name)
        if os.path.exists(target):
            os.remove(target)
        os.mkfifo(target)
        t0 = time.time()
        line = error_line(env.import_(odd, os.path.join(tmp, "ck-" + name), expect=None), name, "not a regular file")
        check(time.time() - t0 < 20, f"{name} as a FIFO: {time.time() - t0:.0f} s to be refused")
        print(f"{name} a FIFO: exit 2 at once ({line[15:]})")


CASES = {name[5:]: f for name, f in globals().items() if name.startswith("case_")}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", choices=sorted(CASES), required=True)
    p.add_argument("--fp8moe", required=True)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="fp8moe-hf-") as tmp:
        try:
            status = CASES[args.case](Env(args, tmp), tmp)
        except Failure as e:
            print(f"FAILED ({args.case}): {e}")
            return 1
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
