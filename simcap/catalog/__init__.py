"""Hardware and model shapes by name, from the data shipped in this folder.

- ``hardware.yaml``: name -> ``{description, memory_gb, memory_bandwidth_gbps (GB/s, 10**9
  bytes), peak_tflops: {bf16, fp16, fp8, int8, fp32} (dense; null where the chip has none),
  interconnect: {name, bandwidth_gbps (per direction, per GPU), latency_us}, rates: peak
  (datasheet, the default) or measured (a microbenchmark's achieved rates), sources: {field:
  citation}}``.
- ``models/NAME.json``: a Hugging Face ``config.json`` (plus ``_source`` / ``_assumption``
  notes), read by :meth:`simcap.catalog.memory.ModelShape.from_hf_config`.
- ``kernel_classes.yaml``: name -> ``{description, hardware: [names], expert_weight_dtype,
  efficiency: {term: value}, sigma, sources}``: efficiency priors of one software stack and
  weight format on a class of hardware, for roofline fits (``prior: {kernel_class: NAME}``).

The roofline step-time form (:mod:`simcap.engine.step_time`) names one of each, or gives either
inline; every problem is a one-line :class:`ScenarioError` naming the field.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from simcap.catalog.memory import ModelShape, load_hf_config
from simcap.errors import ScenarioError

PEAK_KEYS = ("bf16", "fp16", "fp8", "int8", "fp32")

# dtype name -> (bytes per element, the peak_tflops entry its matrix multiplies run at; None:
# a storage format whose weights are dequantised for the matmuls, which run at compute_dtype).
# MXFP4 (OCP Microscaling Formats v1.0): 4-bit E2M1 elements with one 8-bit E8M0 scale per
# block of 32, 4.25 bits per weight.
DTYPES: dict[str, tuple[float, str | None]] = {
    "bf16": (2, "bf16"), "bfloat16": (2, "bf16"),
    "fp16": (2, "fp16"), "float16": (2, "fp16"), "half": (2, "fp16"),
    "fp8": (1, "fp8"), "fp8_e4m3": (1, "fp8"), "fp8_e5m2": (1, "fp8"),
    "float8_e4m3fn": (1, "fp8"), "float8_e5m2": (1, "fp8"),
    "int8": (1, "int8"),
    "fp32": (4, "fp32"), "float32": (4, "fp32"), "float": (4, "fp32"),
    "mxfp4": (4.25 / 8, None),
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


class Interconnect(_Model):
    """The link between the GPUs of one tensor-parallel group."""

    name: str | None = None
    bandwidth_gbps: float | None = Field(
        None, gt=0.0, description="GB/s per direction, per GPU (null: no link, tp 1 only)."
    )
    latency_us: float | None = Field(None, ge=0.0, description="One hop's latency, microseconds.")


class HardwareSpec(_Model):
    """One accelerator's datasheet figures."""

    description: str | None = None
    memory_gb: float = Field(gt=0.0, description="Memory of one card, GB (10**9 bytes).")
    memory_bandwidth_gbps: float = Field(gt=0.0, description="GB/s (10**9 bytes per second).")
    peak_tflops: dict[str, float | None] = Field(description="Dense peak TFLOPS per dtype.")
    interconnect: Interconnect | None = None
    rates: Literal["peak", "measured"] = Field(
        "peak",
        description="peak: datasheet figures, which no kernel beats (a fitted efficiency is at "
                    "least 1); measured: achieved by a microbenchmark, which real kernels may beat.")
    sources: dict[str, Any] = Field(default_factory=dict)

    @property
    def efficiency_floor(self) -> float:
        """The fitted efficiencies' lower bound these figures allow: 1 for peaks, 0 (none)
        for measured rates."""
        return 1.0 if self.rates == "peak" else 0.0

    def peak_flops(self, key: str, path: str) -> float:
        """FLOP/s of the ``key`` entry (bf16, fp8, ...); a ScenarioError when the chip lacks it."""
        value = self.peak_tflops.get(key)
        if value is None:
            given = ", ".join(k for k, v in self.peak_tflops.items() if v is not None) or "none"
            raise ScenarioError(f"{path}: the hardware has no peak_tflops.{key} (has: {given})")
        return value * 1e12


def _format(exc: ValidationError, path: str) -> str:
    err = exc.errors()[0]
    where = ".".join([path, *(str(p) for p in err["loc"])])
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown key"
    if err["type"] == "missing":
        return f"{where}: required field is missing"
    got = err.get("input")
    shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
    text = err["msg"]
    return f"{where}: {text[0].lower()}{text[1:]}{shown}"


def _root():
    return resources.files(__name__)


@lru_cache(maxsize=1)
def _hardware_table() -> dict[str, Any]:
    entry = _root() / "hardware.yaml"
    if not entry.is_file():
        return {}
    data = yaml.safe_load(entry.read_text()) or {}
    if not isinstance(data, dict):
        raise ScenarioError("catalog hardware.yaml: expected a mapping of names to entries")
    return data


# Roofline efficiency terms a kernel class may give priors for (simcap.engine.step_time's).
KERNEL_CLASS_TERMS = ("weights", "experts", "compute", "attention_prefill", "kv_read", "tp_comm",
                      "tp_latency", "draft")


