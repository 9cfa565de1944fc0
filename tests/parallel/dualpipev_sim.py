#!/usr/bin/env python3
"""DualPipeV as fp8moe runs it, simulated independently of the C++ (parallel/pipeline_schedule.cpp).

The schedule is rebuilt here from its eight parts (deepseek-ai/DualPipe's V-shaped form, as
parallel/pipeline_schedule.h states them); then all P ranks run it as app/stage_runner.cpp does:
every backward whole (the weight ops empty), an F&B op its backward first and then its forward, each
starting when its rank is free and its input is there. It checks the closed forms that
tests/parallel/test_pipeline_schedule.cpp (DualPipeVAsFp8moeRunsIt) asserts of the C++ simulation:
the slowest rank idles 2B(P - 1) - F for B = 2F and 3F, 2B(P - 1) for B = F, for M >= 2P.
"""
import sys


def schedule(P, r, M):
    """Rank r's ops: ('f', phase, mb), ('b', phase, mb), or ('fb', f_phase, f_mb, b_mb); no weight ops."""
    ops, nf, nb = [], [0, 0], [0, 0]

    def f(ph):
        ops.append(("f", ph, nf[ph]))
        nf[ph] += 1

    def b(ph):
        ops.append(("b", ph, nb[ph]))
        nb[ph] += 1

    def fb(fph):
        ops.append(("fb", fph, nf[fph], nb[1 - fph]))
        nf[fph] += 1
        nb[1 - fph] += 1

    for _ in range(2 * (P - r - 1)):
        f(0)
    for _ in range(r + 1):
        f(0), f(1)
    for _ in range(P - r - 1):
        b(1), f(1)
    for i in range(M - 2 * P + r + 1):
        if i == 0 and r == P - 1:
            f(0), b(1)
        else:
            fb(0)
        fb(1)
    for _ in range(P - r - 1):
        b(1), fb(1)
    for _ in range(r + 1):
        b(1), b(0)
    for _ in range(P - r - 1):
        b(0)
    return ops


def idle(P, M, F, B):
    ops = []
    for r in range(P):
        mine = []
        for op in schedule(P, r, M):
            if op[0] == "fb":  # its backward, then its forward
                mine += [("b", 1 - op[1], op[3]), ("f", op[1], op[2])]
            else:
                mine.append(op)
        ops.append(mine)
    done = {}

    def ready(kind, ph, r, mb):
        if kind == "f":
            if ph == 0:
                return 0 if r == 0 else done.get(("f", 0, r - 1, mb))
            return done.get(("f", 0, r, mb)) if r == P - 1 else done.get(("f", 1, r + 1, mb))
        if ph == 1:
            return done.get(("f", 1, r, mb)) if r == 0 else done.get(("b", 1, r - 1, mb))
        return done.get(("b", 1, r, mb)) if r == P - 1 else done.get(("b", 0, r + 1, mb))

    pos, free, busy = [0] * P, [0] * P, [0] * P
    moved = True
    while moved:
        moved = False
        for r in range(P):
            while pos[r] < len(ops[r]):
                kind, ph, mb = ops[r][pos[r]]
                t = ready(kind, ph, r, mb)
                if t is None:
                    break
                dur = F if kind == "f" else B
                free[r] = max(free[r], t) + dur
                busy[r] += dur
                done[(kind, ph, r, mb)] = free[r]
                pos[r] += 1
                moved = True
    assert all(pos[r] == len(ops[r]) for r in range(P)), "deadlock"
    return max(max(free) - x for x in busy)


def main():
    bad = 0
    for P in range(2, 17):
        for M in (2 * P, 2 * P + 3, 3 * P + 2):
            for F, B, want in ((1, 1, 2 * P - 2), (1, 2, 4 * P - 5), (1, 3, 6 * P - 7)):
                got = idle(P, M, F, B)
                if got != want:
                    print(f"P {P} M {M} F {F} B {B}: idle {got}, expected {want}")
                    bad += 1
    print("DualPipeV as fp8moe runs it: P 2-16, 3 micro-batch counts, 3 F:B ratios:",
          "all as expected" if not bad else f"{bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
