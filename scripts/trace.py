#!/usr/bin/env python3
"""The step timeline of `log.trace` (parallel/trace.h): one Chrome-trace JSON per rank.

  scripts/trace.py summary DIR          per rank: step, compute, communication exposed and hidden
                                        (the gradient reductions and the expert exchanges apart)
  scripts/trace.py merge DIR -o OUT     one file of every rank (pid = rank) for https://ui.perfetto.dev
  scripts/trace.py check DIR [--overlap GROUP ...]
                                        exit 1 unless every file is valid trace JSON, every posted
                                        collective's post comes before its wait and its end after
                                        the wait returned, and (--overlap) some
                                        collective of each GROUP ran while a backward (or a weight op) computed

Events: "X" complete events (cat compute: forward / backward / weight (ZB1P's weight part) of a
micro-batch, optimizer; cat
phase: the gradient reduction's waits after the backward; cat step: the whole step; cat = a group name, tp ep dp edp pp world: a blocking call or
a wait), and "b"/"e" pairs (cat = the group) from a non-blocking collective's post to the end of its
wait, and from each pipeline send's post to the end of the wait for it. Standard library only.
"""
import argparse
import glob
import json
import os
import sys


def load(directory):
    ranks = {}
    for path in sorted(glob.glob(os.path.join(directory, "rank*.json"))):
        with open(path) as f:
            doc = json.load(f)
        events = doc["traceEvents"]
        pids = {e["pid"] for e in events}
        if len(pids) != 1:
            raise ValueError(f"{path}: events of {len(pids)} pids, expected one (its rank)")
        ranks[pids.pop()] = (path, events)
    if not ranks:
        raise ValueError(f"{directory}: no rank*.json")
    return dict(sorted(ranks.items()))


def intervals(events, pred):
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X" and pred(e))


def union(spans):
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covered(span, spans):
    """Microseconds of span inside the union of spans."""
    a, b = span
    return sum(max(0, min(b, y) - max(a, x)) for x, y in union(spans))


def posted(events):
    """(cat, name, post ts, wait end ts) of each non-blocking collective; raises on a bad pair."""
    begins, pairs = {}, []
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["ph"] == "b":
            if e["id"] in begins:
                raise ValueError(f"collective {e['id']} posted twice")
            begins[e["id"]] = e
        elif e["ph"] == "e":
            b = begins.pop(e["id"], None)
            if b is None:
                raise ValueError(f"collective {e['id']} ({e['cat']} {e['name']}): a wait with no post before it")
            pairs.append((e["cat"], e["name"], b["ts"], e["ts"]))
    if begins:
        raise ValueError(f"posted collectives never waited: {sorted(begins)}")
    return pairs


def validate(events):
    for e in events:
        for key in ("name", "ph", "ts", "pid", "tid"):
            if key not in e:
                raise ValueError(f"event without {key}: {e}")
        if e["ph"] == "X" and (not isinstance(e.get("dur"), int) or e["dur"] < 0):
            raise ValueError(f"complete event without a duration: {e}")
        if e["ph"] in ("b", "e") and "id" not in e:
            raise ValueError(f"async event without an id: {e}")