class KernelClass(_Model):
    """What the kernels of one software stack and weight format achieved on a class of
    hardware: efficiency priors (``kernel_classes.yaml``)."""

    description: str | None = None
    hardware: list[str] = Field(min_length=1, description="Catalog hardware names of the class.")
    expert_weight_dtype: str | None = None
    efficiency: dict[str, float]
    sigma: float = Field(gt=0.0, description="Log-space spread of each prior.")
    sources: str

    def covers(self, hardware: Any, expert_weight_dtype: str | None) -> bool:
        """Whether the class's kernels are what a deployment on ``hardware`` with experts
        stored as ``expert_weight_dtype`` runs."""
        return hardware in self.hardware and self.expert_weight_dtype in (None, expert_weight_dtype)


@lru_cache(maxsize=1)
def _kernel_table() -> dict[str, Any]:
    entry = _root() / "kernel_classes.yaml"
    data = yaml.safe_load(entry.read_text()) if entry.is_file() else {}
    if not isinstance(data, dict):
        raise ScenarioError("catalog kernel_classes.yaml: expected a mapping of names to entries")
    return data or {}


def kernel_class_names() -> list[str]:
    return sorted(_kernel_table())


def resolve_kernel_class(name: Any, path: str = "prior.kernel_class") -> KernelClass:
    """A kernel class of the catalog by name; a ScenarioError naming ``path`` otherwise."""
    table = _kernel_table()
    if not isinstance(name, str) or name not in table:
        raise ScenarioError(f"{path}: unknown kernel class {name!r}; known: {', '.join(sorted(table))}")
    try:
        kc = KernelClass.model_validate(table[name])
    except ValidationError as exc:
        raise ScenarioError(_format(exc, f"catalog kernel class {name}")) from None
    for term, value in kc.efficiency.items():
        if term not in KERNEL_CLASS_TERMS or not value > 0:
            raise ScenarioError(f"catalog kernel class {name}: efficiency.{term}: a roofline term "
                                f"({', '.join(KERNEL_CLASS_TERMS)}) with a value > 0")
    return kc


def hardware_names() -> list[str]:
    return sorted(_hardware_table())


def model_names() -> list[str]:
    folder = _root() / "models"
    if not folder.is_dir():
        return []
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def parse_hardware(data: Any, path: str = "step_time.hardware") -> HardwareSpec:
    """Validate an inline hardware mapping (the catalog's entry format)."""
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: expected a catalog name or a mapping")
    try:
        spec = HardwareSpec.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(_format(exc, path)) from None
    for key, value in spec.peak_tflops.items():
        if key not in PEAK_KEYS:
            raise ScenarioError(f"{path}.peak_tflops.{key}: unknown dtype; allowed: {', '.join(PEAK_KEYS)}")
        if value is not None and not value > 0:
            raise ScenarioError(f"{path}.peak_tflops.{key}: must be > 0 or null (got {value!r})")
    return spec


def resolve_hardware(value: Any, path: str = "step_time.hardware") -> HardwareSpec:
    """A catalog name or an inline mapping -> :class:`HardwareSpec`."""
    if isinstance(value, str):
        table = _hardware_table()
        if value not in table:
            known = ", ".join(hardware_names()) or "(none)"
            raise ScenarioError(f"{path}: unknown hardware {value!r}; known: {known}")
        return parse_hardware(table[value], f"{path} ({value})")
    return parse_hardware(value, path)


def model_config(name: str, path: str = "step_time.model") -> dict[str, Any]:
    """The config.json dict of the catalog model ``name``."""
    entry = _root() / "models" / f"{name}.json"
    if "/" in name or not entry.is_file():
        known = ", ".join(model_names()) or "(none)"
        raise ScenarioError(f"{path}: unknown model {name!r}; known: {known}")
    data = json.loads(entry.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def resolve_model(value: Any, *, kv_dtype: str | None = None,
                  path: str = "step_time.model") -> ModelShape:
    """A catalog name, ``{config: PATH}`` (a config.json), a config.json mapping, or an inline
    :class:`ModelShape` mapping (``num_layers``, ``num_kv_heads``, ...) -> ModelShape.

    ``kv_dtype`` overrides the KV element size of a config.json (its torch_dtype otherwise).
    """
    if isinstance(value, str):
        config = model_config(value, path)
    elif isinstance(value, dict) and set(value) == {"config"}:
        config = load_hf_config(Path(str(value["config"])))
    elif isinstance(value, dict) and "num_layers" in value:
        try:
            return ModelShape.model_validate(value)
        except ValidationError as exc:
            raise ScenarioError(_format(exc, path)) from None
    elif isinstance(value, dict):
        config = value
    else:
        raise ScenarioError(f"{path}: expected a catalog name, {{config: PATH}} or a mapping")
    try:
        return ModelShape.from_hf_config(config, kv_cache_dtype=kv_dtype)
    except ScenarioError as exc:
        raise ScenarioError(f"{path}: {str(exc).removeprefix('model.config: ')}") from None


def dtype_info(name: str, path: str) -> tuple[float, str | None]:
    """(bytes per element, peak_tflops key) of a dtype name such as bf16, fp8, int8, mxfp4
    (key None: a storage format, see ``DTYPES``)."""
    key = name.lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ScenarioError(f"{path}: unknown dtype {name!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[key]
