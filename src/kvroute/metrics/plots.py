"""PNG plots of a simulated comparison, each one answering a question a reader will ask.

* ``ttft_cdf.png`` / ``e2e_cdf.png``: latency distributions, with p50 and p99 marked per policy;
* ``throughput.png``: requests/s offered, served and within the SLO (goodput), per policy;
* ``load_over_time.png``: offered vs served requests over time and the LB queue length — a
  growing gap is an overloaded run, whatever its averages say;
* ``replica_load.png``: running requests per replica, coloured by region and labelled;
* ``sweep_goodput.png`` (``--sweep``): goodput vs offered load per policy, SLO and stability knees marked.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

REGION_CMAPS = ("Blues", "Oranges", "Greens", "Purples", "Reds", "Greys")


def _cdf(ax, runs, attr: str, title: str) -> None:
    for r in runs:
        v = np.sort(np.frombuffer(getattr(r.recorder, attr), dtype=np.float64))
        if not v.size:
            continue
        (line,) = ax.plot(v, np.arange(1, v.size + 1) / v.size, label=r.label)
        for q, marker in ((0.5, "o"), (0.99, "^")):
            x = float(np.quantile(v, q))
            ax.plot([x], [q], marker, color=line.get_color(), ms=5)
    ax.axhline(0.5, color="grey", lw=0.5, ls=":")
    ax.axhline(0.99, color="grey", lw=0.5, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("seconds (log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{title}  (● p50, ▲ p99)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _save(fig, path: Path, dpi: int = 110) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _region_colours(regions: list[str]) -> list:
    order = list(dict.fromkeys(regions))
    counts = {r: regions.count(r) for r in order}
    seen = {r: 0 for r in order}
    colours = []
    for r in regions:
        cmap = plt.get_cmap(REGION_CMAPS[order.index(r) % len(REGION_CMAPS)])
        seen[r] += 1
        colours.append(cmap(0.45 + 0.5 * seen[r] / (counts[r] + 1)))
    return colours


def write_plots(runs, out_dir: str | Path, title: str = "") -> list[Path]:
    """Write the PNGs listed in this module's docstring for ``runs`` into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for attr, name, label in (("ttft", "ttft_cdf.png", "time to first token"),
                              ("e2e", "e2e_cdf.png", "end-to-end latency")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _cdf(ax, runs, attr, f"{label} {title}".strip())
        paths.append(_save(fig, out / name))

    labels = [r.label for r in runs]
    x = np.arange(len(runs))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(runs)), 4))
    offered = [r.result.get("load", {}).get("offered_rps", 0.0) for r in runs]
    served = [r.result.get("load", {}).get("served_rps", 0.0) for r in runs]
    good = [r.result.get("slo", {}).get("goodput_rps", 0.0) for r in runs]
    for i, (vals, name, colour) in enumerate(((offered, "offered", "tab:grey"), (served, "served", "tab:blue"),
                                              (good, "within SLO (goodput)", "tab:green"))):
        ax.bar(x + (i - 1) * 0.27, vals, 0.27, label=name, color=colour)
    for i, r in enumerate(runs):
        if not r.result.get("load", {}).get("stable", True):
            ax.annotate("UNSTABLE", (i, max(offered[i], served[i])), ha="center", va="bottom", color="red", fontsize=8)
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("requests / s")
    ax.set_title("offered, served and goodput per policy")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    paths.append(_save(fig, out / "throughput.png"))

    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for r in runs:
        rec = r.recorder
        t = np.frombuffer(rec.sample_t, dtype=np.float64)
        if not t.size:
            continue
        (line,) = axes[0].plot(t, np.frombuffer(rec.sample_issued, dtype=np.int32), ls="--", lw=0.8)
        axes[0].plot(t, np.frombuffer(rec.sample_served, dtype=np.int32), color=line.get_color(),
                     lw=1.2, label=r.label)
        axes[1].plot(t, np.frombuffer(rec.sample_lb_queue, dtype=np.int32), color=line.get_color(),
                     lw=1.0, label=r.label)
    axes[0].set_ylabel("requests (cumulative)")
    axes[0].set_title("offered (dashed) vs served (solid): a widening gap is a growing backlog")
    axes[1].set_ylabel("requests held in LB queues")
    axes[1].set_xlabel("simulated seconds")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    paths.append(_save(fig, out / "load_over_time.png"))

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.4 * len(runs)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        rec = r.recorder
        t = np.frombuffer(rec.sample_t, dtype=np.float64)
        colours = _region_colours(rec.replica_regions)
        for rid, region, col, colour in zip(rec.replica_ids, rec.replica_regions, rec.sample_running, colours):
            ax.plot(t, np.frombuffer(col, dtype=np.int32), lw=0.8, color=colour, label=f"{rid} ({region})")
        ax.set_title(f"{r.label}: running requests per replica, coloured by region "
                     f"(imbalance CV {r.result['imbalance_cv']:.2f})", fontsize=9)
        ax.set_ylabel("running (req)")
        ax.grid(alpha=0.3)
        if len(rec.replica_ids) <= 16:
            ax.legend(fontsize=6, ncol=4, loc="upper right")
    axes[-1, 0].set_xlabel("simulated seconds")
    paths.append(_save(fig, out / "replica_load.png", dpi=100))
    return paths


def write_sweep_plot(sweep: dict, out_dir: str | Path, title: str = "") -> Path:
    """Goodput vs offered load per policy, with each policy's SLO and stability knees marked."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, knee in sweep["knees"].items():
        pts = knee["points"]
        if not pts:
            continue
        xs = [p["offered_rps"] for p in pts]
        (line,) = ax.plot(xs, [p["goodput_rps"] for p in pts], marker="o", ms=3, label=f"{label} goodput")
        ax.plot(xs, [p["served_rps"] for p in pts], color=line.get_color(), ls="--", lw=0.8, alpha=0.6,
                label=f"{label} served")
        if knee["slo"]["offered_rps"]:
            ax.axvline(knee["slo"]["offered_rps"], color=line.get_color(), ls=":", lw=0.8)
        if knee["stability"]["offered_rps"]:
            ax.axvline(knee["stability"]["offered_rps"], color=line.get_color(), ls="-.", lw=0.8)
    offered = [p["offered_rps"] for k in sweep["knees"].values() for p in k["points"] if p["offered_rps"] > 0]
    lo, lim = min(offered, default=0.0), max(offered, default=1.0)
    if lo > 0 and lim / lo > 20:  # a search that halved many times: a log axis keeps the light runs apart
        ax.set_xscale("log")
    else:
        lo = 0.0
    ax.plot([lo, lim], [lo, lim], color="grey", lw=0.6, ls=":", label="= offered")
    top = max((p["served_rps"] for k in sweep["knees"].values() for p in k["points"]), default=0.0)
    if 0 < top < lim / 2:  # served plateaus far below the heaviest load tried: show the plateau
        ax.set_ylim(0, top * 1.4)
    slo = sweep["slo"]
    ax.set_xlabel("offered load (requests / s)")
    ax.set_ylabel("goodput within SLO (solid), served (dashed) (req/s)")
    ax.set_title(f"goodput vs offered load {title}\nknees: stability (dash-dot), SLO (dotted) = "
                 f"{slo['target']:.0%} within TTFT ≤ {slo['ttft_s']:g} s, TPOT ≤ {slo['tpot_s'] * 1000:g} ms",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out / "sweep_goodput.png")
