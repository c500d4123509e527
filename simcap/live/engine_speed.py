"""How fast the server's engine ran during a live run, against the prediction's own steps.

A prediction can miss because the model is wrong, or because the engine ran at another speed
than the one it was calibrated at: a shared host's neighbours, thermal limits, another process
on the cores. On the 2-core CPU servers the tests use, one server instance's decode steps at
one batch size took 0.75x to 2.0x the calibrated price from one second to the next, and whole
runs of the accuracy corpus 0.9x to 1.3x (``calibration/accuracy.md``, "Engine speed"). The
server's per-step log (``--enable-logging-iteration-details``) tells the two apart:

- :func:`engine_speed` compares the logged forward time of the run's steps with the simulated
  replay's. Decode-only steps are matched by batch size: per batch size ``b`` seen in both (at
  least :data:`MIN_STEPS` steps each), the live and the simulated mean step time; the ratio is
  ``sum_b n_b live_b / sum_b n_b sim_b`` with ``n_b`` the live steps at ``b``. Steps that
  compute prompt tokens are compared in total (both runs prefill the same prompts): the live
  steps' summed time over the replay's. Per second of the log (its timestamps), the decode ratio
  over that second's steps gives the spread of the speed within the run. The simulated forward
  time is the step's duration less the host overhead (synchronous scheduling; under async
  scheduling the host work overlaps the step and the duration stands).
- :func:`at_speed` is the scenario with each step kind's forward time scaled by its ratio
  (decode and draft-verifying steps by the decode ratio, steps with prompt tokens by the
  prefill ratio), through the step-time noise of each kind (its factors multiplied; a constant
  factor where the profile has none), so a replay at the measured speed prices every step as
  the engine ran it. A prediction at the measured speed is not a prediction: it uses the
  held-out run's own step log. It says how much of a miss the engine's speed explains, and
  what is left for the model. Where the run's batches are larger than the calibration's, the
  ratio holds the step-time form's own miss at those sizes as well as the engine's speed.
  One factor per step kind for the whole run, not one per second: a replay that followed each
  logged second's decode ratio overshot the corpus's near-saturation point (TTFT p95 +37%
  linear, +49% roofline, against +8% and +7% with the run's factors); the log's whole-second
  stamps place each second only to within a second, and a busy second's few decode-only steps
  price it poorly.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np

from simcap.calibrate.readers import parse_iteration_log
from simcap.config.scenario import EmpiricalNoise, Scenario, StepNoiseConfig

MIN_STEPS = 5  # steps of one batch size, live and simulated, for it to count
MIN_SECOND_STEPS = 20  # decode steps of one logged second, for its own ratio
_SECOND = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d)")


def _logged_steps(lines: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray, list[str], list[float]]:
    """Batch size, logged seconds and log second of each decode-only step, and the logged
    seconds of each step with prompt tokens: the log read once."""
    sizes, times, seconds, prefill = [], [], [], []
    for line in lines:
        rows = parse_iteration_log([line], k)
        if not rows:
            continue
        row = rows[0]
        if row["num_prefill_tokens"]:
            prefill.append(row["step_time_s"])
        elif row["num_decode_reqs"]:
            stamp = _SECOND.search(line)
            sizes.append(row["num_decode_reqs"])
            times.append(row["step_time_s"])
            seconds.append(stamp.group(1) if stamp else "")
    return np.asarray(sizes, dtype=np.int64), np.asarray(times, dtype=float), seconds, prefill


def engine_speed(lines: Sequence[str], sim_steps: dict[str, np.ndarray], host_overhead_s: float,
                 asynchronous: bool = False, k: int = 0) -> dict[str, Any] | None:
    """The run's engine speed against its simulated replay (module doc): ``ratio`` (decode
    steps; above 1: the engine ran slower than the prediction priced it), ``prefill_ratio``
    (steps with prompt tokens; None without enough of them), the decode steps and batch sizes
    the ratio rests on, and per logged second its spread (``per_second``: p10, p50, p90 of the
    seconds with :data:`MIN_SECOND_STEPS` steps). None where no batch size has enough decode
    steps on both sides (no log, or no decode steps)."""
    sizes, times, seconds, live_prefill = _logged_steps(lines, k)
    host = 0.0 if asynchronous else host_overhead_s
    prefill = sim_steps["num_prefill_tokens"] > 0
    decode = ~prefill & (sim_steps["num_reqs"] > 0)
    sim_sizes = sim_steps["num_reqs"][decode]
    sim_times = sim_steps["duration"][decode] - host
    sim_mean = {}
    for b in np.unique(sim_sizes):
        sel = sim_times[sim_sizes == b]
        if sel.size >= MIN_STEPS:
            sim_mean[int(b)] = float(sel.mean())
    values, counts = np.unique(sizes, return_counts=True)
    keep = np.isin(sizes, [b for b, n in zip(values, counts) if n >= MIN_STEPS and int(b) in sim_mean])
    if not keep.any():
        return None
    priced = np.array([sim_mean[int(b)] for b in sizes[keep]])
    ratio = float(times[keep].sum() / priced.sum())
    sim_prefill = sim_steps["duration"][prefill] - host
    prefill_ratio = (float(np.sum(live_prefill) / sim_prefill.sum())
                     if len(live_prefill) >= MIN_STEPS and sim_prefill.size >= MIN_STEPS else None)
    per_second = []
    kept_seconds = np.asarray(seconds, dtype=object)[keep]
    kept_times = times[keep]
    for second in sorted(set(kept_seconds) - {""}):
        sel = kept_seconds == second
        if sel.sum() >= MIN_SECOND_STEPS:
            per_second.append(float(kept_times[sel].sum() / priced[sel].sum()))
    spread = ({"seconds": len(per_second), **{f"p{q}": float(np.percentile(per_second, q)) for q in (10, 50, 90)}}
              if per_second else None)
    return {"ratio": ratio, "prefill_ratio": prefill_ratio, "decode_steps": int(keep.sum()),
            "batch_sizes": len(set(sizes[keep].tolist())), "per_second": spread}


def at_speed(scenario: Scenario, decode: float, prefill: float | None = None) -> Scenario:
    """``scenario`` with its decode (and draft-verifying) steps' forward time times ``decode``
    and its prompt-computing steps' times ``prefill`` (None: ``decode``), through the step-time
    noise of each kind (module doc); everything else as it was."""
    st = scenario.step_time
    noise = st.noise or StepNoiseConfig()
    factors = {"decode": decode, "prefill": decode if prefill is None else prefill, "spec": decode}
    update = {}
    for kind, factor in factors.items():
        dist = getattr(noise, kind)
        if dist is None and kind == "spec":
            dist = noise.decode  # (None: the decode steps' own, scaled with them)
            if dist is None:
                continue
        if dist is None:
            update[kind] = EmpiricalNoise(kind="empirical", quantiles=(factor, factor))
        elif isinstance(dist, EmpiricalNoise):
            update[kind] = dist.model_copy(update={"quantiles": tuple(q * factor for q in dist.quantiles)})
        else:  # lognormal of mean 1: the same spread around the factor
            update[kind] = EmpiricalNoise(kind="empirical", quantiles=_lognormal_quantiles(dist.sigma, factor))
    return scenario.model_copy(update={"step_time": st.model_copy(update={"noise": noise.model_copy(update=update)})})


def _lognormal_quantiles(sigma: float, factor: float, n: int = 41) -> tuple[float, ...]:
    from scipy.stats import norm

    z = norm.ppf(np.clip(np.linspace(0.0, 1.0, n), 1e-3, 1 - 1e-3))  # at i / (n - 1), as the engine reads them
    return tuple(float(factor * np.exp(sigma * v - sigma**2 / 2)) for v in z)
