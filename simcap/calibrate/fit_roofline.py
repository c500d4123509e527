"""Fitting the roofline step-time form to step samples: efficiencies pulled toward 1.

The roofline form (:class:`simcap.engine.step_time.RooflineStepTimeModel`) prices a step from
its bytes and FLOPs on named hardware; calibration fits how far the real kernels fall short
of that roofline (``efficiency``, 1 = at the roofline) plus ``base``, ``per_request`` and
``mixed_step`` (seconds). :func:`fit_roofline_samples` does it:

- **Basis.** Each step's physical terms in seconds at efficiency 1
  (:func:`simcap.engine.step_time.roofline_basis`) from its counts: prefill, decode and
  verified tokens, requests, mixed flag, attended context and prefill (query, key) pairs.
  vLLM's iteration log has no context and no pairs; :func:`step_inputs` derives them (see
  there) and says how in the fit's notes and the profile's provenance.
- **Objective.** Relative residuals ``(predicted - measured) / w`` with ``w`` the previous
  iteration's prediction (iteratively reweighted, 3 passes; the first divides by the
  measured time): step-time noise is multiplicative, so long prefill steps would otherwise
  drown the short decode steps. Plus a Gaussian prior per regularised coefficient,
  ``sigma^2 * ((c - prior) / sd)^2``, with ``sigma`` the steps' relative residual spread
  (1.4826 x MAD of log(measured / predicted) after an unregularised pass): each efficiency
  toward 1 with ``sd = prior_sd`` (default 1), ``per_request`` toward 0 with ``sd = prior_sd x``
  :data:`PER_REQUEST_SD` (0.3) x one token's roofline compute seconds. ``base`` and
  ``mixed_step`` are free. Solved by non-negative least squares (``combine: sum``) or bounded
  ``scipy.optimize.least_squares`` from the sum solution (``combine: max``, not linear).
- **The physical floor.** Every efficiency is bounded below by ``efficiency_floor``: by
  default 1 on hardware whose figures are datasheet peaks (no term runs faster than its bytes
  and FLOPs at those rates allow; the prior toward 1 is then a half-normal), none on hardware
  whose rates a microbenchmark measured (``rates: measured``: real kernels may beat them).
  The sum form solves for each term's excess over its bound. A term the fit holds at the
  floor against the data's pull (the objective's gradient points below it) is named in the
  notes: the data give that term less time than the hardware can, so the datasheet is off or
  another term (or one the form lacks) takes the time. A floor of 0 gives the unbounded fit,
  whose efficiencies below 0.95 are named instead.
- **Pinned or not.** Per regularised term the *prior share*
  ``lambda_j [(J^T J + Lambda)^-1]_jj`` (``J``: the weighted data Jacobian at the fit,
  ``Lambda``: the prior precisions): how much of the estimate's precision comes from the prior.
  0: the data alone decide it; 1: the prior alone (a term whose column is constant beside
  ``base``, or zero, e.g. the dense weights' read on one model, tensor parallel terms at
  tp 1). A term is **pinned** when its prior share is below 0.5 (the data weigh more than the
  prior). Collinearity counts: two terms the data cannot tell apart share the prior's pull.
  Terms whose column is zero in every step are left at their prior and reported so.
- **Intervals.** Pairs bootstrap over steps (weights and prior fixed at the fit), as the
  linear form's fit.
- ``routing_skew="fit"``: the skew is chosen on a grid (0 to the largest that keeps top-k
  within E_eff, step 0.05) by the regularised objective; otherwise it is given (default 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from pydantic import ValidationError
from scipy.optimize import least_squares, nnls

from simcap.calibrate.core import CalibrationError, Form, _fmt
from simcap.calibrate.fit_steps import host_overhead_of, noise_of_fit, step_residuals
from simcap.calibrate.readers import StepSamples
from simcap.calibrate.result import Fit, _percentile_ci
from simcap.engine.step_time import (
    ROOFLINE_COEFFICIENTS, ROOFLINE_TERMS, roofline_basis, roofline_forward)
from simcap.config.scenario import StepTimeConfig, format_validation_error
from simcap.errors import ScenarioError
from simcap.metrics.records import RequestRecord

PIN_THRESHOLD = 0.5  # prior share below which a term counts as pinned by the data
# per_request's prior sd, in units of one token's roofline compute. A per-request term grows
# linearly with the batch, as an MoE's experts read does over small batches (8, 15, 21, 27 of
# 64 experts at batches 1-4 for top-8): fitted on such steps, a looser prior let per_request
# take the experts' slope (0.2-2.1 ms on CPU servers, more than their whole host time per
# step) and carry it on linearly past the experts' bend. 0.3 was chosen on the recorded runs
# of experiments/cpu-extrapolation (the 16- and 32-client steps, fitted at 1-4 and at 1-8
# clients) and checked on four more runs on another CPU (tests/live/test_live_roofline.py).
PER_REQUEST_SD = 0.3


def coef_names() -> list[str]:
    """Coefficient names in ``ROOFLINE_FEATURES`` order: base, per_request, mixed_step, then
    ``efficiency.<term>``."""
    return list(ROOFLINE_COEFFICIENTS)


# --------------------------------------------------------------------------- inputs


def decode_context_of_lengths(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> float:
    """Mean attended context of a decoding request, over all its decode steps: the decode step
    that produces token ``j + 1`` attends ``prompt + j`` tokens (j = 1 .. output - 1; the first
    token comes from the prefill), so a request contributes ``(o - 1) p + (o - 1) o / 2``
    token-steps over ``o - 1`` steps. Longer requests weigh more, as they decode in more steps."""
    p = np.asarray(prompt_lens, dtype=float)
    o = np.asarray(output_lens, dtype=float)
    steps = np.maximum(o - 1.0, 0.0)
    if steps.sum() <= 0:
        raise CalibrationError("decode context: no request decoded more than one token")
    return float((steps * p + steps * o / 2.0).sum() / steps.sum())


def decode_context_of_records(records: Sequence[RequestRecord]) -> float:
    """:func:`decode_context_of_lengths` of the succeeded requests' prompt and output tokens."""
    ok = [r for r in records if r.succeeded]
    if not ok:
        raise CalibrationError("decode context: no succeeded request in the records")
    return decode_context_of_lengths([r.num_prompt_tokens for r in ok], [r.num_output_tokens for r in ok])


