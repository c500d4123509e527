"""Profiles: fitted, shippable descriptions of one deployment (hardware + model + engine).

A profile is a YAML file holding partial scenario sections (``engine``, ``step_time``,
``speculative``) plus where its numbers came from (``provenance``) and, optionally, the
uncertainty of its fitted coefficients (``step_time_ci``, ``bootstrap``). A scenario names
one with ``profile: PATH`` (relative to the scenario) and overrides any part of it: the
scenario's own keys win, section by section and key by key.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from simcap.config.yaml_files import read_yaml_mapping
from simcap.errors import ScenarioError


class Profile(BaseModel):
    """The file format; sections are validated again as part of the scenario they feed."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)

    name: str
    hardware: str | None = None
    model: str | None = None
    description: str | None = None
    engine: dict[str, Any] = Field(default_factory=dict)
    step_time: dict[str, Any] = Field(default_factory=dict)
    speculative: dict[str, Any] | None = None
    frontend: dict[str, Any] | None = None
    # Per step-time coefficient: [low, high] of its confidence interval.
    step_time_ci: dict[str, tuple[float, float]] | None = None
    # Coefficient sets resampled by the fit (bootstrap), for propagating uncertainty.
    bootstrap: list[dict[str, float]] | None = None
    provenance: dict[str, Any] = Field(default_factory=dict)


SECTIONS = ("engine", "step_time", "speculative", "frontend")


def load_profile(path: str | Path, overrides: list[str] | None = None) -> tuple[Profile, str]:
    """Read and validate a profile file; returns it with the SHA-256 of its bytes.
    ``overrides``: ``dotted.key=value`` changes applied before validation (``--set``)."""
    data, raw = read_yaml_mapping(path, "profile", "name, engine, step_time, ...")
    if overrides:
        from simcap.config.scenario import apply_overrides

        apply_overrides(data, list(overrides))
    try:
        profile = Profile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ScenarioError(f"profile.{where}: {err['msg']} (in {path})") from None
    return profile, hashlib.sha256(raw).hexdigest()


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_profile(data: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """Merge the profile a scenario names under the scenario's own sections.

    Returns the merged scenario data with ``profile`` replaced by a provenance record
    (``{path, name, sha256, ...}``) that results carry. ``speculative: null`` in the scenario
    (or ``--set speculative=null``) removes the profile's speculative section, ``frontend:
    null`` its front end; a null
    ``engine`` or ``step_time`` is refused in one line.
    """
    ref = data.get("profile")
    if ref is None or isinstance(ref, dict):
        return data
    path = (base_dir / str(ref)).resolve()
    profile, digest = load_profile(path)
    merged = dict(data)
    for section in SECTIONS:
        from_profile = getattr(profile, section)
        if from_profile is None:
            continue
        if section == "frontend" and data.get("deployment"):
            continue  # (a fleet runs without one: its router stands in front of its replicas)
        if section in data and data[section] is None:
            # An explicit null removes the profile's section (speculative: null, or
            # --set speculative=null: the same deployment without drafts).
            if section not in ("speculative", "frontend"):
                raise ScenarioError(f"{section}: null: a scenario cannot remove the profile's {section} "
                                    f"section (leave the key out to take it, or give one); only "
                                    "speculative: null and frontend: null remove a section")
            continue
        mine = data.get(section)
        if mine is None:
            merged[section] = dict(from_profile)
        elif isinstance(mine, dict):
            merged[section] = _merge(from_profile, mine)
    merged["profile"] = {
        "path": str(ref),
        "name": profile.name,
        "sha256": digest,
        "hardware": profile.hardware,
        "model": profile.model,
        "fit": profile.provenance.get("fit_method"),
        "simcap_version": profile.provenance.get("simcap_version"),
    }
    overridden = _overridden(profile, data)
    if overridden:
        # The run is not the fitted deployment: say what the scenario changed, and what it
        # still inherits that describes the fitted one (the vLLM version modelled).
        merged["profile"]["overridden"] = overridden
        merged["profile"]["inherited_as_fitted"] = {
            key: value for key, value in (("engine.vllm_version", profile.engine.get("vllm_version")),)
            if value is not None and "vllm_version" not in (data.get("engine") or {})
        }
    return merged


def _overridden(profile: Profile, data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The scenario's changes to what the profile was fitted on: hardware, model and their
    dtypes or parallelism in ``step_time``, ``{key: {"profile": ..., "scenario": ...}}``."""
    mine = data.get("step_time") if isinstance(data.get("step_time"), dict) else {}
    out = {}
    for key in ("hardware", "model", "tensor_parallel_size", "weight_dtype", "expert_weight_dtype",
                "kv_dtype", "compute_dtype"):
        if key in mine and mine[key] != profile.step_time.get(key):
            out[f"step_time.{key}"] = {"profile": profile.step_time.get(key), "scenario": mine[key]}
    return out
