#!/usr/bin/env python3
"""Tokenizes text into Megatron-LM's indexed dataset format (MMIDIDX), fp8moe's token-data format.

Uses a Hugging Face `tokenizers` file (tokenizer.json, as DeepSeek-V3, Llama and Qwen publish it).
Every document becomes one sequence: its tokens (no special tokens from the post-processor) and the
end-of-document token. A deterministic hash of (seed, document number) sends a document to
PREFIX.val, else to PREFIX.train; each is a PREFIX.*.bin / PREFIX.*.idx pair.

Inputs: a text file is one document, or several separated by lines equal to --split-on (e.g. "%"
for fortune files); a .jsonl file holds one JSON object per line whose --json-key is a document.
Bad input (bad JSON, a missing key, a lone surrogate, invalid UTF-8, an empty file) is exit 2 and
one line "tokenize-data: error: FILE:LINE: reason". The four outputs are written as PATH.tmp.PID
and renamed into place only when all four are complete: a failed run leaves the previous ones.

  tokenize-data.py --tokenizer tokenizer.json --input corpus.jsonl --output data/corpus
"""
import argparse
import array
import contextlib
import hashlib
import itertools
import json
import multiprocessing
import os
import sys
import time

import numpy as np

EOD_CANDIDATES = ("<|endoftext|>", "<｜end▁of▁sentence｜>", "</s>", "<eos>", "<|end_of_text|>")
MAGIC = b"MMIDIDX\x00\x00"
DTYPE_CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
CHUNK_DOCS, CHUNK_BYTES = 256, 4 << 20  # a work item: up to 256 documents or 4 MiB of text


class InputError(Exception):
    """A problem with the command line or the inputs: reported as "tokenize-data: error: ...", exit 2."""


class WriteError(Exception):
    """An output that could not be written (reported as InputError is; no output was replaced)."""


@contextlib.contextmanager
def writing(path, tmp):
    try:
        yield
    except OSError as e:
        raise WriteError(f"{path}: cannot write {tmp}: {e.strerror}; no output was replaced") from None


# ---------------------------------------------------------------------------------------------
# Reading documents (in input order)

def read_text(path, split_on):
    """Yields (text, bytes read) per document of a text file."""
    if split_on is None:
        with open(path, "rb") as f:
            data = f.read()
        if not data:
            raise InputError(f"{path}:1: empty input: no documents")
        yield decode(data, path, 1), len(data)
        return
    sep = split_on.encode()
    lines, start, nbytes, empty = [], 1, 0, True
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            empty = False
            nbytes += len(line)
            bare = line[:-1] if line.endswith(b"\n") else line
            if (bare[:-1] if bare.endswith(b"\r") else bare) == sep:
                yield decode(b"".join(lines), path, start), nbytes
                lines, start, nbytes = [], lineno + 1, 0
            else:
                lines.append(line)
    if empty:
        raise InputError(f"{path}:1: empty input: no documents")
    if lines:
        yield decode(b"".join(lines), path, start), nbytes


def read_jsonl(path, key):
    """Yields (text, bytes read) per non-blank line of a JSON-lines file."""
    documents = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = parse_json_line(line, path, lineno)
            if not isinstance(record, dict) or key not in record:
                raise InputError(f"{path}:{lineno}: no key '{key}'")
            text = record[key]
            if not isinstance(text, str):
                raise InputError(f"{path}:{lineno}: '{key}' is not a string")
            try:  # JSON's \ud800 escapes decode to lone surrogates, which are not Unicode text
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InputError(f"{path}:{lineno}: '{key}' holds a lone surrogate (\\u{ord(text[e.start]):04x} at "
                                 f"character {e.start + 1}): not Unicode text") from None
            documents += 1
            yield text, len(line)
    if documents == 0:
        raise InputError(f"{path}:1: empty input: no documents (an empty file, or blank lines only)")


def parse_json_line(line, path, lineno):
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}:{lineno}: not UTF-8 ({e.reason} at byte {e.start + 1} of the line)") from None
    if lineno == 1:
        text = text.removeprefix("\ufeff")  # a byte-order mark
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}:{lineno}: bad JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise InputError(f"{path}:{lineno}: bad JSON: nested too deeply") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise InputError(f"{path}:{lineno}: bad JSON: {e}") from None


