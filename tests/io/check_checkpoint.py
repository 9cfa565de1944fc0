"""Reads an fp8moe checkpoint with h5py alone (no fp8moe code) and recomputes every dataset's
checksum from the documented formula (README "Checkpoints"):
    sum mod 2^64 over elements of splitmix64(splitmix64(i) ^ bits),
    i = row-major global index, bits = the stored element's bytes as an unsigned integer;
a stacked dataset (slots, rows, cols) holds one such checksum per slot in `checksums`, i counted
from 0 in each. Format 2 stacks a MoE block's routed experts ("layers.3.moe.experts.w1", slot e
expert e); format 3 also every other tensor of the blocks, the same tensor of every block that has
it ("layers.attn.wq", its int64 attribute `layers` naming the block of each slot). Every tensor
must be where its format puts it, and nothing else stacked. BF16 datasets are also read through
h5py's own conversion to float32, which must equal the bits shifted into a float32.
Exit 0 when everything matches. `stored_tensors` splits a file's datasets back into tensors by name
(the other test helpers use it)."""
import re
import sys

import h5py
import numpy as np

M = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x):
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def checksum(raw_bits):
    i = np.arange(raw_bits.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        terms = splitmix64(splitmix64(i) ^ raw_bits.astype(np.uint64))
        return int(terms.sum(dtype=np.uint64))


EXPERTS = re.compile(r"(.*\.moe\.experts)\.(\d+\.)?([^.]+)")


def slot_names(name, d):
    """The tensor names of dataset `name` (relative to its group, e.g. "layers.attn.wq"), slot by
    slot; one name, for a 2-D dataset."""
    if d.ndim == 2:
        return [name]
    assert d.ndim == 3, name
    if "layers" in d.attrs:  # format 3: a per-block family, "layers.<rest>" -> "layers.<block>.<rest>"
        assert name.startswith("layers.") and len(d.attrs["layers"]) == d.shape[0], name
        return ["layers.%d.%s" % (int(b), name[len("layers."):]) for b in d.attrs["layers"]]
    m = EXPERTS.fullmatch(name)  # formats 2 and 3: a block's routed experts, slot e expert e
    assert m and m.group(2) is None, name
    return ["%s.%d.%s" % (m.group(1), e, m.group(3)) for e in range(d.shape[0])]


def stored_tensors(group):
    """{tensor name: (dataset name, slot or None)} of an h5py group (f["params"], f["optim/m"])."""
    out = {}
    for name, d in group.items():
        names = slot_names(name, d)
        for k, n in enumerate(names):
            out[n] = (name, k if d.ndim == 3 else None)
    return out


def read_tensors(group, dtype=None):
    """{tensor name: array} of an h5py group, each stacked dataset split into its slots."""
    out = {}
    for name, d in group.items():
        v = d[()] if dtype is None else np.asarray(d[()], dtype=dtype)
        for k, n in enumerate(slot_names(name, d)):
            out[n] = v[k] if d.ndim == 3 else v
    return out


def main(path):
    f = h5py.File(path, "r")
    for key in ("format_version", "step", "samples", "tokens", "config", "layout", "checksum_scheme"):
        assert key in f.attrs, "missing root attribute " + key
    names = []
    f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    version = int(f.attrs["format_version"])
    assert version in (1, 2, 3), "format_version %d" % version
    bf16 = stacked = 0
    for n in names:
        d = f[n]
        ftype = d.id.get_type()
        size = ftype.get_size()
        raw = np.empty(d.shape, dtype={2: np.uint16, 4: np.uint32, 8: np.uint64}[size])
        d.id.read(h5py.h5s.ALL, h5py.h5s.ALL, raw, mtype=ftype)  # the stored bytes, unconverted
        raw = raw.reshape(-1)
        if size == 2:  # bfloat16: h5py's own conversion to float32 must be the bits in the top half
            assert isinstance(ftype, h5py.h5t.TypeFloatID) and ftype.get_fields() == (15, 7, 8, 0, 7), n
            as_float = d.astype(np.float32)[()].reshape(-1)
            assert np.array_equal((raw.astype(np.uint32) << np.uint32(16)).view(np.float32), as_float), n
            bf16 += 1
        leaf = n.split("/", 2)[-1] if n.startswith("optim/") else n.split("/", 1)[-1]
        expert = re.search(r"\.moe\.experts\.", leaf)
        per_block = not n.startswith("fp8/") and leaf.startswith("layers.") and not expert
        # Where each format puts a tensor: the routed experts stacked from format 2, every other
        # tensor of the blocks from format 3 (named without the block's number), the rest alone.
        should_stack = (version >= 2 and expert) or (version >= 3 and per_block)
        if should_stack:
            assert d.ndim == 3 and "checksum" not in d.attrs, n
            assert ("layers" in d.attrs) == bool(per_block), n
            if per_block:
                assert not re.match(r"layers\.\d+\.", leaf), n
                blocks = [int(b) for b in d.attrs["layers"]]
                assert blocks == sorted(set(blocks)) and len(blocks) == d.shape[0], n
            names_of = slot_names(leaf, d)
            want = [int(x) for x in d.attrs["checksums"]]
            assert len(want) == d.shape[0], n
            per = raw.size // d.shape[0]
            for e in range(d.shape[0]):
                got = checksum(raw[e * per:(e + 1) * per])
                assert got == want[e], "%s, slot %d (%s): checksum %016x, stored %016x" % (n, e, names_of[e], got, want[e])
            stacked += 1
            continue
        assert d.ndim == 2 and "checksums" not in d.attrs and "layers" not in d.attrs, n
        if per_block:
            assert re.match(r"layers\.\d+\.", leaf), n
        want = int(d.attrs["checksum"])
        got = checksum(raw)
        assert got == want, "%s: checksum %016x, stored %016x" % (n, got, want)
    for group in ("params", "optim/m", "optim/v"):  # every tensor in one place only
        if group in f:
            held = sum(f[group][k].shape[0] if f[group][k].ndim == 3 else 1 for k in f[group])
            assert len(stored_tensors(f[group])) == held, group + ": a tensor stored twice"
    print("h5py: format %d, %d datasets (%d bfloat16, %d stacked), every checksum recomputed independently matches; "
          "step %d, layout %s"
          % (version, len(names), bf16, stacked, f.attrs["step"],
             f.attrs["layout"].decode() if isinstance(f.attrs["layout"], bytes) else f.attrs["layout"]))


def compare(a_path, b_path, bound=1e-3):
    """The same datasets in both files (the same global shapes); /params within `bound` relative
    to the largest element of each tensor. Two layouts sum in different orders (~1e-7 relative per
    gradient), and Adam's m / sqrt(v) is scale-free: for an element whose gradient is near zero that
    noise becomes an O(1) change of its update, i.e. up to ~lr per step in the weight."""
    a, b = h5py.File(a_path, "r"), h5py.File(b_path, "r")
    names = []
    a.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    others = []
    b.visititems(lambda n, o: others.append(n) if isinstance(o, h5py.Dataset) else None)
    assert sorted(names) == sorted(others), set(names) ^ set(others)
    for n in names:
        assert a[n].shape == b[n].shape, n
    # Each parameter on its own (a stacked dataset split into its tensors), relative to its own
    # largest element.
    x_all, y_all = read_tensors(a["params"], np.float64), read_tensors(b["params"], np.float64)
    worst, where = 0.0, ""
    for n, x in x_all.items():
        y = y_all[n]
        scale = max(np.abs(x).max(), 1e-30)
        d = np.abs(x - y).max() / scale
        if d > worst:
            worst, where = d, n
    assert worst <= bound, "%s differs by %.3g (relative to its largest element)" % (where, worst)
    print("global tensors of the two saves: %d datasets, %d parameters within %.2e of each other (worst: %s; "
          "bound %.0e)" % (len(names), len(x_all), worst, where, bound))


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1])