def summary(directory):
    ranks = load(directory)
    print(f"{directory}: {len(ranks)} ranks; seconds over the traced steps")
    print("rank   step   compute  blocked  (bubble pp)  posted  hidden  exposed-wait  ep-posted  ep-wait  blocked by group")
    for rank, (_, events) in ranks.items():
        step = sum(e["dur"] for e in events if e["ph"] == "X" and e.get("cat") == "step")
        compute = union(intervals(events, lambda e: e.get("cat") == "compute"))
        compute_s = sum(b - a for a, b in compute)
        comm = [e for e in events if e["ph"] == "X" and e.get("cat") not in ("compute", "phase", "step")]
        blocked = sum(e["dur"] for e in comm)
        recv = sum(e["dur"] for e in comm if e.get("cat") == "pp" and e["name"] == "recv")
        by_group = {}
        for e in comm:
            by_group[e["cat"]] = by_group.get(e["cat"], 0) + e["dur"]
        every = [x for x in posted(events) if x[1] != "send"]  # not the pipeline's sends
        pairs = [x for x in every if x[0] != "ep"]  # the gradient reductions
        experts = [x for x in every if x[0] == "ep"]  # the expert exchanges (runtime.overlap_expert_comm)
        backward = intervals(events, lambda e: e.get("cat") == "compute" and e["name"] in ("backward", "weight"))
        span = sum(w - p for _, _, p, w in pairs)
        hidden = sum(covered((p, w), backward) for _, _, p, w in pairs)
        waits = sum(e["dur"] for e in comm if e["name"] == "wait" and e.get("cat") != "ep")
        ep_span = sum(w - p for _, _, p, w in experts)
        ep_waits = sum(e["dur"] for e in comm if e["name"] == "wait" and e.get("cat") == "ep")
        groups = " ".join(f"{g} {v / 1e6:.3f}" for g, v in sorted(by_group.items()))
        print(f"{rank:4d} {step / 1e6:7.3f} {compute_s / 1e6:8.3f} {blocked / 1e6:8.3f}  ({recv / 1e6:8.3f})"
              f"  {span / 1e6:6.3f}  {hidden / 1e6:6.3f}  {waits / 1e6:12.3f}  {ep_span / 1e6:9.3f}  {ep_waits / 1e6:7.3f}"
              f"  {groups}")
    print("step: the traced steps' wall time; compute: forward, backward and optimizer;\n"
          "blocked: inside communication calls (pipeline receives in parentheses: the bubble); posted:\n"
          "post-to-wait spans of the non-blocking gradient reductions, hidden: their part under a\n"
          "backward; exposed-wait: the time their waits blocked; ep-posted: post-to-wait spans of the\n"
          "expert exchanges posted inside a MoE layer (the shared experts' and the weight gradients'\n"
          "work between), ep-wait: the time their waits blocked (both inside ep's blocked time).")


def merge(directory, out):
    merged = []
    for _, (_, events) in load(directory).items():
        merged.extend(events)
    with open(out, "w") as f:
        json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, f)
    print(f"{out}: {len(merged)} events; open it in https://ui.perfetto.dev")


def check(directory, overlap_groups):
    ranks = load(directory)
    seen = {g: False for g in overlap_groups}
    for rank, (path, events) in ranks.items():
        try:
            validate(events)
            pairs = posted(events)
            # A collective ends when its wait returns: a "wait" of its group between its post and its end.
            waits = [(e["cat"], e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X" and e["name"] == "wait"]
            for cat, name, p, w in pairs:
                if name != "send" and not any(c == cat and p <= a and b <= w for c, a, b in waits):
                    raise ValueError(f"{cat} {name} posted at {p} us ends at {w} us without a wait of {cat} inside")
        except ValueError as e:
            print(f"{path}: {e}")
            return 1
        backward = intervals(events, lambda e: e.get("cat") == "compute" and e["name"] in ("backward", "weight"))
        for cat, _, p, w in pairs:
            if cat in seen and covered((p, w), backward) > 0:
                seen[cat] = True
    missing = [g for g, ok in seen.items() if not ok]
    if missing:
        print(f"{directory}: no collective of {' '.join(missing)} ran while a backward computed")
        return 1
    print(f"{directory}: {len(ranks)} ranks valid; every post before its wait"
          + (f"; {' '.join(overlap_groups)} overlap a backward" if overlap_groups else ""))
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summary")
    s.add_argument("dir")
    m = sub.add_parser("merge")
    m.add_argument("dir")
    m.add_argument("-o", "--out", required=True)
    c = sub.add_parser("check")
    c.add_argument("dir")
    c.add_argument("--overlap", nargs="*", default=[])
    a = ap.parse_args()
    try:
        if a.cmd == "summary":
            summary(a.dir)
            return 0
        if a.cmd == "merge":
            merge(a.dir, a.out)
            return 0
        return check(a.dir, a.overlap)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        print(f"trace.py: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
