"""Moving a roofline profile to other hardware (``simcap transfer``).

Every byte and FLOP term is re-priced from the catalog entry of the target hardware (and, with
``tensor_parallel_size``, re-split over its ranks); every fitted efficiency and seconds term is
carried over, except the terms refitted on the target's own measured rows.

Which terms to refit was decided on held-out data (``experiments/hardware-transfer``: a public
table of one model served alike on five accelerators, each profile moved to each other
accelerator and scored on rows it never saw):

- By the datasheet alone, a move misses the target's figures by a median of 36% (the largest
  error of each of 20 pairs; none within 15%): the efficiencies belong to a kernel class
  (vendor, software stack, weight format), not to the model.
- One measured row: refitting the fixed per-step cost (``base``) there helps little (median
  25% from the lowest load, 61% from the highest); refitting the efficiency of the dominant
  byte term (``efficiency.experts`` for an MoE, ``efficiency.weights`` for a dense model)
  helps most (20% from the lowest load, 14% from the highest; 11 of 20 pairs within 15%).
- Two measured rows, the lowest and the highest load: ``base`` and that efficiency refitted,
  median 10%, 16 of 20 pairs within 15% (the four others are moves to the B200, whose own fit
  is the least physical).

So the default refit is by the number of measured rows: none, the dominant byte term's
efficiency (one row), or that and ``base`` (two or more). ``refit`` chooses otherwise.

Before any refit, the efficiencies a catalog kernel class names (``kernel_classes.yaml``)
replace the carried ones where the class covers the target (its hardware and expert weight
format; ``kernel_class="auto"``, the default, finds it): what those kernels achieved there. On
the same held-out moves, the 12 moves into a class of two with no row measured, the
efficiencies taken from the class's other member alone, missed by a median of 21.3% against
49.2% by the datasheet alone (H100 to MI325X 7.5% against 57.2%, H100 to MI300X 16.8% against
68.5%).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Sequence

from pydantic import ValidationError

from simcap._version import __version__
from simcap.calibrate.core import CalibrationError
from simcap.calibrate.pipeline import calibrate, pick_rows, read_all
from simcap.calibrate.profile_io import profile_dict
from simcap.calibrate.readers import TableReading
from simcap.calibrate.recipe import recipe_for
from simcap.calibrate.result import Fit
from simcap.config.profiles import load_profile
from simcap.config.scenario import StepTimeConfig, format_validation_error
from simcap.errors import ScenarioError

EVIDENCE = "experiments/hardware-transfer (README): which terms carry across accelerators"


# What the held-out moves of experiments/hardware-transfer measured, by what the move used.
ADVICE_NONE = (
    "moved by the catalog alone: such moves missed the target's figures by a median of 36% "
    "(experiments/hardware-transfer); measure one row on the target, at the highest load of interest, "
    "and give it to refit the dominant byte term (median 14%), or two, the lowest and highest (10%)")
ADVICE_CLASS = (
    "moved with the target's kernel class and no row: such moves missed by a median of 21% "
    "(experiments/hardware-transfer); measure one row on the target, at the highest load of interest, "
    "to refit the dominant byte term, or two, the lowest and highest")
ADVICE_ONE = (
    "one row refitted: such moves missed by a median of 14% (experiments/hardware-transfer); a second "
    "row, at the other end of the loads, refits the fixed step cost too (median 10%)")


@dataclass
class Transfer:
    """A moved profile: the YAML-ready dict, the fit on the target's rows (None: moved by the
    catalog alone) and the terms refitted."""

    profile: dict[str, Any]
    fit: Fit | None
    refitted: list[str]

    @property
    def record(self) -> dict[str, Any]:
        """The move as the profile's provenance records it."""
        return self.profile["provenance"]["transfer"]

    @property
    def fitted_rows(self) -> list[dict[str, Any]]:
        """The target's rows the refit read, each with its measured and fitted figure."""
        return [r for r in (self.fit.residuals if self.fit else ()) if r.get("fitted_in_objective")]

    def advice(self) -> str | None:
        """What such moves missed by on held-out data, and what to measure next (None: two or
        more rows refitted, the study's best)."""
        if len(self.refitted) >= 2:
            return None
        if self.refitted:
            return ADVICE_ONE
        return ADVICE_CLASS if self.record["kernel_class"] else ADVICE_NONE

    def to_dict(self) -> dict[str, Any]:
        """The move, each refitted term's value and the fitted rows, for ``--json``."""
        return {**self.record,
                "values": {t: term_value(self.profile["step_time"], t) for t in self.refitted},
                "fitted_rows": self.fitted_rows,
                "advice": self.advice()}