def decode_context_of_means(input_len: float, output_len: float) -> float:
    """``input + output / 2``: :func:`decode_context_of_lengths` for fixed lengths (for
    lengths that vary it understates by ``var(output) / (2 mean(output))``)."""
    return float(input_len) + float(output_len) / 2.0


@dataclass(frozen=True)
class ContextSource:
    """Where the attended context comes from when the samples lack it: the mean context of a
    decoding request (tokens) and a sentence saying how it was obtained."""

    per_decode_request: float
    how: str


def step_inputs(samples: StepSamples, context: ContextSource | None = None) -> tuple[dict[str, np.ndarray], list[str]]:
    """The roofline basis' per-step counts of ``samples`` and notes saying how each was obtained.

    - Tokens, requests, mixed: the samples (an iteration log: its prefill and generation
      requests and tokens).
    - Attended context: the samples' ``num_context_tokens`` column when present; else each
      decoding request attends ``context.per_decode_request`` tokens and each prefill chunk its
      own tokens (``C = decode requests x c + prefill tokens + verified drafts``).
    - Prefill (query, key) pairs: the ``num_prefill_pairs`` column when present; else each
      prefill request's chunk is taken as a whole prompt from position 0 (no earlier chunk, no
      prefix-cache hit), the step's prefill tokens split evenly over its prefill requests:
      ``a m (m + 1) / 2`` with ``m = tokens / a`` (a lower bound when chunks continue earlier ones).
    """
    c = samples.counts
    if c is None:
        raise CalibrationError(f"{samples.source.get('file')}: step samples without per-step counts")
    n = len(samples)
    zero = np.zeros(n)
    prefill, decode = c["num_prefill_tokens"], c["num_decode_tokens"]
    verify, decode_reqs = c.get("num_verify_tokens", zero), c["num_decode_reqs"]
    notes = []
    if "num_context_tokens" in c:
        ctx = c["num_context_tokens"]
        notes.append("attended context: the samples' num_context_tokens column")
    elif context is not None:
        ctx = decode_reqs * context.per_decode_request + prefill + verify
        notes.append(f"attended context: not in the samples; derived as decode requests x "
                     f"{context.per_decode_request:.1f} tokens ({context.how}) + prefill tokens + "
                     "verified drafts")
    else:
        raise CalibrationError(
            f"{samples.source.get('file')}: the roofline form's kv_read term needs each step's "
            "attended context, which these samples lack (a vLLM iteration log has none): give the "
            "client records of the same run (--records) or the workload's mean lengths "
            "(--input-len and --output-len)"
        )
    if "num_prefill_pairs" in c:
        pairs = c["num_prefill_pairs"]
        notes.append("prefill (query, key) pairs: the samples' num_prefill_pairs column")
    else:
        a = c.get("num_prefill_reqs", (prefill > 0).astype(float))
        a = np.where((prefill > 0) & (a <= 0), 1.0, a)
        m = np.divide(prefill, a, out=np.zeros(n), where=a > 0)
        pairs = a * m * (m + 1.0) / 2.0
        notes.append("prefill (query, key) pairs: not in the samples; each prefill request's chunk "
                     "taken as a whole prompt from position 0, the step's prefill tokens split "
                     "evenly over its prefill requests (a lower bound for continued chunks)")
    counts = {"prefill": prefill, "decode": decode, "verify": verify, "reqs": c["num_reqs"],
              "mixed": c["mixed"], "context": ctx, "pairs": pairs}
    return counts, notes


