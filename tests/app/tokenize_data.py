"""scripts/tokenize-data.py on bad input and on failure (README "Data"), with a small word-level
tokenizer made here:
  - every bad input is refused with exit 2 and one line on stderr, `tokenize-data: error:
    FILE:LINE: reason`, never a traceback, and nothing written: bad JSON (also nested past Python's
    recursion limit), a line that is not an object, a missing key, a value that is not a string, a
    lone surrogate (`\\ud800`, `\\udfff`), invalid UTF-8 in a JSONL line and in a text file (the line
    of the bad byte, with and without --split-on), an empty input file;
  - the outputs are replaced only whole: a run that fails halfway (bad JSON after the first work
    items were written, with 1 and 2 workers; the validation index past a file-size limit,
    RLIMIT_FSIZE, after the training set's files were complete) leaves the previous outputs byte
    for byte and no temporary file; a run that succeeds replaces all four and leaves none.

usage: tokenize_data.py   (run by the Python of build/venv: numpy and tokenizers)
"""
import hashlib
import os
import resource
import subprocess
import sys
import tempfile

from tokenizers import Tokenizer, models, pre_tokenizers

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "tokenize-data.py")
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print(f"FAIL: {what}", file=sys.stderr)


def tokenizer(path):
    vocab = {"<|endoftext|>": 0, "[UNK]": 1}
    for w in "a b c d e f g h".split():
        vocab[w] = len(vocab)
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(path)


def write(path, data):
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass"))
    return path


def run(tok, args, file_size_limit=None):
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, resource.RLIM_INFINITY))
    return subprocess.run([sys.executable, SCRIPT, "--tokenizer", tok, *args], capture_output=True, text=True,
                          timeout=120, preexec_fn=limit if file_size_limit else None)


def snapshot(directory):
    """Every file of `directory`: name -> SHA-256 of its bytes."""
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def refusals(d, tok):
    """(name, inputs, extra arguments, the start of the error after 'tokenize-data: error: ')."""
    j = lambda name, text: write(os.path.join(d, name + ".jsonl"), text)
    t = lambda name, data: write(os.path.join(d, name + ".txt"), data)
    good = j("good", '{"text": "a b"}\n')
    p = j("badjson", '{"text": "a b"}\n{"text": "c"}\n{"text": "d"\n')
    yield "bad JSON", [good, p], [], f"{p}:3: bad JSON"
    p = j("deep", '{"text": "a"}\n' + "[" * 100000 + "]" * 100000 + "\n")
    yield "JSON nested 100000 deep", [p], [], f"{p}:2: bad JSON"
    p = j("list", '{"text": "a"}\n[1, 2]\n')
    yield "a line that is not an object", [p], [], f"{p}:2: no key 'text'"
    p = j("nokey", '{"text": "a"}\n{"body": "a"}\n')
    yield "a missing key", [p], [], f"{p}:2: no key 'text'"
    p = j("number", '{"text": 5}\n')
    yield "a number as the text", [p], [], f"{p}:1: 'text' is not a string"
    p = j("high", '{"text": "a b"}\n{"text": "a \\ud800 b"}\n')
    yield "a lone high surrogate", [good, p], [], f"{p}:2: 'text' holds a lone surrogate"
    p = j("low", '{"text": "a"}\n{"text": "b"}\n{"text": "\\udfff"}\n')
    yield "a lone low surrogate", [p], [], f"{p}:3: 'text' holds a lone surrogate"
    p = j("latin1", b'{"text": "a"}\n{"text": "a \xe9 b"}\n')
    yield "Latin-1 in JSONL", [p], [], f"{p}:2: not UTF-8"
    p = t("latin1", b"a b\nc d\ne \xff f\ng\n")
    yield "invalid UTF-8 in a text file", [good, p], [], f"{p}:3: not UTF-8"
    p = t("latin1split", b"a\n%\nb\nc \xff\n%\nd\n")
    yield "invalid UTF-8 in a text file's second document", [p], ["--split-on", "%"], f"{p}:4: not UTF-8"
    p = t("empty", b"")
    yield "an empty text file", [good, p], [], f"{p}:1: empty input"
    p = j("blank", "\n\n")
    yield "a JSONL file of blank lines", [p, good], [], f"{p}:1: empty input"