def term_value(step_time: dict[str, Any], term: str) -> float:
    """A roofline section's value of ``term`` (``base``, ``efficiency.experts``, ...)."""
    if term.startswith("efficiency."):
        return step_time["efficiency"][term.split(".", 1)[1]]
    return step_time[term]


def main_byte_term(step_time: StepTimeConfig) -> str:
    """The efficiency of the step's largest byte term: the experts for an MoE model, the dense
    weights otherwise."""
    return "efficiency.experts" if step_time.physics.model.is_moe else "efficiency.weights"


def default_refit(step_time: StepTimeConfig, rows: int) -> list[str]:
    """The terms refitted on ``rows`` measured rows of the target (see the module doc)."""
    if rows <= 0:
        return []
    main = main_byte_term(step_time)
    return [main] if rows == 1 else ["base", main]


def transfer(
    profile: str | Path, *, hardware: str, tensor_parallel_size: int | None = None,
    overrides: Sequence[str] = (), inputs: Sequence[str] = (), table: TableReading | None = None,
    rows: Collection[str] | None = None, refit: Sequence[str] | None = None,
    fit_metrics: Sequence[str] | None = None, workload: dict[str, Any] | None = None,
    bootstrap: int = 0, command: str | None = None, kernel_class: str | None = "auto",
) -> Transfer:
    """Move the roofline ``profile`` to ``hardware`` (a catalog name or a YAML file of one
    entry), optionally to ``tensor_parallel_size`` ranks, with ``overrides`` (``--set``, e.g.
    the target's ``engine.num_gpu_blocks``) applied first; refit ``refit`` (default:
    :func:`default_refit`) on the benchmark ``inputs`` measured on the target. ``kernel_class``:
    a catalog kernel class whose efficiencies replace the carried ones, ``"auto"`` (the one
    covering the target, if any) or None."""
    sets = [f"step_time.hardware={hardware}"]
    if tensor_parallel_size is not None:
        sets.append(f"step_time.tensor_parallel_size={tensor_parallel_size}")
    try:
        source, digest = load_profile(profile)
    except ScenarioError as exc:
        raise CalibrationError(str(exc)) from None
    if source.step_time.get("form") != "roofline":
        raise CalibrationError(f"{profile}: step_time.form: transfer moves a roofline profile (its "
                               "bytes and FLOPs re-priced from the catalog); a linear profile has no "
                               "hardware terms: refit it on the target with simcap calibrate")
    kc_name, kc = _kernel_class(kernel_class, hardware, source.step_time.get("expert_weight_dtype"))
    if kc is not None:
        sets += [f"step_time.efficiency.{t}={v}" for t, v in kc.efficiency.items()]
    sets += list(overrides)
    try:
        moved, _ = load_profile(profile, sets)
    except ScenarioError as exc:
        raise CalibrationError(str(exc)) from None
    recipe, files = recipe_for(list(inputs), profile, overrides=sets)
    if not files and (rows or table is not None and table.where or fit_metrics):
        raise CalibrationError("--rows, --where, --fit-metrics: choose among measured rows; give the "
                               "target's measurements (tables) first")
    try:
        step_time = StepTimeConfig.model_validate(moved.step_time)
    except ValidationError as exc:
        msg = format_validation_error(exc, StepTimeConfig)
        raise CalibrationError(msg if msg.startswith("step_time.") else f"step_time.{msg}") from None
    except ScenarioError as exc:
        raise CalibrationError(str(exc)) from None
    n_rows = None
    if refit is None:
        if files:
            points = pick_rows(read_all(files, recipe, workload, 0, table)[1], rows)
            n_rows = len(points)
        refit = default_refit(step_time, n_rows or 0)
    refit = list(refit)
    if refit and not files:
        raise CalibrationError("--refit: refits terms on the target's measured rows; give them (tables)")
    fit = None
    if refit:
        fit = calibrate(files, recipe, form=",".join(refit), rows=rows, table=table,
                        fit_metrics=fit_metrics, workload=workload, bootstrap=bootstrap)
        out = profile_dict(fit, recipe, command=command)
    else:
        out = _moved_dict(moved.model_dump(exclude_none=True), recipe, command)
        if "fit_load" in source.provenance:  # the loads its terms were fitted at (model-form distance)
            out["provenance"]["fit_load"] = source.provenance["fit_load"]
    if moved.frontend and "frontend" not in out:  # the server's front end, not the accelerator's
        out["frontend"] = dict(moved.frontend)
    out["name"] = f"{source.name}@{Path(hardware).stem}"
    desc = step_time.physics.hardware.description or hardware
    out["hardware"] = (f"{step_time.tensor_parallel_size}x {desc} (moved from: "
                       f"{source.hardware or source.step_time.get('hardware')})")
    from_class = [f"efficiency.{t}" for t in (kc.efficiency if kc else {}) if f"efficiency.{t}" not in refit]
    carried = [t for t in _terms() if t not in refit and t not in from_class]
    out["provenance"]["transfer"] = {
        "from": {"profile": str(profile), "name": source.name, "sha256": digest,
                 "hardware": source.step_time.get("hardware"),
                 "tensor_parallel_size": source.step_time.get("tensor_parallel_size", 1)},
        "to": {"hardware": hardware,
               "tensor_parallel_size": step_time.tensor_parallel_size},
        "carried": carried, "refitted": refit, "evidence": EVIDENCE,
        "kernel_class": None if kc is None else {"name": kc_name, "terms": from_class},
    }
    return Transfer(out, fit, refit)


