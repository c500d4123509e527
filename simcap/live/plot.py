"""Live vs simulated distributions: ECDFs of TTFT and ITL (``simcap live validate --plot``).

One figure, two panels (TTFT, ITL per stream chunk), x on a log axis in ms. Each panel shows
the pooled live samples of the repeats the comparison uses (solid), the pooled simulated
samples of the same traces (dashed), and every used repeat's live ECDF as a thin line, so the
run-to-run spread the prediction is judged against is visible. The legend gives medians and
the KS statistic. The format follows the file's suffix (matplotlib Agg, no display).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from simcap.errors import SimcapError
from simcap.studies.plots import check_figure_path

if TYPE_CHECKING:  # pragma: no cover
    from simcap.live.validate import Validation

LIVE_COLOR = "#3b78c2"
SIM_COLOR = "#ef8a17"


def _ecdf(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = np.sort(values)
    return x, np.arange(1, x.size + 1) / x.size


def plot_validation_ecdfs(result: "Validation", path: str | Path) -> Path:
    """Write the TTFT / ITL ECDF overlay of ``result`` to ``path``; returns the path."""
    from simcap.live.validate import samples

    path = check_figure_path(path, "--plot")
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    used = result.used
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for ax, name, label in zip(axes, ("ttft", "itl"), ("TTFT", "ITL (per stream chunk)")):
        live_runs = [samples(r.live.records)[name] * 1e3 for r in used]
        sim_runs = [samples(r.sim_records)[name] * 1e3 for r in used]
        live = np.concatenate(live_runs) if live_runs else np.empty(0)
        sim = np.concatenate(sim_runs) if sim_runs else np.empty(0)
        if len(used) > 1:
            for i, run in enumerate(live_runs):
                if run.size:
                    ax.step(*_ecdf(run), where="post", color=LIVE_COLOR, alpha=0.3, lw=0.8,
                            label="live, each repeat" if i == 0 else None)
        ks = result.ks.get(name, {}).get("statistic")
        for data, color, style, who in ((live, LIVE_COLOR, "-", "live"), (sim, SIM_COLOR, "--", "simulated")):
            if data.size:
                ax.step(*_ecdf(data), where="post", color=color, ls=style, lw=1.8,
                        label=f"{who} (n={data.size}, median {np.median(data):,.1f} ms)")
        positive = np.concatenate([live[live > 0], sim[sim > 0]])
        if positive.size and positive.max() > 5 * positive.min():
            ax.set_xscale("log")
        ax.set_xlabel(f"{label}, ms")
        ax.set_ylabel("fraction of samples <= x")
        ax.set_ylim(0, 1.02)
        ax.grid(True, which="major", alpha=0.3)
        title = label.split(" ")[0]
        ax.set_title(f"{title}: live vs simulated" + (f" (KS D = {ks:.3f})" if ks is not None else ""))
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{result.scenario.name or 'scenario'}: {len(used)} live repeat(s) and their simulated twins",
                 fontsize=10)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise SimcapError(f"--plot {path}: cannot write: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return path