def hardware_arg(value: str) -> Any:
    """``--hardware``: a catalog name, or a YAML file of one hardware entry (inlined, so the
    profile does not depend on the file's place)."""
    from pathlib import Path

    from simcap.config.yaml_files import read_yaml_mapping

    if Path(value).is_file():
        data, _ = read_yaml_mapping(value, "hardware", "memory_bandwidth_gbps, peak_tflops, ...")
        return data
    return value


def model_arg(value: str) -> Any:
    """``--model``: a catalog name, or a config.json file (inlined, keys starting with ``_``
    dropped)."""
    from pathlib import Path

    from simcap.catalog.memory import load_hf_config

    path = Path(value)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        try:
            data = load_hf_config(path)
        except ScenarioError as exc:
            raise CalibrationError(f"--model {value}: {str(exc).removeprefix('model.config: ')}") from None
        return {k: v for k, v in data.items() if not str(k).startswith("_")}
    return value


def roofline_options(hardware: str | None, model: str | None, *, combine: str = "sum",
                     routing_skew: str | float = 0.0, prior_sd: float = 1.0,
                     efficiency_floor: float | None = None,
                     records: Sequence[Any] | None = None) -> dict[str, Any]:
    """The ``roofline`` arguments of :func:`simcap.calibrate.calibrate` from command-line values."""
    if not hardware or not model:
        raise CalibrationError("--form roofline: give --hardware and --model (catalog names or files)")
    if not 0.0 < prior_sd < math.inf:
        raise CalibrationError(f"--prior-sd: a finite number > 0 (got {prior_sd!r})")
    if efficiency_floor is not None and not 0.0 <= efficiency_floor <= 1.0:
        raise CalibrationError(f"--efficiency-floor: a number from 0 to 1 (got {efficiency_floor!r})")
    if routing_skew != "fit":
        try:
            routing_skew = float(routing_skew)
        except ValueError:
            raise CalibrationError(f"--routing-skew: a number in [0, 1) or 'fit' (got {routing_skew!r})") from None
    return {"hardware": hardware_arg(hardware), "model": model_arg(model), "combine": combine,
            "routing_skew": routing_skew, "prior_sd": prior_sd, "efficiency_floor": efficiency_floor,
            "records": [str(r) for r in records or []]}


