"""A chart a person can read at a glance: GB/s per method, one panel per condition, limits drawn in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["plot"]


def plot(doc: dict[str, Any] | str | Path, out: str | Path) -> Path:
    """Render ``results.json`` (or its parsed dict) to a PNG; needs matplotlib (``pip install matplotlib``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not isinstance(doc, dict):
        doc = json.loads(Path(doc).read_text())
    conditions = [c for c in doc["config"]["conditions"] if any(r["condition"] == c for r in doc["summary"])]
    fig, axes = plt.subplots(
        len(conditions), 1, figsize=(10, 2.2 + 0.45 * len(doc["config"]["methods"]) * len(conditions)), squeeze=False
    )
    for ax, cond in zip(axes[:, 0], conditions):
        rows = sorted(
            (r for r in doc["summary"] if r["condition"] == cond and "median_gbps" in r), key=lambda r: r["median_gbps"]
        )
        # A method with failed runs says how many of its runs the median is of.
        names = [
            r["method"] + (f" ({r['runs_ok']} ok, {r['runs_failed']} failed)" if r.get("runs_failed") else "")
            for r in rows
        ]
        med = [r["median_gbps"] for r in rows]
        err = [[m - r["min_gbps"] for m, r in zip(med, rows)], [r["max_gbps"] - m for m, r in zip(med, rows)]]
        colors = ["#2b7bba" if r["method"].startswith("gdsload") else "#999999" for r in rows]
        ax.barh(names, med, xerr=err, color=colors, capsize=3)
        for y, m in enumerate(med):
            ax.text(m, y, f" {m:.1f}", va="center", fontsize=8)
        limits = doc["limits"]
        raw = limits.get(f"raw_read_gbps.{cond}")
        if raw:
            ax.axvline(raw, color="#d62728", ls="--", lw=1, label=f"raw parallel read {raw:.1f}")
        if limits.get("h2d_gbps"):
            ax.axvline(limits["h2d_gbps"], color="#2ca02c", ls=":", lw=1, label=f"pinned H2D {limits['h2d_gbps']:.1f}")
        ax.set_title(
            f"{cond}: GB/s of logical bytes into {doc['config']['device']} (median of "
            f"{doc['config']['repeat']}, bars min-max)",
            fontsize=10,
        )
        ax.legend(fontsize=8, loc="lower right")
        ax.tick_params(axis="y", labelsize=8)
    facts = doc["facts"]
    fig.suptitle(f"gdsload cold-start bench — {facts.get('gpu', 'cpu')} — {facts['date']}", fontsize=11)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