def decode(data, path, first_line):
    """data (lines first_line, first_line + 1, ... of path) as text; InputError at the line of the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise InputError(f"{path}:{line}: not UTF-8 ({e.reason} at byte {column} of the line)") from None


def chunks(args):
    """Yields (texts, bytes read) work items over all inputs, in input order."""
    texts, nbytes = [], 0
    for path in args.input:
        try:
            docs = read_jsonl(path, args.json_key) if path.endswith(".jsonl") else read_text(path, args.split_on)
            for text, n in docs:
                texts.append(text)
                nbytes += n
                if len(texts) >= CHUNK_DOCS or nbytes >= CHUNK_BYTES:
                    yield texts, nbytes
                    texts, nbytes = [], 0
        except OSError as e:
            raise InputError(f"cannot read {path}: {e.strerror}") from None
    if texts:
        yield texts, nbytes


# ---------------------------------------------------------------------------------------------
# Encoding (in the worker processes)

_worker = {}


def init_worker(tokenizer_path, eod_id, dtype):
    # One process per core: the tokenizer's own thread pool would only oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer
    _worker.update(tokenizer=Tokenizer.from_file(tokenizer_path), eod=eod_id, dtype=np.dtype(dtype))


def encode_chunk(item):
    """(texts, bytes) -> (per-document lengths, 0 for an empty document; all tokens with EODs; bytes)."""
    texts, nbytes = item
    ids = [e.ids for e in _worker["tokenizer"].encode_batch(texts, add_special_tokens=False)]
    lengths = np.array([len(doc) + 1 if doc else 0 for doc in ids], dtype=np.int64)
    tokens = np.fromiter(itertools.chain.from_iterable(doc + [_worker["eod"]] for doc in ids if doc),
                         dtype=_worker["dtype"], count=int(lengths.sum()))
    return lengths, tokens, nbytes


# ---------------------------------------------------------------------------------------------
# Writing (streaming tokens to PREFIX.bin, the index at the end; both under temporary names in the
# same directory, renamed into place when every output is complete)

class IndexedWriter:
    def __init__(self, prefix, dtype):
        self.prefix, self.dtype = prefix, np.dtype(dtype).newbyteorder("<")
        self.lengths = array.array("q")  # tokens per sequence (= per document)
        self.tokens = 0
        # The process id in the name: a concurrent run to the same prefix never writes into these.
        self.tmp = {ext: f"{prefix}{ext}.tmp.{os.getpid()}" for ext in (".bin", ".idx")}
        self.bin = open(self.tmp[".bin"], "wb")

    def add(self, tokens):
        if len(tokens) >= 2**31:  # the index stores int32 lengths
            raise InputError(f"a document of {len(tokens)} tokens: split the input into smaller documents")
        with writing(self.prefix + ".bin", self.tmp[".bin"]):
            self.bin.write(np.asarray(tokens, self.dtype).tobytes())
        self.lengths.append(len(tokens))
        self.tokens += len(tokens)

    def finish(self):
        """Completes both temporary files, on disk (fsync); the final names are not touched yet."""
        with writing(self.prefix + ".bin", self.tmp[".bin"]):
            self.bin.flush()
            os.fsync(self.bin.fileno())
            self.bin.close()
        n = len(self.lengths)
        lengths = np.frombuffer(self.lengths, np.int64)
        pointers = np.zeros(n, np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        with writing(self.prefix + ".idx", self.tmp[".idx"]), open(self.tmp[".idx"], "wb") as f:
            f.write(MAGIC)
            f.write(np.asarray([1], "<u8").tobytes())  # version
            f.write(np.asarray([DTYPE_CODES[self.dtype.name]], "u1").tobytes())
            f.write(np.asarray([n, n + 1], "<u8").tobytes())  # sequence count, document count
            f.write(np.asarray(lengths, "<i4").tobytes())
            f.write(np.asarray(pointers, "<i8").tobytes())
            f.write(np.arange(n + 1, dtype="<i8").tobytes())  # document indices: one sequence each
            f.flush()
            os.fsync(f.fileno())

    def commit(self):
        for ext in (".bin", ".idx"):
            os.replace(self.tmp[ext], self.prefix + ext)

    def abort(self):
        """Removes the temporary files (what commit() renamed is not there any more)."""
        try:
            self.bin.close()  # flushes: fails again when writing failed
        except OSError:
            pass
        for path in self.tmp.values():
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def write_outputs(prefix, dtype, fill):
    """Writes PREFIX.train and PREFIX.val: fill(writers) adds the documents. The four files appear
    under their names only when all four are complete; on any failure none is replaced and the
    temporary files are removed."""
    writers = {}
    try:
        for split in ("train", "val"):
            writers[split] = IndexedWriter(f"{prefix}.{split}", dtype)
        result = fill(writers)
        for w in writers.values():
            w.finish()
        for w in writers.values():
            w.commit()
        fd = os.open(os.path.dirname(prefix) or ".", os.O_RDONLY)  # the renames, on disk
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return writers, result
    except BaseException:
        for w in writers.values():
            w.abort()
        raise


def validation_hash(seed, number):
    """Maps (seed, document number) to [0, 1), the same on every machine and Python version. Documents
    are numbered in input order, empty ones included: the split does not depend on the tokenizer."""
    digest = hashlib.blake2b(f"{seed}:{number}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


# ---------------------------------------------------------------------------------------------

def parse_args():
    p = argparse.ArgumentParser(prog="tokenize-data", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json")
    p.add_argument("--input", required=True, nargs="+", metavar="FILE", help="text files and .jsonl files")
    p.add_argument("--output", required=True, metavar="PREFIX", help="writes PREFIX.{train,val}.{bin,idx}")
    p.add_argument("--split-on", metavar="STR", help="in text files, lines equal to STR separate documents")
    p.add_argument("--json-key", default="text", metavar="KEY", help="the document's field in .jsonl (text)")
    p.add_argument("--val-fraction", type=float, default=0.05, metavar="F", help="in [0, 1) (0.05)")
    p.add_argument("--seed", type=int, default=1234, help="of the train/validation split (1234)")
    p.add_argument("--eod", metavar="TOKEN", help="the end-of-document token (default: the first of "
                   + ", ".join(EOD_CANDIDATES) + " in the vocabulary)")
    p.add_argument("--workers", type=int, default=os.cpu_count(), metavar="N", help="encoding processes")
    return p.parse_args()


def load_tokenizer(args):
    """(vocabulary size, end-of-document token, its id, the token dtype)."""
    from tokenizers import Tokenizer
    try:
        tokenizer = Tokenizer.from_file(args.tokenizer)
    except Exception as e:  # the library raises a bare Exception for a missing or bad file
        raise InputError(f"cannot load the tokenizer {args.tokenizer}: {e}") from None
    # The model's vocabulary must hold the largest id, which added tokens can place past the count.
    vocab = max(tokenizer.get_vocab_size(with_added_tokens=True),
                max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1)
    eod = args.eod or next((t for t in EOD_CANDIDATES if tokenizer.token_to_id(t) is not None), None)
    if eod is None:
        raise InputError("no end-of-document token among " + ", ".join(EOD_CANDIDATES) + ": give --eod")
    eod_id = tokenizer.token_to_id(eod)
    if eod_id is None:
        raise InputError(f"--eod {eod} is not in the tokenizer's vocabulary")
    return vocab, eod, eod_id, np.dtype(np.uint16 if vocab < 65500 else np.int32)


def tokenize(args, init, writers):
    """Encodes every document of the inputs into writers; returns (documents, empty documents)."""
    pool = multiprocessing.Pool(args.workers, init_worker, init) if args.workers > 1 else None
    try:
        if pool:  # imap keeps the input order; a full pipe to the workers holds the reader back
            results = pool.imap(encode_chunk, chunks(args))
        else:
            init_worker(*init)
            results = map(encode_chunk, chunks(args))
        number = empty = nbytes = 0
        start = last_report = time.monotonic()
        for lengths, tokens, n in results:
            offset = 0
            for length in lengths.tolist():
                if length == 0:
                    empty += 1
                else:
                    val = validation_hash(args.seed, number) < args.val_fraction
                    writers["val" if val else "train"].add(tokens[offset:offset + length])
                    offset += length
                number += 1
            nbytes += n
            now = time.monotonic()
            if now - last_report >= 5:
                last_report = now
                print(f"tokenize-data: {number} documents, {nbytes / 2**20:.1f} MiB read, "
                      f"{sum(w.tokens for w in writers.values())} tokens, "
                      f"{nbytes / 2**20 / (now - start):.1f} MiB/s", file=sys.stderr, flush=True)
        if not writers["train"].lengths:
            raise InputError(f"no training documents ({number} documents read, {empty} of them empty)")
        return number, empty
    finally:
        if pool:
            pool.terminate()


def main():
    args = parse_args()
    if not 0 <= args.val_fraction < 1:
        raise InputError(f"--val-fraction {args.val_fraction} is not in [0, 1)")
    if args.workers < 1:
        raise InputError("--workers must be at least 1")
    for path in args.input:  # fail before any work, not halfway through
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise InputError(f"cannot read {path}")
    vocab, eod, eod_id, dtype = load_tokenizer(args)

    out_dir = os.path.dirname(args.output)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    init = (args.tokenizer, eod_id, dtype.name)
    writers, (_, empty) = write_outputs(args.output, dtype, lambda w: tokenize(args, init, w))
    if empty:
        print(f"tokenize-data: empty documents skipped: {empty}", file=sys.stderr)
    t, v = writers["train"], writers["val"]
    print(f"tokenize-data: {t.prefix}: {len(t.lengths)} documents, {t.tokens} tokens; "
          f"{v.prefix}: {len(v.lengths)} documents, {v.tokens} tokens; "
          f"vocabulary {vocab}, dtype {dtype.name}, end of document {eod} = {eod_id}")


if __name__ == "__main__":
    try:
        main()
    except (InputError, WriteError, OSError) as e:  # OSError: e.g. creating the output directory
        print(f"tokenize-data: error: {e}", file=sys.stderr)
        sys.exit(2)