# --------------------------------------------------------------------------- the fit


def roofline_config(
    hardware: Any, model: Any, *, combine: str = "sum", routing_skew: float = 0.0,
    **extra: Any,
) -> StepTimeConfig:
    """A roofline ``StepTimeConfig`` (efficiencies 1) for the physics; errors as CalibrationError."""
    try:
        return StepTimeConfig(form="roofline", hardware=hardware, model=model, combine=combine,
                              routing_skew=routing_skew, **extra)
    except ValidationError as exc:
        raise CalibrationError(f"roofline form: {format_validation_error(exc)}") from None
    except ScenarioError as exc:
        raise CalibrationError(f"roofline form: {exc}") from None


@dataclass
class _System:
    X: np.ndarray  # basis rows (all columns)
    y: np.ndarray
    free: np.ndarray  # column indices fitted
    prior: np.ndarray  # prior value per column (all columns)
    sd: np.ndarray  # prior sd per column (inf: unregularised)
    combine: str
    lower: np.ndarray  # lower bound per column: 0 for seconds, the floor for efficiencies


# Significant digits the max form's solver reads its coefficients at (see :func:`_settled`).
SETTLE_DIGITS = 10


def _settled(v: np.ndarray | float, digits: int = SETTLE_DIGITS) -> Any:
    """``v`` rounded to ``digits`` significant digits. The max form's solver reads its
    coefficients, and the IRLS loop its weights' spread, through this: machines differ in the
    last bits of a matrix product (BLAS kernels for AVX2 or AVX-512), and on the max's kinks
    such a difference steers the solver to another point of a flat valley (seen: a fitted
    mixed_step 65% apart). Rounded, the paths stay one on every machine: same log, same
    profile, byte for byte."""
    if np.ndim(v) == 0:
        return float(f"{float(v):.{digits}g}")
    return np.array([float(f"{x:.{digits}g}") for x in np.asarray(v, dtype=float)])


def _solve(sys: _System, rows: np.ndarray, w: np.ndarray, sigma: float,
           x0: np.ndarray | None = None) -> np.ndarray:
    """Coefficients (all columns; unfitted at their prior) minimising the weighted relative
    residuals of ``rows`` plus the prior, each at or above its lower bound."""
    return _solve_bounded(sys, rows, w, sigma, x0)[0]


