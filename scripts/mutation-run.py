#!/usr/bin/env python3
"""The mutation run: does the test suite notice a one-line bug?

Each mutation of tests/mutations.toml names a file, an exact text that must occur in it exactly
once, its replacement, and the ctest names (regular expressions) that should notice. For each, in a
scratch copy of the working tree: apply it, rebuild the targets those tests run, run them; it is
killed when a test fails (or the build breaks: reported apart, as that says nothing of the tests),
and survives when they pass. A mutation whose text no longer occurs, or occurs more than once, is
reported as such, never skipped. Prints a table; exits 1 unless every mutation was killed.

  scripts/mutation-run.py                 every mutation (about 40 minutes on a 2-core VM: README)
  scripts/mutation-run.py --only a,b      the named ones
  scripts/mutation-run.py --list          the table of mutations, nothing run
  scripts/mutation-run.py --check         each mutation's text occurs exactly once (a ctest, in CI)

The scratch copy (default /tmp/fp8moe-mutants, or --scratch) keeps its CPU-only build between runs,
so a second run only recompiles what changed. Before the mutations, the union of their tests runs
on the unmutated copy (--no-baseline skips that): a test that fails there would 'kill' anything.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def sh(cmd, log=None, cwd=None, env=None, check=True):
    """Runs cmd; output to the open file `log` (or captured and returned). Returns (rc, text)."""
    if log is not None:
        log.write("$ " + " ".join(map(str, cmd)) + "\n")
        log.flush()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        text = ""
    else:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env)
        rc, text = p.returncode, p.stdout
    if check and rc != 0:
        sys.exit(f"mutation-run: {' '.join(map(str, cmd))} failed with status {rc}" + (f"\n{text}" if text else ""))
    return rc, text


def mpi_env():
    """The environment with scripts/mpi-env.sh sourced (mpirun as root, oversubscription)."""
    out = subprocess.run(["bash", "-c", f"source '{REPO}/scripts/mpi-env.sh' && env -0"], stdout=subprocess.PIPE,
                         check=True).stdout
    return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)


def load_mutations(path):
    with open(path, "rb") as f:
        doc = tomllib.load(f)
    muts = doc.get("mutation", [])
    seen = set()
    for m in muts:
        for key in ("id", "file", "find", "replace", "tests", "why"):
            if key not in m:
                sys.exit(f"mutation-run: {path}: mutation {m.get('id', '?')} has no '{key}'")
        if m["id"] in seen:
            sys.exit(f"mutation-run: {path}: mutation id {m['id']} twice")
        if m["find"] == m["replace"]:
            sys.exit(f"mutation-run: {path}: mutation {m['id']} replaces its text by itself")
        seen.add(m["id"])
    return muts


def sync_tree(scratch_src):
    """Copies the working tree (tracked and untracked-but-not-ignored files) into scratch_src,
    touching only files whose content differs, so that an unchanged tree rebuilds nothing."""
    _, listing = sh(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"])
    files = [f for f in listing.split("\0") if f and (REPO / f).is_file()]
    scratch_src.mkdir(parents=True, exist_ok=True)
    wanted = set(files)
    for f in files:
        src, dst = REPO / f, scratch_src / f
        data = src.read_bytes()
        if not dst.is_file() or dst.read_bytes() != data:
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
            shutil.copymode(src, dst)
    for p in scratch_src.rglob("*"):
        rel = str(p.relative_to(scratch_src))
        if p.is_file() and not p.is_symlink() and rel not in wanted and not rel.startswith("build/"):
            p.unlink()
    # The scripts find the Python environment at build/venv: the repository's, by a link.
    venv, link = REPO / "build" / "venv", scratch_src / "build" / "venv"
    if venv.is_dir() and not link.exists():
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(venv)


def configure(src, build, log):
    if (build / "build.ninja").is_file():
        return
    python = REPO / "build" / "venv" / "bin" / "python3"
    cmd = ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
           "-DFP8MOE_CUDA=OFF", "-DFP8MOE_BUILD_BENCH=OFF", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    if python.is_file():  # the JAX reference and the Python checks use the project's venv
        cmd.append(f"-DFP8MOE_PYTHON={python}")
    sh(cmd, log=log)


def ctest_regex(patterns):
    # NOTE: no groups: CMake's regular expressions allow only a few parentheses.
    return "|".join(dict.fromkeys(patterns))


def tests_and_targets(build, patterns, env):
    """The ctest names matching the patterns and the build targets their commands run."""
    _, text = sh(["ctest", "--test-dir", str(build), "--show-only=json-v1", "-R", ctest_regex(patterns)], env=env)
    doc = json.loads(text)
    # Only what ninja builds is a target: a test's command also names files the build does not make
    # (the venv's python3, made by scripts/test.sh), and ninja refuses an unknown target outright.
    _, listing = sh(["ninja", "-C", str(build), "-t", "targets", "all"])
    known = {line.split(":", 1)[0] for line in listing.splitlines()}
    names, targets = [], {"fp8moe"}  # the app tests run the fp8moe executable through the test helpers
    for t in doc.get("tests", []):
        names.append(t["name"])
        for arg in t.get("command", []):
            p = Path(arg)
            if p.is_absolute() and build in p.parents and p.suffix == "":
                rel = str(p.relative_to(build))
                if rel in known:
                    targets.add(rel)
    return names, sorted(targets)


FAIL_RE = re.compile(r"Test +#\d+: (.+?) \.+ *\*\*\*(Failed|Exception|Timeout|Not Run)")


def run_tests(build, patterns, env, log, timeout):
    """Runs the tests; returns (passed, first failing test or '')."""
    rc, _ = sh(["ctest", "--test-dir", str(build), "-R", ctest_regex(patterns), "--no-tests=error",
                "--stop-on-failure", "--output-on-failure", "--timeout", str(timeout)], log=log, env=env, check=False)
    if rc == 0:
        return True, ""
    log.flush()
    failed = FAIL_RE.findall(Path(log.name).read_text(errors="replace"))
    if not failed:
        return False, f"ctest status {rc}"
    name, how = failed[-1]
    return False, name if how == "Failed" else f"{name} ({how.lower()})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mutations", default=str(REPO / "tests" / "mutations.toml"))
    ap.add_argument("--scratch", default=os.environ.get("FP8MOE_MUTANTS", "/tmp/fp8moe-mutants"))
    ap.add_argument("--only", default="", help="comma-separated mutation ids")
    ap.add_argument("--list", action="store_true", help="print the mutations and exit")
    ap.add_argument("--check", action="store_true",
                    help="only check that every mutation's text occurs exactly once in the working tree (no build)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the tests")
    ap.add_argument("--timeout", type=int, default=900,
                    help="seconds for a test that sets no timeout of its own (a hang counts as a kill)")
    args = ap.parse_args()

    muts = load_mutations(args.mutations)
    if args.only:
        ids = args.only.split(",")
        unknown = [i for i in ids if i not in {m["id"] for m in muts}]
        if unknown:
            sys.exit(f"mutation-run: no mutation named {', '.join(unknown)}")
        muts = [m for m in muts if m["id"] in ids]
    if args.list:
        for m in muts:
            print(f"{m['id']:34} {m['file']:28} {m['why']}")
        print(f"{len(muts)} mutations")
        return 0
    if args.check:
        bad = []
        for m in muts:
            path = REPO / m["file"]
            n = path.read_text().count(m["find"]) if path.is_file() else -1
            if n != 1:
                bad.append(f"{m['id']}: {m['file']}: " + ("no such file" if n < 0 else f"its text occurs {n} times"))
        for line in bad:
            print("mutation-run --check: " + line)
        print(f"mutation-run --check: {len(muts) - len(bad)} of {len(muts)} mutations find their text exactly once")
        return 1 if bad else 0

    scratch = Path(args.scratch).resolve()
    src, build, logs = scratch / "src", scratch / "build", scratch / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = mpi_env()
    t_start = time.time()
    with open(logs / "setup.log", "w") as log:
        sync_tree(src)
        configure(src, build, log)
        # Everything first: the gtest cases are registered with ctest when their binary is built.
        if sh(["ninja", "-C", str(build)], log=log, check=False)[0] != 0:
            sys.exit(f"mutation-run: the unmutated copy does not build: {logs / 'setup.log'}")
    print(f"mutation-run: {len(muts)} mutations; scratch copy {src}, logs {logs}", flush=True)

    # Every mutation's text first: a pattern that no longer occurs exactly once is reported now.
    originals, status = {}, {}
    for m in muts:
        path = src / m["file"]
        text = path.read_text() if path.is_file() else None
        n = text.count(m["find"]) if text is not None else 0
        if text is None:
            status[m["id"]] = "NO FILE"
        elif n != 1:
            status[m["id"]] = "NO MATCH" if n == 0 else f"MATCHES {n}x"
        originals[m["file"]] = text

    plans = {}
    for m in muts:
        names, targets = tests_and_targets(build, m["tests"], env)
        if not names:
            status[m["id"]] = "NO TESTS"
        plans[m["id"]] = (names, targets)

    runnable = [m for m in muts if m["id"] not in status]
    if runnable and not args.no_baseline:
        patterns = [p for m in runnable for p in m["tests"]]
        targets = sorted({t for m in runnable for t in plans[m["id"]][1]})
        t0 = time.time()
        with open(logs / "baseline.log", "w") as log:
            rc, _ = sh(["ninja", "-C", str(build)] + targets, log=log, check=False)
            if rc != 0:
                sys.exit(f"mutation-run: the unmutated copy does not build: {logs / 'baseline.log'}")
            ok, first = run_tests(build, patterns, env, log, args.timeout)
        if not ok:
            sys.exit(f"mutation-run: {first} fails without any mutation: {logs / 'baseline.log'}")
        print(f"baseline: {len({n for m in runnable for n in plans[m['id']][0]})} tests pass unmutated "
              f"({time.time() - t0:.0f} s)", flush=True)

    rows = []
    for m in muts:
        mid, file = m["id"], m["file"]
        names, targets = plans[mid]
        if mid in status:
            rows.append((mid, file, status[mid], "", 0.0))
            print(f"{mid:34} {status[mid]}", flush=True)
            continue
        path = src / file
        original = originals[file]
        t0 = time.time()
        with open(logs / f"{mid}.log", "w") as log:
            path.write_text(original.replace(m["find"], m["replace"], 1))
            try:
                rc, _ = sh(["ninja", "-C", str(build)] + targets, log=log, check=False)
                if rc != 0:
                    result, by = "BUILD FAILED", ""
                else:
                    ok, by = run_tests(build, m["tests"], env, log, args.timeout)
                    result = "survived" if ok else "killed"
            finally:
                path.write_text(original)
        dt = time.time() - t0
        rows.append((mid, file, result, by, dt))
        print(f"{mid:34} {result:8} {by} ({dt:.0f} s)", flush=True)

    # The copy is left unmutated; rebuild so that the next run starts from a consistent build.
    with open(logs / "restore.log", "w") as log:
        sh(["ninja", "-C", str(build)] + sorted({t for m in muts for t in plans[m["id"]][1]}), log=log, check=False)

    print()
    print("| mutation | file | result | killed by | s |")
    print("| --- | --- | --- | --- | ---: |")
    for mid, file, result, by, dt in rows:
        print(f"| {mid} | {file} | {result} | {by} | {dt:.0f} |")
    bad = [r for r in rows if r[2] != "killed"]
    total = time.time() - t_start
    print(f"\n{len(rows) - len(bad)} of {len(rows)} mutations killed in {total:.0f} s", flush=True)
    if bad:
        print("not killed: " + ", ".join(f"{r[0]} ({r[2]})" for r in bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
