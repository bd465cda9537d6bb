"""Plan plots: the blocks along the model (strategy as colour, estimated time and memory per block, segments
shaded) and the profile table (time vs memory of every profiled combination, the chosen ones marked)."""
from __future__ import annotations

import os

from cfp.errors import ConfigError
from cfp.report.explain import PlanView


def plot_plan(view: PlanView, path: str) -> str:
    """Draw `view` to `path` (PNG); needs the plan's per-block estimates."""
    if not view.figures:
        raise ConfigError(f"plan {view.path!r} carries no per-block estimates to plot; save it with a newer "
                          f"`cfp search --plan-out`")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figs = view.figures
    notations = sorted({f.strategy for f in figs})
    cmap = plt.get_cmap("tab20", max(len(notations), 1))
    colour = {n: cmap(i) for i, n in enumerate(notations)}
    rows = 2 if view.profile else 1
    fig, axes = plt.subplots(rows, 1, figsize=(max(10.0, 0.45 * len(figs) + 7), 4.2 * rows), squeeze=False)
    ax = axes[0][0]
    x = list(range(len(figs)))
    ax.bar(x, [f.compute_s * 1e3 for f in figs], color=[colour[f.strategy] for f in figs], edgecolor="black",
           linewidth=0.4, label="compute")
    ax.bar(x, [f.comm_s * 1e3 for f in figs], bottom=[f.compute_s * 1e3 for f in figs],
           color=[colour[f.strategy] for f in figs], hatch="//", edgecolor="black", linewidth=0.4,
           label="communication (hatched)")
    for i, f in enumerate(figs):        # shade alternate segments
        if f.segment >= 0 and f.segment % 2:
            ax.axvspan(i - 0.5, i + 0.5, color="0.92", zorder=0)
    ax.set_xticks(x)
    ax.set_xticklabels([f.scope[-22:] for f in figs], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("estimated time per step (ms)")
    ax2 = ax.twinx()
    ax2.plot(x, [f.memory_bytes / 1e6 for f in figs], "k.-", label="memory (MB)")
    ax2.set_ylabel("estimated memory per device (MB)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[n]) for n in notations]
    ax.legend(handles, notations, fontsize=6, loc="upper left", bbox_to_anchor=(1.07, 1.0), title="strategy",
              title_fontsize=7)
    ax.set_title(f"{os.path.basename(view.path)}: blocks along the model (cost-model estimates, {view.gpu}; "
                 f"grey bands: odd segments)", fontsize=9)
    if view.profile:
        pa = axes[1][0]
        kinds = sorted({p["segment_kind"] for p in view.profile})
        for k in kinds:
            pts = [p for p in view.profile if p["segment_kind"] == k]
            pa.scatter([p["memory_bytes"] / 1e6 for p in pts], [p["time_s"] * 1e3 for p in pts], s=18,
                       label=f"segment kind {k}")
            ch = [p for p in pts if p["chosen"]]
            pa.scatter([p["memory_bytes"] / 1e6 for p in ch], [p["time_s"] * 1e3 for p in ch], s=160,
                       marker="*", edgecolor="black", facecolor="none")
        how = "measured" if any(p.get("measured") for p in view.profile) else "estimated"
        pa.set_xlabel("memory per device (MB, compiled)")
        pa.set_ylabel(f"time per run (ms, {how})")
        pa.set_title("profile table: every profiled combination (star: chosen)", fontsize=9)
        pa.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
