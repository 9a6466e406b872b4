"""PNG plots of a simulated comparison: TTFT and E2E CDFs, throughput, per-replica load."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _cdf(ax, runs, attr: str, title: str) -> None:
    for r in runs:
        v = np.sort(np.frombuffer(getattr(r.recorder, attr), dtype=np.float64))
        if v.size:
            ax.plot(v, np.arange(1, v.size + 1) / v.size, label=r.label)
    ax.set_xscale("log")
    ax.set_xlabel("seconds (log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def write_plots(runs, out_dir: str | Path, title: str = "") -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for attr, name, label in (("ttft", "ttft_cdf.png", "TTFT"), ("e2e", "e2e_cdf.png", "end-to-end latency")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _cdf(ax, runs, attr, f"{label} CDF {title}".strip())
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = [r.label for r in runs]
    axes[0].bar(labels, [r.result["throughput_rps"] for r in runs], color="tab:blue")
    axes[0].set_title("throughput (requests/s)")
    axes[1].bar(labels, [r.result["output_tps"] for r in runs], color="tab:green")
    axes[1].set_title("output tokens/s")
    for ax in axes:
        ax.tick_params(axis="x", rotation=40, labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)
    paths.append(out / "throughput.png")

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.2 * len(runs)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        rec = r.recorder
        t = np.frombuffer(rec.sample_t, dtype=np.float64)
        for rid, col in zip(rec.replica_ids, rec.sample_running):
            ax.plot(t, np.frombuffer(col, dtype=np.int32), lw=0.7, label=rid)
        ax.set_title(f"{r.label}: running requests per replica (CV {r.result['imbalance_cv']:.2f})", fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("simulated seconds")
    fig.tight_layout()
    fig.savefig(out / "replica_load.png", dpi=100)
    plt.close(fig)
    paths.append(out / "replica_load.png")
    return paths
