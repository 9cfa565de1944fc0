"""Loss curves from fp8moe's JSONL metrics: training loss (and the multi-token prediction loss,
dashed, where the run has one) and validation loss against the step, the learning rate on a second
axis. Several runs side by side: their files separated by commas, each labelled by its file name.
Usage: scripts/plot-metrics METRICS.jsonl[,MORE.jsonl...] OUT.png [TITLE]"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{n}: not JSON: {e}")
    if not rows:
        sys.exit(f"{path}: no metrics")
    return rows


def main(argv):
    if len(argv) < 3:
        sys.exit("usage: scripts/plot-metrics METRICS.jsonl[,MORE.jsonl...] OUT.png [TITLE]")
    paths = argv[1].split(",")
    runs = [(os.path.splitext(os.path.basename(p))[0], read(p)) for p in paths]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    colors = ["tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:olive"]
    summary = []
    for i, (name, rows) in enumerate(runs):
        c = colors[i % len(colors)]
        prefix = f"{name}: " if len(runs) > 1 else ""
        step = [r["step"] for r in rows]
        ax.plot(step, [r["loss"] for r in rows], label=prefix + "train loss", color=c)
        mtp = [(r["step"], r["mtp_loss"]) for r in rows if r.get("mtp_loss") is not None]
        if mtp:
            ax.plot(*zip(*mtp), "--", label=prefix + "MTP loss", color=c, alpha=0.6)
        val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        if val:
            ax.plot(*zip(*val), "o-", label=prefix + "validation loss", color=c if len(runs) > 1 else "tab:orange",
                    markersize=3, alpha=0.8 if len(runs) > 1 else 1.0)
        summary.append(f"{prefix}{len(rows)} logged steps, final loss {rows[-1]['loss']:.4f}"
                       + (f", final validation loss {val[-1][1]:.4f}" if val else ""))
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.grid(alpha=0.3)
    lr = ax.twinx()
    first = runs[0][1]
    lr.plot([r["step"] for r in first], [r["lr"] for r in first], color="tab:gray", alpha=0.5, label="learning rate")
    lr.set_ylabel("learning rate")
    lines = ax.get_legend_handles_labels()
    lines2 = lr.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize="small")
    ax.set_title(argv[3] if len(argv) > 3 else ", ".join(paths))
    fig.tight_layout()
    fig.savefig(argv[2])
    print(f"{argv[2]}: " + "; ".join(summary))


if __name__ == "__main__":
    main(sys.argv)