def _solve_bounded(sys: _System, rows: np.ndarray, w: np.ndarray, sigma: float,
                   x0: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """As :func:`_solve`, and per free column whether the fit holds it at its lower bound
    against the data's pull (the objective would fall below it)."""
    f = sys.free
    X, y, wr = sys.X[rows], sys.y[rows], w[rows]
    reg = f[np.isfinite(sys.sd[f])]
    lo = sys.lower[f]
    fixed = np.array(sys.prior, dtype=float)
    fixed[f] = lo  # (the sum form solves for the excess over the bound, >= 0)
    scale = sigma / sys.sd[reg] if len(reg) else np.zeros(0)
    out = np.array(sys.prior, dtype=float)
    prior_rows = np.zeros((len(reg), len(f)))  # d(prior residual)/d(free coefficient)
    for i, j in enumerate(reg):
        prior_rows[i, list(f).index(j)] = scale[i]
    if sys.combine != "max":
        A = np.vstack([X[:, f] / wr[:, None], prior_rows])
        b = np.concatenate([(y - X @ fixed) / wr, scale * (sys.prior[reg] - sys.lower[reg])])
        try:
            sol = nnls(A, b, maxiter=100 * len(f))[0]
        except RuntimeError as exc:
            raise CalibrationError(f"roofline fit: NNLS did not converge: {exc}") from None
        out[f] = lo + sol
        pull = A.T @ (b - A @ sol)  # < 0 at a bound: the objective falls below it
        held = (sol <= 0.0) & (pull < -1e-9 * max(float(np.abs(A.T @ b).max()), 1e-300))
        return out, held

    def resid(v: np.ndarray) -> np.ndarray:
        c = np.array(sys.prior, dtype=float)
        c[f] = _settled(v)
        return np.concatenate([(roofline_forward(X, c, "max") - y) / wr, scale * (c[reg] - sys.prior[reg])])

    def jac(v: np.ndarray) -> np.ndarray:  # exact (the max's active branch): no finite differences
        c = np.array(sys.prior, dtype=float)
        c[f] = _settled(v)
        return np.vstack([_branch_jacobian(X, c)[:, f] / wr[:, None], prior_rows])

    start = np.maximum((x0 if x0 is not None else sys.prior)[f], lo + 1e-12)
    r = least_squares(resid, start, jac=jac, bounds=(lo, np.inf), method="trf", x_scale="jac", max_nfev=200)
    held = r.active_mask < 0
    out[f] = np.where(held, lo, _settled(r.x))  # (trf stays a hair inside its bounds)
    return out, held


def _objective(sys: _System, c: np.ndarray, w: np.ndarray, sigma: float) -> float:
    reg = sys.free[np.isfinite(sys.sd[sys.free])]
    r = (roofline_forward(sys.X, c, sys.combine) - sys.y) / w
    return float(r @ r + np.sum((sigma * (c[reg] - sys.prior[reg]) / sys.sd[reg]) ** 2))


def _branch_jacobian(X: np.ndarray, c: np.ndarray) -> np.ndarray:
    """d(max-form prediction)/d(coefficient) per row, all columns: its active branch's
    (:func:`simcap.engine.step_time.roofline_forward`; memory where the two groups tie)."""
    J = X.copy()
    parts = X * c
    compute_wins = (parts[:, 5] + parts[:, 6]) > (parts[:, 3] + parts[:, 4] + parts[:, 7])
    J[:, [3, 4, 7]] *= (~compute_wins)[:, None]
    J[:, [5, 6]] *= compute_wins[:, None]
    return J


def _jacobian(sys: _System, c: np.ndarray, w: np.ndarray) -> np.ndarray:
    """d(weighted prediction)/d(coefficient), all columns (the max form: its active branch)."""
    if sys.combine != "max":
        return sys.X / w[:, None]
    return _branch_jacobian(sys.X, c) / w[:, None]


def _fit_once(sys: _System, sigma_fixed: float | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """IRLS: (coefficients, weights, sigma)."""
    c, w, sigma, _ = _fit_held(sys, sigma_fixed)
    return c, w, sigma


def _fit_held(sys: _System, sigma_fixed: float | None = None
              ) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """IRLS: (coefficients, weights, sigma, per free column held at its bound by the fit)."""
    rows = np.arange(len(sys.y))
    w = np.maximum(sys.y, 1e-9)
    # Unregularised pass for the residual spread (sigma), then the regularised passes.
    c = _solve(sys, rows, w, 0.0)
    sigma = sigma_fixed
    for _ in range(3):
        pred = roofline_forward(sys.X, c, sys.combine)
        if sigma_fixed is None:
            ok = (pred > 0) & (sys.y > 0)
            lr = np.log(sys.y[ok] / pred[ok])
            sigma = float(1.4826 * np.median(np.abs(lr - np.median(lr)))) if ok.any() else 1.0
            sigma = _settled(max(sigma, 1e-3))
        w = _settled(np.maximum(pred, 1e-9)) if sys.combine == "max" else np.maximum(pred, 1e-9)
        c, held = _solve_bounded(sys, rows, w, sigma, c)
    return c, w, float(sigma), held


def physics_floor_notes(fitted: dict[str, float], held: Sequence[str] = (),
                        floor: float = 1.0) -> list[str]:
    """Notes on efficiencies against the physical floor (time = efficiency x the term's bytes
    or FLOPs at the datasheet's rate, so below 1 the term runs faster than the hardware
    allows). ``held``: the terms a fit with efficiencies bounded at ``floor`` holds there
    against the data, which want them lower; ``fitted``: the free ``efficiency.<term>``
    values, those below :data:`FLOOR` named (fits whose bound is under it). Either way the
    datasheet figure is low for this machine, or the time the fit took off that term belongs
    to a term the form lacks."""
    notes = []
    if held:
        notes.append(
            f"held at the physical floor (efficiency {floor:g}) against the data, which want it "
            "faster than the datasheet allows: " + ", ".join(held)
            + "; the datasheet figure is low for this machine, or the form lacks a term that takes "
              "the time the data give the others")
    below = {t: v for t, v in fitted.items() if t.startswith("efficiency.") and v < FLOOR}
    if below:
        notes.append(
            "below the physical floor (efficiency < 1: faster than the datasheet allows): "
            + ", ".join(f"{t} {v:.3g}" for t, v in below.items())
            + "; the datasheet figure is low for this machine, or the form lacks a term that takes this time")
    return notes


FLOOR = 0.95  # below this a fitted efficiency is noted (a little under 1: fits carry noise)


def check_floor(floor: float | None, hardware: Any) -> float:
    """The efficiencies' lower bound of a fit: ``floor`` (a number in [0, 1]; 0 gives the
    unbounded fit), or None for the hardware's own (1 for datasheet peaks, none for rates a
    microbenchmark measured: :attr:`simcap.catalog.HardwareSpec.efficiency_floor`)."""
    if floor is None:
        return hardware.efficiency_floor
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 <= floor <= 1.0:
        raise CalibrationError(f"efficiency_floor: a number from 0 to 1 (got {floor!r})")
    return float(floor)


def fit_roofline_samples(
    samples: Sequence[StepSamples],
    hardware: Any,
    model: Any,
    *,
    combine: str = "sum",
    routing_skew: float | str = 0.0,
    context: ContextSource | None = None,
    prior_sd: float = 1.0,
    efficiency_floor: float | None = None,
    num_draft_passes: int = 0,
    host_overhead: float | None = None,
    bootstrap: int = 200,
    level: float = 0.9,
    seed: int = 0,
    warn_above: float = 0.1,
    noise: str | None = "empirical",
    config: dict[str, Any] | None = None,
) -> Fit:
    """Fit the roofline form's efficiencies (and base, per_request, mixed_step) to step samples.

    ``hardware``, ``model``: catalog names, ``{config: PATH}`` or inline entries (as in a
    scenario's ``step_time``); ``config``: further roofline keys (weight_dtype, kv_dtype,
    compute_dtype, tensor_parallel_size, draft_model). ``context``: the attended context per
    decoding request where the samples lack it (:func:`step_inputs`). ``efficiency_floor``:
    every efficiency's lower bound (None: the hardware's, :func:`check_floor`). ``routing_skew``: a value,
    or ``"fit"`` (grid). ``num_draft_passes``: k of an EAGLE draft (0 otherwise). The rest as
    :func:`simcap.calibrate.fit_step_samples`. The returned :class:`Fit` carries the profile's
    ``step_time`` section (``Fit.step_time``) and per-term pinning (``Fit.extra['roofline']``).
    """

    if combine not in ("sum", "max"):
        raise CalibrationError(f"--combine: sum or max (got {combine!r})")
    if not prior_sd > 0:
        raise CalibrationError(f"prior sd: must be positive (got {prior_sd})")
    samples = list(samples)
    where = ", ".join(str(s.source.get("file")) for s in samples)
    parts, notes = [], []
    for s in samples:
        counts, how = step_inputs(s, context)
        parts.append(counts)
        notes += [h for h in how if h not in notes]
    counts = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    y = np.concatenate([s.y for s in samples])
    X_linear = np.vstack([s.X for s in samples])
    extra = dict(config or {})
    base_cfg = roofline_config(hardware, model, combine=combine, **extra)
    phys = base_cfg.physics
    floor = check_floor(efficiency_floor, phys.hardware)
    names = coef_names()
    m = len(names)
    if len(y) < 4:
        raise CalibrationError(f"{where}: {len(y)} step samples are too few for the roofline fit")

    def system(skew: float) -> _System:
        ph = roofline_config(hardware, model, combine=combine, routing_skew=skew, **extra).physics
        X = roofline_basis(ph, prefill=counts["prefill"], decode=counts["decode"], verify=counts["verify"],
                           reqs=counts["reqs"], mixed=counts["mixed"], context=counts["context"],
                           pairs=counts["pairs"], num_draft_passes=num_draft_passes)
        prior = np.array([0.0, 0.0, 0.0, *([1.0] * len(ROOFLINE_TERMS))])
        tok = ph.compute_per_token + ph.compute_per_logit
        sd = np.array([np.inf, PER_REQUEST_SD * prior_sd * tok, np.inf, *([prior_sd] * len(ROOFLINE_TERMS))])
        varies = np.array([np.any(X[:, j] != 0) for j in range(m)])
        varies[0] = True
        lower = np.array([0.0, 0.0, 0.0, *([floor] * len(ROOFLINE_TERMS))])
        return _System(X, y, np.flatnonzero(varies), prior, sd, combine, lower)

    skew_report = None
    if routing_skew == "fit":
        if not phys.model.is_moe:
            skew = 0.0
            notes.append("routing_skew 0: a dense model (nothing to fit)")
        else:
            k_route, e = phys.model.num_experts_per_tok, phys.model.num_experts
            top = 1.0 - k_route / e
            grid = [round(g, 2) for g in np.arange(0.0, top + 1e-9, 0.05)]
            losses = {}
            sigma0 = _fit_once(system(0.0))[2]  # one residual spread for every skew
            for g in grid:
                sy = system(g)
                c, _, _ = _fit_once(sy, sigma0)
                w = np.maximum(roofline_forward(sy.X, c, combine), 1e-9)
                losses[g] = _objective(sy, c, w, sigma0)
            skew = min(losses, key=losses.get)
            skew_report = {"grid": grid, "objective": {str(g): round(v, 3) for g, v in losses.items()},
                           "chosen": skew}
            notes.append(f"routing_skew {skew:g}: fitted on a grid of {len(grid)} values (0 to "
                         f"{grid[-1]:g}) by the regularised objective")
    else:
        skew = float(routing_skew)
    sys_ = system(skew)
    coef, w, sigma, held = _fit_held(sys_)
    held = [names[j] for j, h in zip(sys_.free, held) if h and names[j].startswith("efficiency.")]
    fitted = roofline_forward(sys_.X, coef, combine)

    # Pinning: the prior's share of each regularised term's precision.
    J = _jacobian(sys_, coef, w)[:, sys_.free]
    lam = np.zeros(len(sys_.free))
    fin = np.isfinite(sys_.sd[sys_.free])
    lam[fin] = (sigma / sys_.sd[sys_.free][fin]) ** 2
    H = J.T @ J + np.diag(lam)
    Hinv = np.linalg.pinv(H)
    pinning: dict[str, dict[str, Any]] = {}
    for j, name in enumerate(names):
        entry: dict[str, Any] = {"value": _fmt(coef[j])}
        if j not in sys_.free:
            entry.update(in_data=False, prior_share=1.0 if np.isfinite(sys_.sd[j]) else None, pinned=False,
                         note="zero in every step: left at its prior")
        elif not np.isfinite(sys_.sd[j]):
            entry.update(in_data=True, prior_share=None, pinned=None, note="free (no prior)")
        else:
            i = list(sys_.free).index(j)
            share = float(min(max(lam[i] * Hinv[i, i], 0.0), 1.0))
            entry.update(in_data=True, prior_share=round(share, 4), pinned=share < PIN_THRESHOLD,
                         prior=_fmt(sys_.prior[j]), prior_sd=_fmt(sys_.sd[j]))
        pinning[name] = entry

    # Bootstrap: pairs over steps, weights and sigma held at the fit.
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(bootstrap):
        rows = rng.integers(0, len(y), len(y))
        c = _solve(sys_, rows, w, sigma, coef)
        sets.append({nm: _fmt(v) for nm, v in zip(names, c) if names.index(nm) in sys_.free})
    terms = [names[j] for j in sys_.free]
    ci = _percentile_ci(sets, terms, level) if sets else {}
    for name, (lo, hi) in ci.items():
        e = pinning[name]
        if e.get("prior_sd") and np.isfinite(sys_.sd[names.index(name)]):
            e["ci_width_over_prior_sd"] = round((hi - lo) / sys_.sd[names.index(name)], 4)

    host = host_overhead_of(samples, host_overhead, notes)  # as the linear fit does it

    coeffs = {nm: float(coef[j]) for j, nm in enumerate(names)}
    coeffs["host_overhead"] = host
    step_time: dict[str, Any] = {
        "form": "roofline", "hardware": hardware, "model": model, **extra,
        "combine": combine, "routing_skew": skew,
        "base": _fmt(coeffs["base"]), "per_request": _fmt(coeffs["per_request"]),
        "mixed_step": _fmt(coeffs["mixed_step"]), "host_overhead": _fmt(host),
        "efficiency": {t: _fmt(coeffs[f"efficiency.{t}"]) for t in ROOFLINE_TERMS},
    }
    if combine == "sum":
        del step_time["combine"]
    if not phys.model.is_moe or skew == 0.0:
        step_time.pop("routing_skew")
    residuals, quality, warnings = step_residuals(y, fitted, warn_above, where)
    quality["relative_spread_sigma"] = round(sigma, 4)
    pinned = [n for n, e in pinning.items() if e.get("pinned")]
    unpinned = [n for n, e in pinning.items() if e.get("pinned") is False]
    notes.append(f"pinned by the data (prior share < {PIN_THRESHOLD}): {', '.join(pinned) or 'none'}; "
                 f"held by the prior: {', '.join(unpinned) or 'none'}")
    notes += physics_floor_notes({t: coeffs[t] for t in terms}, held, floor)
    fit = Fit(
        kind="step_samples",
        method=(f"roofline form ({combine}): "
                + ("nnls (scipy.optimize.nnls)" if combine == "sum" else "bounded least squares "
                   "(scipy.optimize.least_squares, trf) from the sum form's solution")
                + " on relative step residuals (iteratively reweighted by the prediction), each "
                  f"efficiency pulled toward 1 (sd {prior_sd:g}) and at least {floor:g}, "
                  "per_request toward 0"),
        form=Form(tuple(terms), {}), coefficients=coeffs, fixed={},
        ci=ci, bootstrap=sets,
        bootstrap_method=f"pairs bootstrap over step rows ({bootstrap} resamples, seed {seed}; "
                         "weights and prior held at the fit)",
        level=level, residuals=residuals, sources=[s.source for s in samples],
        warnings=warnings, notes=notes, quality=quality,
    )
    fit.step_time = step_time
    fit.extra = {"roofline": {
        "efficiency_floor": floor,
        "held_at_floor": held,
        "prior": {"efficiency": 1.0, "efficiency_sd": prior_sd, "per_request": 0.0,
                  "per_request_sd_s": _fmt(PER_REQUEST_SD * prior_sd * (phys.compute_per_token + phys.compute_per_logit)),
                  "weight": "sigma^2 / sd^2 per coefficient, sigma the relative residual spread "
                            f"({sigma:.4g})"},
        "pinned_rule": f"prior share lambda_j [(J^T J + Lambda)^-1]_jj < {PIN_THRESHOLD}",
        "terms": pinning,
        "inputs": [n for n in notes if n.startswith(("attended context", "prefill (query"))],
        "routing_skew": skew_report or {"given": skew},
    }}
    if noise:
        noise_of_fit(fit, X_linear, y, fitted, noise)
    return fit
