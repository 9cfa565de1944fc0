"""Loss curve from fp8moe's JSONL metrics: training loss and validation loss against the step,
the learning rate on a second axis. Usage: scripts/plot-metrics METRICS.jsonl OUT.png [TITLE]"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv):
    if len(argv) < 3:
        sys.exit("usage: scripts/plot-metrics METRICS.jsonl OUT.png [TITLE]")
    rows = []
    with open(argv[1]) as f:
        for n, line in enumerate(f, 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"{argv[1]}:{n}: not JSON: {e}")
    if not rows:
        sys.exit(f"{argv[1]}: no metrics")
    step = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(step, [r["loss"] for r in rows], label="train loss", color="tab:blue")
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.grid(alpha=0.3)
    lr = ax.twinx()
    lr.plot(step, [r["lr"] for r in rows], color="tab:gray", alpha=0.5, label="learning rate")
    lr.set_ylabel("learning rate")
    lines = ax.get_legend_handles_labels()
    lines2 = lr.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right")
    ax.set_title(argv[3] if len(argv) > 3 else argv[1])
    fig.tight_layout()
    fig.savefig(argv[2])
    print(f"{argv[2]}: {len(rows)} logged steps, final loss {rows[-1]['loss']:.4f}"
          + (f", final validation loss {val[-1][1]:.4f}" if val else ""))


if __name__ == "__main__":
    main(sys.argv)
