#!/usr/bin/env python3
"""An independent NumPy reader and writer of Megatron-LM's indexed dataset (MMIDIDX), written from
the format's description alone: the C++ reader is tested against it.

P.bin holds the tokens of all sequences back to back; P.idx (little-endian) holds the magic
"MMIDIDX\\0\\0", u64 version 1, u8 dtype code, u64 sequence count, u64 document count, then int32
lengths[sequences], int64 byte pointers[sequences] into P.bin, int64 document_indices[documents]
(the first sequence of each document, then the sequence count; so documents + 1 entries).

CLI (for the C++ tests):
  megatron_format.py write PREFIX DTYPE docs:N,seqs:S,len:L,mod:M
      N documents of S sequences each; sequence j of document d has L + (d + j) % 3 tokens;
      token k of the whole stream (in file order) is (7 k + 3) % M. Prints nothing.
  megatron_format.py dump PREFIX
      "dtype NAME sequences S documents D tokens N" (D: documents, one less than the
      document_indices), then the token stream on one line, then document_indices on one line.
"""
import sys
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
NAMES = {code: name for name, code in CODES.items()}


def write(prefix, documents, dtype):
    """documents: a list of documents, each a list of sequences (lists or arrays of numbers)."""
    dt = np.dtype(dtype).newbyteorder("<")
    sequences = [s for doc in documents for s in doc]
    arrays = [np.asarray(s).astype(dt) for s in sequences]
    for s, a in zip(sequences, arrays):
        if not np.array_equal(a, np.asarray(s)):
            raise ValueError(f"a value does not fit {dt.name}")
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    pointers = (np.cumsum(lengths) - lengths) * dt.itemsize  # where each sequence starts
    doc_index = np.concatenate([[0], np.cumsum([len(doc) for doc in documents])]).astype(np.int64)
    with open(prefix + ".bin", "wb") as f:
        for a in arrays:
            f.write(a.tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(MAGIC)
        f.write(np.array([1], "<u8").tobytes())
        f.write(np.array([CODES[dt.name]], "u1").tobytes())
        f.write(np.array([len(arrays), len(doc_index)], "<u8").tobytes())
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_index.astype("<i8").tobytes())


def read(prefix):
    """-> dict(dtype, sequences: list of arrays, document_indices: array); checks every field."""
    idx = Path(prefix + ".idx").read_bytes()
    header = len(MAGIC) + 8 + 1 + 8 + 8
    if len(idx) < header or idx[:len(MAGIC)] != MAGIC:
        raise ValueError(f"{prefix}.idx: not an MMIDIDX index")
    version, = np.frombuffer(idx, "<u8", 1, len(MAGIC))
    code = idx[len(MAGIC) + 8]
    n, d = (int(x) for x in np.frombuffer(idx, "<u8", 2, len(MAGIC) + 9))
    if version != 1 or code not in NAMES:
        raise ValueError(f"{prefix}.idx: version {version}, dtype code {code}")
    if len(idx) != header + 12 * n + 8 * d:
        raise ValueError(f"{prefix}.idx: {len(idx)} bytes for {n} sequences and {d} document indices")
    dt = np.dtype(NAMES[code]).newbyteorder("<")
    lengths = np.frombuffer(idx, "<i4", n, header).astype(np.int64)
    pointers = np.frombuffer(idx, "<i8", n, header + 4 * n)
    doc_index = np.frombuffer(idx, "<i8", d, header + 12 * n)
    if (lengths < 0).any() or not np.array_equal(pointers, (np.cumsum(lengths) - lengths) * dt.itemsize):
        raise ValueError(f"{prefix}.idx: the pointers do not follow the lengths")
    if d < 1 or doc_index[0] != 0 or doc_index[-1] != n or (np.diff(doc_index) < 0).any():
        raise ValueError(f"{prefix}.idx: bad document_indices")
    raw = Path(prefix + ".bin").read_bytes()
    if len(raw) != int(lengths.sum()) * dt.itemsize:
        raise ValueError(f"{prefix}.bin: {len(raw)} bytes, the index says {lengths.sum()} tokens")
    tokens = np.frombuffer(raw, dt).astype(NAMES[code])  # a native, writable copy
    return dict(dtype=np.dtype(NAMES[code]), sequences=np.split(tokens, np.cumsum(lengths)[:-1]) if n else [],
                document_indices=doc_index.copy())


def pattern_documents(pattern):
    """The documents of "docs:N,seqs:S,len:L,mod:M" (see the module's help)."""
    p = {key: int(value) for key, value in (item.split(":") for item in pattern.split(","))}
    documents, k = [], 0
    for d in range(p["docs"]):
        doc = []
        for j in range(p["seqs"]):
            length = p["len"] + (d + j) % 3
            doc.append((np.arange(k, k + length, dtype=np.int64) * 7 + 3) % p["mod"])
            k += length
        documents.append(doc)
    return documents


def main(argv):
    if len(argv) == 4 and argv[0] == "write":
        write(argv[1], pattern_documents(argv[3]), argv[2])
    elif len(argv) == 2 and argv[0] == "dump":
        data = read(argv[1])
        tokens = np.concatenate(data["sequences"]) if data["sequences"] else np.zeros(0, np.int64)
        print(f"dtype {data['dtype'].name} sequences {len(data['sequences'])} "
              f"documents {len(data['document_indices']) - 1} tokens {tokens.size}")
        print(" ".join(map(str, tokens.tolist())))
        print(" ".join(map(str, data["document_indices"].tolist())))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"megatron_format: error: {e}")