def _kernel_class(name: str | None, hardware: str, expert_dtype: str | None):
    """(name, KernelClass) whose efficiencies the move takes, or (None, None): ``"auto"``, the
    catalog class covering ``hardware`` and the profile's expert weight format (if exactly one
    does); a name, that class, refused if it does not cover them."""
    from simcap.catalog import kernel_class_names, resolve_kernel_class

    if name in (None, "none"):
        return None, None
    if name == "auto":
        found = [(n, kc) for n in kernel_class_names()
                 if (kc := resolve_kernel_class(n)).covers(hardware, expert_dtype)]
        return found[0] if len(found) == 1 else (None, None)
    try:
        kc = resolve_kernel_class(name, "--kernel-class")
    except ScenarioError as exc:
        raise CalibrationError(str(exc)) from None
    if not kc.covers(hardware, expert_dtype):
        raise CalibrationError(f"--kernel-class: {name} covers {', '.join(kc.hardware)} with "
                               f"expert_weight_dtype {kc.expert_weight_dtype}; the move is to {hardware} "
                               f"with {expert_dtype}")
    return name, kc


def _terms() -> list[str]:
    """The fitted values a roofline section carries: its seconds terms and every efficiency."""
    from simcap.config.scenario import RooflineEfficiency

    secs = ["base", "per_request", "mixed_step", "host_overhead"]
    return secs + [f"efficiency.{k}" for k in RooflineEfficiency.model_fields]


def _moved_dict(data: dict[str, Any], recipe, command: str | None) -> dict[str, Any]:
    """A profile moved by the catalog alone: the source's sections with the new step_time, no
    fit (no intervals: the source's do not hold on other hardware)."""
    out = {k: v for k, v in data.items() if k not in ("step_time_ci", "bootstrap", "provenance")}
    out["provenance"] = {
        "simcap_version": __version__,
        "fit_method": "none: moved by the catalog (fitted terms carried, or the kernel class's)",
        "fitted_with": command,
        "assumptions": list(recipe.assumptions),
    }
    return out
