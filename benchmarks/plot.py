"""The benchmark as a picture: ``benchmarks/results.png`` from ``benchmarks/results.json``.

Left: flush wall time against the number of ids at a 0.2 s teardown, every peer, log scales, the
two floors drawn as a band. Right: 8 ids of which one hangs, seconds to return (capped peers
marked). Drawn by ``python -m benchmarks --plot`` after a run, or ``--replot`` from the saved run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOT_LATENCY = 0.2
FLOORS = ("http.client floor", "urllib3 floor")
STYLES = {  # peer: (colour, marker)
    "swe_flush_sync": ("#d62728", "o"),
    "requests-futures": ("#9467bd", "s"),
    "asyncio.gather": ("#1f77b4", "^"),
    "gather+Semaphore(16)": ("#17becf", "v"),
    "sequential requests": ("#7f7f7f", "x"),
    "one-by-one async": ("#8c564b", "D"),
}


def plot(data: dict[str, Any], out: Path) -> Path:
    """Draw ``data`` (the JSON a run saves) into the PNG ``out``; returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted((c for c in data["cells"] if c["latency"] == PLOT_LATENCY), key=lambda c: c["n"])
    ns = [c["n"] for c in cells]
    figure, (grid_axes, hang_axes) = plt.subplots(1, 2, figsize=(12, 5.2), gridspec_kw={"width_ratios": [2.4, 1]})

    low = [min(c["median"][f] for f in FLOORS) * 1000 for c in cells]
    high = [max(c["median"][f] for f in FLOORS) * 1000 for c in cells]
    grid_axes.fill_between(ns, low, high, color="#2ca02c", alpha=0.25, label="floors (raw http.client .. bare urllib3)")
    grid_axes.plot(ns, [PLOT_LATENCY * 1000] * len(ns), color="#2ca02c", linestyle=":", linewidth=1,
                   label="one teardown (the least possible)")
    for peer, (colour, marker) in STYLES.items():
        points = [(c["n"], c["median"][peer] * 1000) for c in cells if peer in c["median"]]
        if points:
            xs, ys = zip(*points, strict=True)
            bold = peer == "swe_flush_sync"
            grid_axes.plot(xs, ys, color=colour, marker=marker, linewidth=2.6 if bold else 1.2,
                           label=peer, zorder=3 if bold else 2)
    grid_axes.set_xscale("log", base=2)
    grid_axes.set_yscale("log")
    grid_axes.set_xticks(ns, [str(n) for n in ns])
    grid_axes.set_xlabel("session-server instances flushed (ids)")
    grid_axes.set_ylabel("wall time of one flush (ms, log)")
    grid_axes.set_title(f"Flush wall time, {PLOT_LATENCY:g} s teardown per flush")
    grid_axes.grid(True, which="both", alpha=0.3)
    grid_axes.legend(fontsize=8, loc="upper left")

    hang = next(row for row in data["faults"] if row["fault"] == "hang")
    peers = [p for p in (*STYLES, *FLOORS) if p in hang["median"]]
    seconds = [hang["median"][p] for p in peers]
    colours = [STYLES.get(p, ("#2ca02c", ""))[0] for p in peers]
    bars = hang_axes.barh(peers, seconds, color=colours)
    for bar, peer in zip(bars, peers, strict=True):
        capped = hang["capped"][peer]
        if capped:
            bar.set_hatch("//")
        label = f"> {hang['cap']:g} s, capped" if capped else f"{hang['median'][peer]:.2f} s"
        hang_axes.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + label, va="center", fontsize=8)
    hang_axes.set_xlim(0, hang["cap"] * 1.6)
    hang_axes.set_xlabel("seconds to return")
    hang_axes.set_title("8 ids, one server hangs\n(swe_flush_sync: deadline 2 s)")
    hang_axes.invert_yaxis()
    figure.suptitle(f"swe_flush_sync benchmark ({data.get('machine', '')})", fontsize=10)
    figure.tight_layout()
    figure.savefig(out, dpi=130)
    plt.close(figure)
    return out
