"""Teaching views of a simulation (PNG via matplotlib's Agg backend, no display needed).

- :func:`plot_step_timeline`: a short window of engine steps. Each step is a bar as wide as
  it lasted, stacked decode tokens under prefill-chunk tokens; below it, every request in
  the window as a row of dots, one dot per token chunk it received. A step that computes a
  long prefill chunk is a wide bar, and every decoding request's row shows a gap under it:
  the decode stall that chunked prefill puts into the inter-token latency.
- :func:`plot_itl_histogram`: the per-step ITL (one gap per stream chunk, as the field
  measures it) on a log axis; two peaks when prefill chunks stall decodes.
- :func:`plot_kv_queue`: KV-cache usage and running / waiting requests over time.
- :func:`plot_sessions` (session workloads): prompt tokens over time, split into prefix-cache
  hits and prefill actually computed, beside TTFT by turn index: later turns resend more
  context, and the cache decides how much of it a step computes again.
- :func:`plot_capacity`: SLO metrics against the measured arrival rate, with the SLO line
  and the safe and saturation rates.

``write_simulation_plots(result, out_dir)`` writes the first three, and the sessions view for a
session workload (``simcap simulate --plot``).
``check_figure_path`` refuses, before any work, a figure path that cannot be written.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from simcap.errors import SimcapError

if TYPE_CHECKING:  # pragma: no cover
    from simcap.simulation.simulator import Result
    from simcap.studies.capacity import CapacityResult

DECODE_COLOR = "#3b78c2"
PREFILL_COLOR = "#ef8a17"
STALL_COLOR = "#d62728"
OK_COLOR = "#2ca02c"
ITL_BANDS = (0.1, 1.5)  # the field's bands: < 100 ms, 100-1,500 ms, > 1,500 ms


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


# Formats matplotlib's Agg canvas writes, chosen by the file's suffix (a test holds them to
# matplotlib's own list; asking matplotlib would import it before any work is done).
IMAGE_FORMATS = (
    ".png", ".pdf", ".svg", ".svgz", ".eps", ".ps", ".jpg", ".jpeg", ".tif", ".tiff", ".webp",
)


def check_figure_path(path: str | Path, option: str, *, directory: bool = False) -> Path:
    """``path`` if a figure (or, with ``directory``, a folder of PNGs) can be written there:
    a known image suffix (IMAGE_FORMATS), not an existing folder (or file), and no regular
    file where a parent folder must be. Else a one-line SimcapError naming ``option``."""
    path = Path(path)
    if directory:
        if path.exists() and not path.is_dir():
            raise SimcapError(f"{option} {path}: is a file; give a directory for the figures")
    else:
        if path.is_dir():
            raise SimcapError(f"{option} {path}: is a directory; give a file name")
        if path.suffix.lower() not in IMAGE_FORMATS:
            raise SimcapError(
                f"{option} {path}: unknown image format {path.suffix or '(no suffix)'}; "
                f"allowed: {', '.join(IMAGE_FORMATS)}"
            )
    for parent in path.parents:  # the nearest existing ancestor must be a folder
        if parent.exists():
            if not parent.is_dir():
                raise SimcapError(f"{option} {path}: {parent} is a file, not a directory")
            break
    return path


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    except (OSError, ValueError) as exc:  # ValueError: a format matplotlib does not write
        why = getattr(exc, "strerror", None) or exc
        raise SimcapError(f"{path}: cannot write the figure: {why}") from None
    finally:
        _plt().close(fig)
    return path


def _ms_label(y: float, _pos: Any = None) -> str:
    return f"{y * 1e3:,.4g} ms" if y < 1 else f"{y:,.4g} s"


def _title(result: "Result") -> str:
    s = result.scenario
    name = s.name or "scenario"
    return (
        f"{name}: max_num_batched_tokens {s.engine.max_num_batched_tokens:,}, "
        f"max_num_seqs {s.engine.max_num_seqs}"
    )


# --------------------------------------------------------------------------- ITL


def itl_by_step_kind(result: "Result") -> tuple[np.ndarray, np.ndarray]:
    """Per-step ITLs and, for each, whether the engine step that ended it computed prefill.

    A chunk reaches the client at the end of the step that produced it, so each gap is
    matched to the step ending at the gap's later chunk.
    """
    st = result.steps.as_arrays()
    ends = st["start"] + st["duration"]
    pre = st["num_prefill_tokens"] > 0
    itls, kinds = [], []
    for r in result.records:
        if not r.succeeded or len(r.chunk_times) < 2:
            continue
        times = np.asarray(r.chunk_times, dtype=float)
        itls.append(np.diff(times))
        if ends.size:
            idx = np.clip(np.searchsorted(ends, times[1:] - 1e-9), 0, ends.size - 1)
            kinds.append(pre[idx] & (np.abs(ends[idx] - times[1:]) < 1e-6))
        else:
            kinds.append(np.zeros(times.size - 1, dtype=bool))
    if not itls:
        return np.zeros(0), np.zeros(0, dtype=bool)
    return np.concatenate(itls), np.concatenate(kinds)


def itl_stats(itl: np.ndarray, bands: tuple[float, float] = ITL_BANDS) -> dict[str, float | int | None]:
    """Median, and the fractions below / between / above the two band edges (seconds)."""
    itl = np.asarray(itl, dtype=float)
    n = int(itl.size)
    if n == 0:
        return {"count": 0, "median_s": None, "frac_below": None, "frac_between": None,
                "frac_above": None}
    lo, hi = bands
    return {
        "count": n,
        "median_s": float(np.median(itl)),
        "frac_below": float(np.mean(itl <= lo)),
        "frac_between": float(np.mean((itl > lo) & (itl <= hi))),
        "frac_above": float(np.mean(itl > hi)),
    }


def plot_itl_histogram(
    series: "Result | Mapping[str, Result | np.ndarray]",
    path: str | Path,
    *,
    title: str | None = None,
    bands: tuple[float, float] = ITL_BANDS,
    reference: Mapping[str, Mapping[str, float]] | None = None,
) -> Path:
    """Histogram(s) of per-step ITL on a log axis, one panel per series, shared bins.

    ``series``: a Result, or ``{label: Result or ITL samples in s}``. With Results, each ITL
    is coloured by whether the step that ended it computed a prefill chunk. ``reference``:
    published figures per label (``median_s``, ``frac_between``, ``frac_above``).
    """
    plt = _plt()
    if not isinstance(series, Mapping):
        title = title or f"Inter-token latency per step -- {_title(series)}"
        series = {"simulated": series}
    data: dict[str, np.ndarray] = {}
    kinds: dict[str, np.ndarray | None] = {}
    for label, value in series.items():
        if isinstance(value, np.ndarray) or isinstance(value, (list, tuple)):
            data[label], kinds[label] = np.asarray(value, dtype=float), None
        else:
            data[label], kinds[label] = itl_by_step_kind(value)
    positive = np.concatenate([v[v > 0] for v in data.values()] or [np.zeros(0)])
    lo_edge = max(float(positive.min()) * 0.8, 1e-4) if positive.size else 1e-3
    hi_edge = float(positive.max()) * 1.25 if positive.size else 1.0
    hi_edge = max(hi_edge, bands[1] * 2, lo_edge * 10)
    bins = np.geomspace(lo_edge, hi_edge, 70)
    n = len(data)
    fig, axes = plt.subplots(n, 1, figsize=(10, 2.2 + 2.6 * n), sharex=True, squeeze=False)
    for ax, (label, itl) in zip(axes[:, 0], data.items()):
        st = itl_stats(itl, bands)
        ref = (reference or {}).get(label) or {}
        kind = kinds[label]
        if itl.size and kind is None:
            ax.hist(np.clip(itl, lo_edge, hi_edge), bins=bins,
                    weights=np.full(itl.size, 100.0 / itl.size),
                    color=DECODE_COLOR, edgecolor="white", linewidth=0.3)
        elif itl.size:
            clipped = np.clip(itl, lo_edge, hi_edge)
            ax.hist([clipped[~kind], clipped[kind]], bins=bins, stacked=True,
                    weights=[np.full(int((~kind).sum()), 100.0 / itl.size),
                             np.full(int(kind.sum()), 100.0 / itl.size)],
                    color=[DECODE_COLOR, PREFILL_COLOR], edgecolor="white", linewidth=0.3,
                    label=["the step was decode only",
                           "the step also computed a prefill chunk"])
            if ax is axes[0, 0]:
                ax.legend(loc="upper center", bbox_to_anchor=(0.38, 0.78), fontsize=8,
                          framealpha=0.95)
        ax.axvspan(bands[0], bands[1], color="#bbbbbb", alpha=0.22, lw=0)
        ax.axvspan(bands[1], hi_edge, color=STALL_COLOR, alpha=0.08, lw=0)
        for edge in bands:
            ax.axvline(edge, color="#777777", lw=0.8, ls=":")
        head = f"{label}: {st['count']:,} ITLs"
        if st["median_s"] is not None:
            ax.axvline(st["median_s"], color="black", lw=1.2, ls="--", ymax=0.66)
            head += f", median {st['median_s'] * 1e3:,.1f} ms (dashed)"
        if ref.get("median_s") is not None:
            head += f"; published median {ref['median_s'] * 1e3:,.1f} ms"
        ax.set_title(head, fontsize=10, loc="left")
        ax.set_xscale("log")
        ax.set_xlim(lo_edge, hi_edge)
        ax.set_ylabel("% of ITLs")
        top = ax.get_ylim()[1]
        ax.set_ylim(0, top * 1.45)
        lo_ms, hi_ms = bands[0] * 1e3, bands[1] * 1e3
        regions = [
            (np.sqrt(lo_edge * bands[0]), f"<= {lo_ms:,.0f} ms", st["frac_below"],
             None, "#333333"),
            (np.sqrt(bands[0] * bands[1]), f"{lo_ms:,.0f}-{hi_ms:,.0f} ms", st["frac_between"],
             ref.get("frac_between"), "#333333"),
            (np.sqrt(bands[1] * hi_edge), f"> {hi_ms:,.0f} ms",
             st["frac_above"], ref.get("frac_above"), STALL_COLOR),
        ]
        for xpos, name, frac, pub, color in regions:
            if frac is None:
                continue
            text = f"{name}\n{frac * 100:.1f}%"
            if pub is not None:
                text += f"\n(published {pub * 100:.1f}%)"
            ax.text(xpos, top * 1.40, text, ha="center", va="top", fontsize=9, color=color,
                    fontweight="bold")
    axes[-1, 0].set_xlabel("inter-token latency per stream chunk (s, log scale)")
    axes[-1, 0].xaxis.set_major_formatter(plt.FuncFormatter(_ms_label))
    fig.suptitle(title or "Inter-token latency per step", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------- step timeline


def _decode_only_median(st: dict[str, np.ndarray]) -> float:
    """Median duration of steps that computed no prefill (all steps when there are none)."""
    dur = st["duration"]
    if dur.size == 0:
        return 0.0
    pure = dur[(st["num_prefill_tokens"] == 0) & (st["num_decode_tokens"] > 0)]
    return float(np.median(pure if pure.size else dur))


def pick_window(result: "Result", span: float | None = None) -> tuple[float, float]:
    """A window worth looking at: around the longest step that mixed prefill into decodes.

    Without such a step, the busiest stretch. ``span`` in seconds; default enough to show
    a few long steps and the short ones between them.
    """
    st = result.steps.as_arrays()
    start, dur = st["start"], st["duration"]
    if start.size == 0:
        return 0.0, 1.0
    end_all = float(start[-1] + dur[-1])
    mixed = (st["num_prefill_tokens"] > 0) & (st["num_decode_tokens"] > 0)
    candidates = np.flatnonzero(mixed) if mixed.any() else np.arange(start.size)
    # Prefer the middle of the run: skip the fill-up and the drain.
    mid = candidates[(start[candidates] > 0.2 * end_all) & (start[candidates] < 0.8 * end_all)]
    if mid.size:
        candidates = mid
    i = int(candidates[np.argmax(dur[candidates])])
    med = float(np.median(dur))
    if span is None:
        span = max(4.5 * float(dur[i]), 60.0 * _decode_only_median(st), 12.0 * med)
    t0 = max(0.0, float(start[i]) - span / 3.0)
    t1 = min(end_all, t0 + span)
    return max(0.0, t1 - span), t1


def plot_step_timeline(
    result: "Result",
    path: str | Path,
    *,
    window: tuple[float, float] | None = None,
    max_requests: int = 28,
    stall_factor: float = 4.0,
) -> Path:
    """Engine steps in a window (bars as wide as each step) over the requests' token chunks.

    A step that computes prefill and lasts over ``stall_factor`` x the median decode-only step
    is shaded as a stall across both panels.
    """
    plt = _plt()
    from matplotlib.patches import Patch
    from matplotlib.lines import Line2D

    t0, t1 = window or pick_window(result)
    st = result.steps.as_arrays()
    start, dur = st["start"], st["duration"]
    pre, dec = st["num_prefill_tokens"], st["num_decode_tokens"]
    sel = (start + dur > t0) & (start < t1)
    med = _decode_only_median(st)
    stall = sel & (pre > 0) & (dec > 0) & (dur > stall_factor * med)

    fig, (ax1, ax2) = plt.subplots(
        2, 1, figsize=(12, 8), sharex=True, gridspec_kw={"height_ratios": [1.0, 1.5]}
    )
    # Panel 1: tokens per step, bar width = step duration.
    x, w = start[sel], dur[sel]
    ax1.bar(x, dec[sel], width=w, align="edge", color=DECODE_COLOR, edgecolor="white",
            linewidth=0.4, label="decode tokens (1 + drafts per decoding request)")
    ax1.bar(x, pre[sel], width=w, bottom=dec[sel], align="edge", color=PREFILL_COLOR,
            edgecolor="white", linewidth=0.4, label="prefill-chunk tokens")
    ax1.set_yscale("symlog", linthresh=10)
    ax1.set_ylim(0, max(10.0, float((pre[sel] + dec[sel]).max()) * 3) if sel.any() else 10)
    ax1.set_ylabel("tokens computed in the step\n(symlog scale)")
    ax1.legend(loc="upper left", fontsize=8, ncol=2, framealpha=0.9)
    for j in np.flatnonzero(stall):
        for ax in (ax1, ax2):
            ax.axvspan(start[j], start[j] + dur[j], color=STALL_COLOR, alpha=0.10, lw=0)
            if j + 1 < start.size and stall[j + 1]:  # a thin gap marks where one ends
                ax.axvline(start[j] + dur[j], color="white", lw=0.8)
    whole = stall & (start >= t0) & (start + dur <= t1)  # stalls fully inside the window
    pick = whole if whole.any() else stall
    if stall.any():
        j = int(np.flatnonzero(pick)[np.argmax(dur[pick])])
        ax1.annotate(
            f"one step: {pre[j]:,} prefill tokens + {dec[j]} decode tokens\n"
            f"lasts {dur[j]:.2f} s = {dur[j] / med:.0f}x a decode-only step ({med * 1e3:.0f} ms):\n"
            "every decoding request waits for it",
            xy=(start[j] + dur[j] / 2, pre[j] + dec[j]), xytext=(0.99, 0.97),
            textcoords="axes fraction", ha="right", va="top", fontsize=9,
            bbox=dict(boxstyle="round", fc="white", ec=STALL_COLOR),
            arrowprops=dict(arrowstyle="->", color=STALL_COLOR),
        )

    # Panel 2: one row per request active in the window; a dot per token chunk received.
    recs = [
        r for r in result.records
        if r.arrival_time < t1 and (r.finish_time is None or r.finish_time > t0)
    ]
    recs.sort(key=lambda r: (r.first_token_time if r.first_token_time is not None else np.inf,
                             r.request_id))
    if len(recs) > max_requests:  # keep those decoding in the middle of the window first
        mid = (t0 + t1) / 2
        decoding = [r for r in recs if (r.first_token_time or np.inf) < mid]
        rest = [r for r in recs if r not in decoding]
        recs = (decoding[-max_requests:] + rest)[:max_requests]
        recs.sort(key=lambda r: (r.first_token_time or np.inf, r.request_id))
    for row, r in enumerate(recs):
        first = r.first_token_time
        end = r.finish_time if r.finish_time is not None else t1
        wait_end = first if first is not None else end
        ax2.plot([max(r.arrival_time, t0), min(wait_end, t1)], [row, row], color="#bbbbbb",
                 lw=3, solid_capstyle="butt", zorder=1)
        if first is not None:
            ax2.plot([max(first, t0), min(end, t1)], [row, row], color=DECODE_COLOR, lw=0.6,
                     alpha=0.5, zorder=1)
            times = np.asarray(r.chunk_times)
            keep = (times >= t0) & (times <= t1)
            ax2.scatter(times[keep][1:] if keep[0] else times[keep], np.full(
                keep.sum() - (1 if keep[0] else 0), row), s=9, color=DECODE_COLOR, zorder=2)
            if t0 <= first <= t1:
                ax2.scatter([first], [row], s=60, marker="*", color=PREFILL_COLOR,
                            edgecolor="black", linewidth=0.4, zorder=3)
        if r.finish_time is not None and t0 <= r.finish_time <= t1:
            ax2.scatter([r.finish_time], [row], s=25, marker="|", color="black", zorder=3)
    if stall.any():  # show one ITL that spans the longest stall
        j = int(np.flatnonzero(pick)[np.argmax(dur[pick])])
        s0, s1 = start[j], start[j] + dur[j]
        for row, r in enumerate(recs):
            times = np.asarray(r.chunk_times)
            after = np.flatnonzero(np.abs(times - s1) < 1e-6)
            if after.size and after[0] > 0 and times[after[0] - 1] <= s0 + 1e-9:
                a, b = times[after[0] - 1], times[after[0]]
                ax2.annotate("", xy=(b, row - 0.45), xytext=(a, row - 0.45),
                             arrowprops=dict(arrowstyle="<->", color=STALL_COLOR, lw=1.5))
                ax2.text((a + b) / 2, row - 0.6, f"ITL {b - a:.2f} s", ha="center",
                         va="bottom", fontsize=9, color=STALL_COLOR, fontweight="bold",
                         bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8))
                break
    ax2.set_ylim(-2.0, max(len(recs), 1))
    ax2.invert_yaxis()
    ax2.set_ylabel("requests (by first token)")
    ax2.set_yticks([])
    ax2.set_xlabel("simulated time (s)")
    ax2.set_xlim(t0, t1)
    handles = [
        Line2D([], [], color="#bbbbbb", lw=3, label="waiting for the first token (queue + prefill)"),
        Line2D([], [], marker="*", color=PREFILL_COLOR, markeredgecolor="black", ls="",
               markersize=9, label="first token"),
        Line2D([], [], marker="o", color=DECODE_COLOR, ls="", markersize=4,
               label="a token chunk reaches the client (gap = ITL)"),
        Patch(color=STALL_COLOR, alpha=0.2, label="decode stall: a long prefill step"),
    ]
    ax2.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4,
               fontsize=8, framealpha=0.95)
    if stall.any():
        inside = np.minimum(start[stall] + dur[stall], t1) - np.maximum(start[stall], t0)
        frac = float(inside.sum() / max(t1 - t0, 1e-12))
        fig.suptitle(
            f"Engine steps, {t0:,.1f}-{t1:,.1f} s -- {_title(result)}\n"
            f"steps carrying prefill chunks take {frac * 100:.0f}% of this window; "
            "a decoding request gets no token until the step ends", fontsize=11,
        )
    else:
        fig.suptitle(f"Engine steps, {t0:,.1f}-{t1:,.1f} s -- {_title(result)}", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------- KV and queue


def plot_kv_queue(result: "Result", path: str | Path) -> Path:
    """KV-cache usage, and running / waiting requests, over the whole run."""
    plt = _plt()
    st = result.steps.as_arrays()
    t = st["start"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    ax1.step(t, st["kv_cache_usage"] * 100, where="post", color="#6a3d9a", lw=1)
    ax1.set_ylabel("KV cache usage (%)")
    ax1.set_ylim(0, 105)
    pre = np.flatnonzero(st["num_preempted"] > 0)
    if pre.size:
        ax1.scatter(t[pre], st["kv_cache_usage"][pre] * 100, marker="v", color=STALL_COLOR,
                    s=20, label=f"preemptions ({int(st['num_preempted'].sum()):,})", zorder=3)
        ax1.legend(loc="lower right", fontsize=8)
    ax2.step(t, st["num_running"], where="post", color=DECODE_COLOR, lw=1, label="running")
    ax2.step(t, st["num_waiting"], where="post", color=PREFILL_COLOR, lw=1, label="waiting")
    ax2.axhline(result.scenario.engine.max_num_seqs, color="#777777", ls=":", lw=0.8,
                label=f"max_num_seqs {result.scenario.engine.max_num_seqs}")
    ax2.set_ylabel("requests")
    ax2.set_xlabel("simulated time (s)")
    ax2.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"KV cache and queue -- {_title(result)}", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------- sessions

HIT_COLOR = "#7fbf7b"


def session_token_series(result: "Result", bins: int = 60) -> dict[str, np.ndarray]:
    """Prompt tokens over time in ``bins`` equal windows of the run: ``hit`` (prefix-cache
    hits, counted when the request is first scheduled, as vLLM counts them) and ``computed``
    (prompt tokens the engine's steps computed, at each step's start), in tokens per second;
    ``edges`` the windows' bounds. Needs the run's records and step rows."""
    if result.records is None or not result.steps.keep or len(result.steps) == 0:
        raise SimcapError("session plot: the run kept no records and steps (simulate with records and steps)")
    st = result.steps.as_arrays()
    end = float(st["start"][-1] + st["duration"][-1])
    edges = np.linspace(0.0, end if end > 0 else 1.0, bins + 1)
    width = edges[1] - edges[0]
    recs = [r for r in result.records if r.scheduled_time is not None]
    hit, _ = np.histogram([r.scheduled_time for r in recs], edges,
                          weights=[r.num_cached_tokens for r in recs])
    computed, _ = np.histogram(st["start"], edges, weights=st["num_prefill_tokens"])
    return {"edges": edges, "hit": hit / width, "computed": computed / width}


def plot_sessions(result: "Result", path: str | Path) -> Path:
    """Left: prompt tokens per second over time, prefix-cache hits stacked on the prefill the
    steps computed. Right: every turn's TTFT by its turn index, with the median per turn."""
    plt = _plt()
    series = session_token_series(result)
    edges = series["edges"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    width = edges[1] - edges[0]
    ax1.bar(edges[:-1], series["computed"], width=width, align="edge", color=PREFILL_COLOR,
            label="prefill computed")
    ax1.bar(edges[:-1], series["hit"], width=width, align="edge", bottom=series["computed"],
            color=HIT_COLOR, label="prefix-cache hits")
    ax1.set_xlabel("simulated time (s)")
    ax1.set_ylabel("prompt tokens / s")
    ax1.legend(loc="upper right", fontsize=8)
    sessions = result.summary.sessions or {}
    share = sessions.get("prefix_hit_share")
    ax1.set_title("prompt tokens: hits vs computed" + (f" (hits {share * 100:.1f}%)" if share is not None else ""),
                  fontsize=10)
    recs = [r for r in result.records or () if r.turn is not None and r.succeeded]
    turns = np.array([r.turn for r in recs])
    ttft = np.array([r.chunk_times[0] - r.arrival_time for r in recs])
    if turns.size:
        jitter = (np.arange(turns.size) % 7 - 3) * 0.05
        ax2.scatter(turns + jitter, ttft, s=8, alpha=0.5, color=DECODE_COLOR, label="one turn")
        ks = np.unique(turns)
        ax2.plot(ks, [np.median(ttft[turns == k]) for k in ks], color=STALL_COLOR, lw=1.5,
                 marker="o", ms=3, label="median")
        ax2.legend(loc="upper left", fontsize=8)
    ax2.set_yscale("log")
    ax2.yaxis.set_major_formatter(plt.FuncFormatter(_ms_label))
    ax2.yaxis.set_minor_formatter(plt.FuncFormatter(_ms_label))
    ax2.tick_params(axis="y", which="minor", labelsize=7)
    ax2.set_xlabel("turn index (0 = a session's first turn)")
    ax2.set_ylabel("TTFT")
    ax2.set_title("TTFT by turn", fontsize=10)
    fig.suptitle(f"Sessions -- {_title(result)}", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


def write_simulation_plots(
    result: "Result", out_dir: str | Path, compare: Sequence[Any] = ()
) -> list[Path]:
    """The teaching views of one run, as PNGs in ``out_dir``; returns their paths. A fleet's
    run gives the per-replica queue and KV picture instead (``fleet_routers.png``), with a
    column for each run of ``compare`` (the same fleet under other routers)."""
    out = check_figure_path(out_dir, "--plot", directory=True)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SimcapError(
            f"{out}: cannot make the figure directory: {exc.strerror or exc}"
        ) from None
    if hasattr(result, "replica_steps"):
        return [plot_fleet_routers([result, *compare], out / "fleet_routers.png")]
    return [
        plot_step_timeline(result, out / "step_timeline.png"),
        plot_itl_histogram(result, out / "itl_histogram.png"),
        plot_kv_queue(result, out / "kv_queue.png"),
        *([plot_sessions(result, out / "sessions.png")] if result.summary.sessions else []),
    ]


# --------------------------------------------------------------------------- capacity


def plot_capacity(result: "CapacityResult", path: str | Path, *, title: str | None = None) -> Path:
    """Each SLO metric against the measured arrival rate, SLO line, safe and saturation rates."""
    plt = _plt()
    from matplotlib.lines import Line2D

    keys = list(result.slo)
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 2.0 + 2.8 * len(keys)), sharex=True,
                             squeeze=False)
    pts = [p for p in result.points if p.role != "bootstrap"]
    for ax, key in zip(axes[:, 0], keys):
        target = result.slo[key]
        shown = [v for p in pts if (v := p.values.get(key)) is not None and v > 0] + [target]
        for p in pts:
            value = p.values.get(key)
            if value is None:
                if p.stopped and key in p.stopped["failed"]:  # fails; its value is not known
                    ax.scatter([p.measured_rate], [max(shown)], marker="^", s=44, zorder=3,
                               color=STALL_COLOR)
                continue
            ok = p.slo_pass.get(key, False)
            adequate = p.samples_adequate.get(key, True)
            color = OK_COLOR if ok else STALL_COLOR
            marker = "o" if p.role != "probe" else "s"
            ax.scatter([p.measured_rate], [value], marker=marker, s=36, zorder=3,
                       facecolor=color if adequate else "none", edgecolor=color, linewidth=1.2)
        ax.axhline(target, color="black", ls="--", lw=1)
        if max(shown) / min(shown) > 20:
            ax.set_yscale("log")
            ax.yaxis.set_minor_formatter(plt.NullFormatter())
            scale = ", log scale"
        else:
            scale = ""
        ax.yaxis.set_major_formatter(plt.FuncFormatter(_ms_label))
        ax.set_ylabel(f"{key}{scale}\n(dashed: SLO {_ms_label(target)})")
        if result.safe_rate is not None:
            ax.axvline(result.safe_rate, color=OK_COLOR, lw=1.5)
        if result.safe_rate_interval is not None:
            ax.axvspan(*result.safe_rate_interval, color=OK_COLOR, alpha=0.12, lw=0)
        if result.saturation_rate is not None:
            ax.axvline(result.saturation_rate, color=STALL_COLOR, lw=1.5, ls="-.")
    ax0 = axes[0, 0]
    handles = [
        Line2D([], [], marker="o", color=OK_COLOR, ls="", label="run passes this SLO"),
        Line2D([], [], marker="o", color=STALL_COLOR, ls="", label="run fails it"),
        Line2D([], [], marker="o", color="#555555", markerfacecolor="none", ls="",
               label="too few samples for this percentile"),
    ]
    if any(p.stopped for p in pts):
        handles.append(Line2D([], [], marker="^", color=STALL_COLOR, ls="",
                              label="run stopped early: fails, value not known"))
    if result.safe_rate is not None:
        handles.append(Line2D([], [], color=OK_COLOR, lw=1.5,
                              label=f"safe rate {result.safe_rate:.2f} req/s"))
    if result.saturation_rate is not None:
        handles.append(Line2D([], [], color=STALL_COLOR, lw=1.5, ls="-.",
                              label=f"saturation {result.saturation_rate:.2f} req/s"))
    if any(p.role == "probe" for p in pts):
        handles.append(Line2D([], [], marker="s", color="#555555", ls="",
                              label="saturation probe (1 run)"))
    ax0.legend(handles=handles, loc="best", fontsize=8, framealpha=0.95)
    axes[-1, 0].set_xlabel("measured arrival rate (requests/s)")
    fig.suptitle(title or f"Capacity: {result.replicates} replicate(s) x {result.duration_s:g} s per rate",
                 fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------- speculation crossover


def plot_crossover(
    result: Any,
    path: str | Path,
    *,
    title: str | None = None,
    reference: Mapping[str, Sequence[tuple[float, float, float]]] | None = None,
) -> Path:
    """Throughput and E2E latency (mean, p95) against load on a log2 axis, with and without
    speculation; the throughput crossover marked. ``result``: a
    :class:`simcap.studies.crossover.CrossoverResult` (from :func:`simcap.studies.crossover.find_crossover`).
    ``reference``: measured points per arm (``"spec"``, ``"baseline"``) as
    ``(load, output tok/s, mean E2E s)``, drawn as stars."""
    plt = _plt()
    loads = result.loads
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11, 4.2))
    arms = (("spec", "with speculation", DECODE_COLOR), ("baseline", "without", PREFILL_COLOR))
    for key, label, color in arms:
        pts = [getattr(p, key) for p in result.points]
        ax_t.plot(loads, [a.output_tokens_per_s for a in pts], "o-", color=color, label=label)
        ax_l.plot(loads, [a.latency_mean_s for a in pts], "o-", color=color, label=f"{label}, mean")
        ax_l.plot(loads, [a.latency_p95_s for a in pts], "s--", color=color, alpha=0.6,
                  label=f"{label}, p95")
        ref = (reference or {}).get(key)
        if ref:
            ax_t.plot([r[0] for r in ref], [r[1] for r in ref], "*", color=color, ms=13,
                      markeredgecolor="black", label=f"{label}, measured")
            ax_l.plot([r[0] for r in ref], [r[2] for r in ref], "*", color=color, ms=13,
                      markeredgecolor="black", label=f"{label}, measured mean")
    c = result.crossover
    found = c["status"] == "found"
    for ax in (ax_t, ax_l):
        ax.set_xscale("log", base=2)
        ax.set_xticks(loads)
        ax.set_xticklabels([f"{x:g}" for x in loads])
        ax.set_xlabel("concurrency (clients)" if result.axis == "concurrency"
                      else "arrival rate (req/s)")
        ax.grid(True, alpha=0.3)
        if found:
            ax.axvline(c["value"], color="black", ls=":", lw=1)
    ax_t.set_ylabel("output tokens/s")
    ax_t.set_title("throughput")
    ax_l.set_ylabel("E2E latency per request (s)")
    ax_l.set_title("latency")
    if found:
        ax_t.annotate(f"crossover ~{c['value']:.3g}", (c["value"], ax_t.get_ylim()[1] * 0.95),
                      ha="right", fontsize=9, xytext=(-4, 0), textcoords="offset points")
    ax_t.legend(fontsize=8)
    ax_l.legend(fontsize=8)
    name = result.provenance.get("scenario_name") or "scenario"
    fig.suptitle(title or f"{name}: speculation crossover "
                 f"({'~%.3g' % c['value'] if found else 'none in range'})", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------- fleets

ROUTER_COLORS = ("#3b78c2", "#ef8a17", "#2ca02c", "#9467bd", "#8c564b")


def plot_fleet_sizing(result: Any, path: str | Path, *, title: str | None = None) -> Path:
    """Safe rate against replica count, one line per router (a
    :class:`simcap.studies.fleet_sizing.FleetSizing` with its curve), the target rate, and where
    routing stops mattering."""
    if result.curve is None:
        raise SimcapError("--plot: the sizing has no safe-rate curve to plot")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    counts: list[int] = []
    for (router, by_n), color in zip(result.curve.items(), ROUTER_COLORS * 4):
        ns = sorted(by_n)
        counts = sorted(set(counts) | set(ns))
        ax.plot(ns, [by_n[n] or 0.0 for n in ns], "o-", color=color, label=router)
    ax.axhline(result.target_rate, color="black", ls="--", lw=1,
               label=f"target {result.target_rate:g} req/s")
    at = result.routing_stops_mattering_at
    if at is not None:
        ax.axvline(at, color="#555555", ls=":", lw=1.5,
                   label=f"routing stops mattering ({at} replicas)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts)
    ax.set_xticklabels([str(n) for n in counts])
    ax.set_xlabel("replicas")
    ax.set_ylabel("safe rate (req/s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    slo = ", ".join(f"{k} {_ms_label(v)}" for k, v in result.slo.items())
    ax.set_title(title or f"Fleet safe rate by replica count ({slo})", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


def plot_fleet_routers(results: Sequence[Any], path: str | Path, *, title: str | None = None) -> Path:
    """The teaching picture: per-replica queue length (waiting requests) and KV-cache usage
    over time, one column per router (each a :class:`simcap.fleet.replicas.FleetResult` run with
    ``steps=True``), on shared axes."""
    plt = _plt()
    fig, axes = plt.subplots(2, len(results), figsize=(5.5 * len(results), 6.2), sharex=True,
                             sharey="row", squeeze=False)
    for col, result in enumerate(results):
        info = result.fleet_info
        for i, steps in enumerate(result.replica_steps):
            rows = steps.as_arrays()
            color = ROUTER_COLORS[i % len(ROUTER_COLORS)] if len(result.replica_steps) <= 5 else None
            label = f"replica {i}"
            axes[0, col].step(rows["start"], rows["num_waiting"], where="post", lw=1, color=color,
                              label=label)
            axes[1, col].step(rows["start"], rows["kv_cache_usage"] * 100, where="post", lw=1,
                              color=color, label=label)
        imb = info["load_imbalance"]["requests"]
        axes[0, col].set_title(
            f"router {info['router']} (requests max/mean {imb:.2f}; TTFT p95 "
            f"{_ms_label(result.summary.ttft_s.p95 or 0.0)})", fontsize=10)
        axes[1, col].set_xlabel("time (s)")
        for ax in axes[:, col]:
            ax.grid(True, alpha=0.3)
    axes[0, 0].set_ylabel("waiting requests")
    axes[1, 0].set_ylabel("KV-cache usage (%)")
    axes[0, 0].legend(fontsize=8, loc="upper left")
    fig.suptitle(title or "Per-replica queue and KV usage under two routers", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)
