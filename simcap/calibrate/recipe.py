"""What to fit: :class:`Recipe` (deployment, form, assumptions, datasets) from a recipe YAML,
a base profile (``--base``) or the command line (``--fix``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from simcap.calibrate.core import TERMS, CalibrationError, is_whole
from simcap.calibrate.readers import _read_text, split_input
from simcap.config.profiles import load_profile
from simcap.config.yaml_files import load_yaml
from simcap.errors import ScenarioError


@dataclass
class Recipe:
    """What to fit and how: deployment sections, form, assumptions and datasets (YAML)."""

    name: str
    path: Path | None = None
    hardware: str | None = None
    model: str | None = None
    description: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    speculative: dict[str, Any] | None = None
    step_time: dict[str, Any] = field(default_factory=dict)
    form: str | None = None
    fit_metrics: list[str] | None = None
    weights: dict[str, float] = field(default_factory=dict)
    prior: dict[str, Any] | None = None  # roofline form: the pull toward the efficiencies' prior
    bootstrap: int | None = None
    bootstrap_iterations: int | None = None
    # Roofline form: local fits from this many starts (the recipe's, then draws around its
    # priors), the best kept: the simulation-based objective has local minima.
    starts: int = 1
    seed: int = 0
    warn_above: float = 0.1
    assumptions: list[str] = field(default_factory=list)
    datasets: list[dict[str, Any]] = field(default_factory=list)

    KEYS = ("name", "hardware", "model", "description", "engine", "speculative", "step_time", "form",
            "fit_metrics", "weights", "prior", "bootstrap", "bootstrap_iterations", "starts", "seed", "warn_above",
            "assumptions", "datasets")

    @classmethod
    def load(cls, path: str | Path) -> "Recipe":
        path = Path(path)
        try:
            data = load_yaml(_read_text(path))
        except yaml.YAMLError as exc:
            raise CalibrationError(f"{path}: malformed YAML: {str(exc).splitlines()[0]}") from None
        if not isinstance(data, dict) or "name" not in data:
            raise CalibrationError(f"{path}: a recipe is a mapping with name, engine, datasets, ...")
        extra = set(data) - set(cls.KEYS)
        if extra:
            raise CalibrationError(
                f"{path}: unknown key {sorted(extra)[0]!r}; allowed: {', '.join(cls.KEYS)}"
            )
        if isinstance(data.get("form"), list):
            data["form"] = ",".join(data["form"])
        starts = data.get("starts", 1)
        if not is_whole(starts, 1, 64):
            raise CalibrationError(f"{path}: starts: a whole number from 1 to 64 (local fits, the best kept)")
        return cls(path=path, **data)


def base_from_profile(path: str | Path, profile: Any = None) -> Recipe:
    """A recipe without datasets from a profile file (``--base``): deployment and start values
    (``profile``: the file's :class:`~simcap.config.profiles.Profile`, when already read)."""
    if profile is None:
        profile, _ = load_profile(path)
    return Recipe(name=profile.name, path=Path(path), hardware=profile.hardware, model=profile.model,
                  description=profile.description, engine=dict(profile.engine),
                  speculative=dict(profile.speculative) if profile.speculative else None,
                  step_time=dict(profile.step_time))


def base_from_scenario(path: str | Path, data: dict) -> Recipe:
    """A recipe without datasets from a scenario file (``--base``): its engine, speculative and
    step-time sections as written, over the profile it names (checked as a scenario first)."""
    from simcap.config.profiles import apply_profile
    from simcap.config.scenario import parse_scenario

    path = Path(path)
    try:
        parse_scenario(data, base_dir=path.parent)
        merged = apply_profile(dict(data), path.parent)
    except ScenarioError as exc:
        raise CalibrationError(f"--base {path}: {exc}") from None
    ref = merged.get("profile") if isinstance(merged.get("profile"), dict) else {}
    return Recipe(name=str(merged.get("name") or path.stem), path=path, hardware=ref.get("hardware"),
                  model=ref.get("model"), engine=dict(merged.get("engine") or {}),
                  speculative=dict(merged["speculative"]) if merged.get("speculative") else None,
                  step_time=dict(merged.get("step_time") or {}))


def parse_fix(items: Sequence[str]) -> dict[str, float]:
    """``["mixed_step=0.03", ...]`` (``--fix``) -> {term: seconds}."""
    fixed = {}
    for item in items:
        term, sep, value = (t.strip() for t in item.partition("="))
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or term not in TERMS or not number >= 0:
            raise CalibrationError(
                f"--fix {item!r}: expected TERM=SECONDS (>= 0) with TERM in {', '.join(TERMS)}"
            )
        fixed[term] = number
    return fixed


def recipe_for(
    inputs: Sequence[str], base: str | Path | None = None, *, name: str | None = None,
    default_name: str = "profile", overrides: Sequence[str] = (),
) -> tuple[Recipe, list[str]]:
    """The recipe of a ``simcap calibrate`` call and the measurement files left to read.

    One ``.yaml`` input is a recipe (its datasets are the data); ``base`` is a profile, a
    recipe or a scenario whose deployment and start values are used for the given files.
    ``overrides``: ``dotted.key=value`` changes to a profile or scenario ``base`` (``--set``:
    e.g. ``step_time.hardware=mi300x`` to refit part of a profile on other hardware), recorded
    among the recipe's assumptions.
    """
    from simcap.config.scenario import apply_overrides

    overrides = list(overrides)
    if overrides and base is None:
        raise CalibrationError("--set: changes the --base profile or scenario; give --base")
    inputs = list(inputs)
    recipe = None
    if len(inputs) == 1 and split_input(inputs[0])[0].endswith((".yaml", ".yml")):
        recipe, inputs = Recipe.load(inputs[0]), []
    if base is not None:
        if recipe is not None:
            raise CalibrationError("--base: the recipe already names its deployment")
        try:
            data = load_yaml(_read_text(Path(base)))
        except yaml.YAMLError as exc:
            raise CalibrationError(f"{base}: malformed YAML: {str(exc).splitlines()[0]}") from None
        is_recipe = isinstance(data, dict) and "datasets" in data
        if is_recipe:
            if overrides:
                raise CalibrationError("--set: changes a --base profile or scenario, not a recipe (edit the recipe)")
            recipe = Recipe.load(base)
        elif isinstance(data, dict) and "workload" in data:
            recipe = base_from_scenario(base, apply_overrides(data, overrides))
        else:
            try:
                profile, _ = load_profile(base, overrides)
            except ScenarioError as exc:
                raise CalibrationError(f"--base {base}: {exc}") from None
            recipe = base_from_profile(base, profile)
        recipe.datasets = []
        if overrides:
            recipe.assumptions = [*recipe.assumptions,
                                  f"--base {Path(base).name} changed by --set {', '.join(overrides)}"]
    recipe = recipe or Recipe(name=default_name)
    if name:
        recipe.name = name
    return recipe, inputs
