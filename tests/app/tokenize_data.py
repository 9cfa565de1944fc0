"""scripts/tokenize-data.py on bad input (README "Data"), with a small word-level tokenizer made
here:
  - every bad input is refused with exit 2 and one line on stderr, `tokenize-data: error:
    FILE:LINE: reason`, never a traceback, and nothing written: bad JSON (also nested past Python's
    recursion limit), a line that is not an object, a missing key, a value that is not a string, a
    lone surrogate (`\\ud800`, `\\udfff`), invalid UTF-8 in a JSONL line and in a text file (the line
    of the bad byte, with and without --split-on), an empty input file.

usage: tokenize_data.py   (run by the Python of build/venv: numpy and tokenizers)
"""
import os
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


def run(tok, args):
    return subprocess.run([sys.executable, SCRIPT, "--tokenizer", tok, *args], capture_output=True, text=True,
                          timeout=120)


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


def main():
    with tempfile.TemporaryDirectory(prefix="fp8moe-tokenize-") as d:
        tok = os.path.join(d, "tok.json")
        tokenizer(tok)
        n = check_refusals(d, tok)
    if failures:
        sys.exit(f"tokenize_data: {len(failures)} failures")
    print(f"tokenize_data: {n} kinds of bad input refused with FILE:LINE and exit 2")


if __name__ == "__main__":
    main()