def check_refusals(d, tok):
    n = 0
    for name, inputs, extra, want in refusals(d, tok):
        out = os.path.join(d, "out-" + str(n))
        os.mkdir(out)
        r = run(tok, ["--input", *inputs, "--output", os.path.join(out, "x"), "--workers", "1", *extra])
        lines = r.stderr.splitlines()
        check(r.returncode == 2, f"{name}: exit {r.returncode}, not 2: {r.stderr[-2000:]}")
        check("Traceback" not in r.stderr, f"{name}: a traceback: {r.stderr[-2000:]}")
        check(len(lines) == 1 and lines[0].startswith("tokenize-data: error: " + want),
              f"{name}: expected one line 'tokenize-data: error: {want}...', got: {r.stderr[-2000:]}")
        check(os.listdir(out) == [], f"{name}: files written: {os.listdir(out)}")
        if len(lines) == 1:
            print(f"refused ({name}): {lines[0].replace(d + '/', '')}")
        n += 1
    return n


def check_atomic(d, tok):
    out = os.path.join(d, "atomic")
    prefix = os.path.join(out, "p")
    docs = lambda words, n: "".join('{"text": "%s"}\n' % words for _ in range(n))
    old = write(os.path.join(d, "old.jsonl"), docs("a b c", 600))
    r = run(tok, ["--input", old, "--output", prefix, "--val-fraction", "0.3", "--workers", "1"])
    check(r.returncode == 0, f"the first run: {r.stderr}")
    before = snapshot(out)
    check(sorted(before) == ["p.train.bin", "p.train.idx", "p.val.bin", "p.val.idx"], f"the first run wrote {sorted(before)}")
    # Bad JSON at line 500 of 600: the first work item (256 documents) is encoded and written first.
    late = write(os.path.join(d, "late.jsonl"), docs("d e", 499) + '{"text": \n' + docs("d e", 100))
    for workers in ("1", "2"):
        r = run(tok, ["--input", late, "--output", prefix, "--val-fraction", "0.3", "--workers", workers])
        check(r.returncode == 2 and f"{late}:500: bad JSON" in r.stderr and "Traceback" not in r.stderr,
              f"bad JSON at line 500, {workers} workers: exit {r.returncode}: {r.stderr[-2000:]}")
        check(snapshot(out) == before, f"bad JSON at line 500, {workers} workers: the outputs are now {snapshot(out)}")
    # 300 one-word documents, 90% to validation: its index (20 bytes a document) passes 4 KiB, after
    # the training set's two files (under 1 KiB each) and the validation tokens (~1 KiB) are written.
    small = write(os.path.join(d, "small.jsonl"), docs("f", 300))
    r = run(tok, ["--input", small, "--output", prefix, "--val-fraction", "0.9", "--workers", "1"], file_size_limit=4096)
    check(r.returncode == 2 and len(r.stderr.splitlines()) == 1 and os.strerror(27) in r.stderr,
          f"past the file-size limit: exit {r.returncode}: {r.stderr[-2000:]}")
    check(snapshot(out) == before, f"past the file-size limit: the outputs are now {snapshot(out)}")
    r = run(tok, ["--input", small, "--output", prefix, "--val-fraction", "0.9", "--workers", "2"])
    after = snapshot(out)
    check(r.returncode == 0 and sorted(after) == sorted(before) and all(after[k] != before[k] for k in before),
          f"a good run: exit {r.returncode}, outputs {after} (before: {before}): {r.stderr[-2000:]}")
    print("atomic: bad JSON at line 500 (1 and 2 workers) and a write past RLIMIT_FSIZE left the previous outputs "
          "byte for byte and no temporary; a good run replaced all four")


def main():
    with tempfile.TemporaryDirectory(prefix="fp8moe-tokenize-") as d:
        tok = os.path.join(d, "tok.json")
        tokenizer(tok)
        n = check_refusals(d, tok)
        check_atomic(d, tok)
    if failures:
        sys.exit(f"tokenize_data: {len(failures)} failures")
    print(f"tokenize_data: {n} kinds of bad input refused with FILE:LINE and exit 2; outputs replaced only whole")


if __name__ == "__main__":
    main()
