"""Scenario: the one input of a simulation, as frozen pydantic models loaded from YAML.

A scenario names the engine configuration (vLLM's own flag names), the step-time model,
the workload, the SLO and the seed. ``load_scenario`` reads a YAML file, applies dotted
``key=value`` overrides and validates; every problem becomes a :class:`ScenarioError`
whose message starts with the offending field's dotted path. Validation is strict (a flag is
a boolean, a count an integer: ``max_num_seqs: true`` is refused, not read as 1; numbers are
finite), and :func:`check_limits` refuses a scenario larger than one simulation holds
(``MAX_REQUESTS``, ``MAX_SIMULATED_S``, ...; README, "Limits") before anything is allocated.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_serializer, model_validator,
)

from simcap.catalog.memory import KVPlan, MemorySpec, ModelShape, load_hf_config, plan_kv
from simcap.config.profiles import _merge, apply_profile
from simcap.config.traces import TraceConfig, TraceRequests, load_trace
from simcap.config.yaml_files import load_yaml, read_yaml_mapping
from simcap.errors import ScenarioError

# vLLM releases whose scheduler behaviour simcap models; see ``VERSION_FEATURES``.
VllmVersion = Literal["0.11", "0.23", "0.26", "0.32"]
DEFAULT_VLLM_VERSION: VllmVersion = "0.32"


# --------------------------------------------------------------------------- limits
# What one simulation holds (README, "Limits"). Field bounds refuse larger values as they are
# read; check_limits refuses, from the scenario alone and before anything is allocated, a
# workload that would exceed them (e.g. duration_s x rate expected requests).
MAX_REQUESTS = 10_000_000  # ~200 bytes each in a run's summaries: ~2 GB
MAX_SIMULATED_S = 1.0e7  # ~116 days of arrivals; float64 time still resolves ~2 ns there
MAX_KV_BLOCKS = 2**24  # the KV pool keeps ~70 bytes a block: ~1.2 GB
MAX_TOKENS = 2**24  # per request and per step (max_model_len, lengths, token budget)
MAX_NUM_SEQS = 2**16  # requests in one batch
MAX_CLIENTS = 2**20  # closed-loop clients (one simulated process each)
MAX_INT64 = 2**63 - 1  # seeds and counts stored as int64
# A run that keeps every stream chunk and step (records, steps: ``simulate --plot``) holds
# some 60 bytes per output token: ~1.1 GB at the limit.
MAX_RECORDED_TOKENS = 20_000_000


class _Model(BaseModel):
    # Finite numbers only; parse_scenario also validates strictly (no true -> 1, no "3" -> 3).
    # Validators are built on first use (defer_build), not one per class at import: loading a
    # scenario builds the Scenario's, every section's inside it, once per process.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, defer_build=True)


# --------------------------------------------------------------------------- engine


class EngineConfig(_Model):
    """vLLM engine settings, named as ``vllm serve`` names them."""

    vllm_version: VllmVersion = Field(
        DEFAULT_VLLM_VERSION, description="vLLM release whose V1 scheduler is modelled."
    )
    max_num_seqs: int = Field(256, gt=0, le=MAX_NUM_SEQS)
    max_num_batched_tokens: int = Field(2048, gt=0, le=MAX_TOKENS)
    block_size: int = Field(16, gt=0, le=MAX_TOKENS)
    num_gpu_blocks: int | None = Field(
        None, gt=1, le=MAX_KV_BLOCKS,
        description="KV pool size in blocks (block 0 is reserved); or give memory.",
    )
    memory: MemorySpec | None = Field(
        None, description="Card memory and model shape, from which vLLM's pool size follows."
    )
    max_model_len: int = Field(gt=1, le=MAX_TOKENS)
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = Field(0, ge=0, le=MAX_TOKENS)
    # None: the modelled version's default (see VERSION_FEATURES).
    scheduler_reserve_full_isl: bool | None = None
    watermark: float = Field(0.0, ge=0.0, lt=1.0)
    # None: vLLM's default (simcap.engine.scheduler.resolve_async_scheduling): on for GPUs
    # from 0.14, but with ngram drafts. Set false for the CPU platform (always off there).
    async_scheduling: bool | None = None
    prefill_schedule_interval: int = Field(
        1, ge=1, le=MAX_NUM_SEQS,
        description="Admit new prefills only every Nth engine step (vLLM 0.32, data parallelism).",
    )

    _kv_plan: KVPlan | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _pool_size(self) -> "EngineConfig":
        if (self.num_gpu_blocks is None) == (self.memory is None):
            raise ValueError(
                "engine.num_gpu_blocks: give exactly one of num_gpu_blocks (the pool in blocks) "
                "or memory (card memory and model shape)"
            )
        if self.memory is not None:
            self._kv_plan = plan_kv(
                self.memory,
                block_size=self.block_size,
                max_model_len=self.max_model_len,
                max_num_batched_tokens=self.max_num_batched_tokens,
                require_fit=False,
            )
        return self

    @property
    def num_blocks(self) -> int:
        """The KV pool in blocks: ``num_gpu_blocks``, or what ``memory`` gives on the server."""
        if self._kv_plan is not None:
            return self._kv_plan.num_gpu_blocks
        assert self.num_gpu_blocks is not None
        return self.num_gpu_blocks

    @property
    def kv_plan(self) -> KVPlan | None:
        """The memory breakdown behind the pool, when the pool comes from ``memory``."""
        return self._kv_plan

    @model_validator(mode="after")
    def _version_has_watermark(self) -> "EngineConfig":
        if self.watermark and self.vllm_version in ("0.11", "0.23"):
            raise ValueError(
                f"engine.watermark: vLLM {self.vllm_version} has no admission watermark "
                "(added in 0.24); allowed: 0"
            )
        if self.prefill_schedule_interval > 1 and self.vllm_version != "0.32":
            raise ValueError(
                f"engine.prefill_schedule_interval: vLLM {self.vllm_version} has no prefill "
                "cadence (modelled from 0.32); allowed: 1"
            )
        return self

    @property
    def kv_capacity_tokens(self) -> int:
        """Usable KV tokens: block 0 is vLLM's reserved null block."""
        return (self.num_blocks - 1) * self.block_size


# --------------------------------------------------------------------------- step time


class RooflineEfficiency(_Model):
    """Multipliers of the roofline form's physical terms: 1 = kernels at the roofline, > 1
    slower. Calibration fits them (see engine.step_time)."""

    weights: float = Field(1.0, ge=0.0)
    experts: float = Field(1.0, ge=0.0)
    compute: float = Field(1.0, ge=0.0)
    attention_prefill: float = Field(1.0, ge=0.0)
    kv_read: float = Field(1.0, ge=0.0)
    tp_comm: float = Field(1.0, ge=0.0)
    tp_latency: float = Field(1.0, ge=0.0)
    draft: float = Field(1.0, ge=0.0)


# Keys of the roofline form; a dump leaves them (and an absent noise) out at their defaults,
# so a linear scenario prints and hashes as it did before either existed.
ROOFLINE_KEYS = (
    "form", "combine", "hardware", "model", "weight_dtype", "expert_weight_dtype", "kv_dtype", "compute_dtype",
    "tensor_parallel_size", "expert_parallel", "routing_skew", "draft_model", "efficiency",
    "per_request",
)
LINEAR_KEYS = (
    "per_prefill_token", "per_decode_token", "per_context_token", "per_verify_token",
    "draft_per_pass", "draft_per_request",
)
class EmpiricalNoise(_Model):
    """Measured/predicted forward-time ratios as evenly spaced quantiles (inverse CDF).

    ``quantiles[i]`` is the factor at probability ``i / (n - 1)``; a step's factor is the
    inverse CDF at a uniform draw, linear between neighbouring quantiles. Used as given: a fit
    writes them scaled to mean 1 (see engine.noise), so the noise adds spread, not bias.
    """

    kind: Literal["empirical"]
    quantiles: tuple[float, ...]
    samples: int | None = Field(
        None, ge=0, le=MAX_INT64, description="Steps the quantiles were fitted from."
    )

    @model_validator(mode="after")
    def _check(self) -> "EmpiricalNoise":
        q = self.quantiles
        if len(q) < 2:
            raise ValueError(f"quantiles need at least 2 values (got {len(q)})")
        if any(not math.isfinite(x) or x <= 0.0 for x in q):
            raise ValueError(f"quantiles must be positive and finite factors (got {list(q)})")
        if any(b < a for a, b in zip(q, q[1:])):
            raise ValueError(f"quantiles must be non-decreasing (got {list(q)})")
        return self


class LognormalNoise(_Model):
    """Mean-one lognormal factors: ``exp(N(-sigma^2 / 2, sigma^2))``."""

    kind: Literal["lognormal"]
    sigma: float = Field(ge=0.0, description="Standard deviation of the factor's logarithm.")
    samples: int | None = Field(None, ge=0, le=MAX_INT64, description="Steps sigma was fitted from.")


NoiseDist = Annotated[Union[EmpiricalNoise, LognormalNoise], Field(discriminator="kind")]


class StepNoiseConfig(_Model):
    """Multiplicative noise on the forward time, per step kind (see engine.noise)."""

    decode: NoiseDist | None = Field(None, description="Pure decode steps.")
    prefill: NoiseDist | None = Field(None, description="Steps that compute prompt tokens.")
    spec: NoiseDist | None = Field(
        None, description="Steps that verify drafts (no prompt tokens); None: decode's."
    )


class StepTimeConfig(_Model):
    """Seconds for one engine step: the linear form (default) or the roofline form (see
    engine.step_time)."""

    form: Literal["linear", "roofline"] = Field(
        "linear", description="linear: fitted per-token costs; roofline: bytes and FLOPs."
    )

    base: float = Field(0.004, ge=0.0, description="Fixed cost of a forward pass, s.")
    per_prefill_token: float = Field(1.0e-5, ge=0.0, description="s per prompt token computed.")
    per_decode_token: float = Field(5.0e-5, ge=0.0, description="s per decode token.")
    per_context_token: float = Field(
        0.0, ge=0.0, description="s per KV token attended by the batch (sum of context lengths)."
    )
    mixed_step: float = Field(
        0.0,
        ge=0.0,
        description="Extra s for a step mixing prefill into decodes (graphs cover pure decode only).",
    )
    host_overhead: float = Field(
        0.0, ge=0.0, description="Scheduling and output processing between forwards, s per step."
    )
    per_verify_token: float | None = Field(
        None, ge=0.0, description="s per draft token verified; None: same as per_decode_token."
    )
    draft_per_pass: float = Field(
        0.0, ge=0.0, description="s per sequential draft pass (k passes per step with drafting)."
    )
    draft_per_request: float = Field(
        0.0, ge=0.0, description="s per drafting request per draft pass (grows with the batch)."
    )
    # ---- roofline form
    per_request: float = Field(0.0, ge=0.0, description="roofline: s per scheduled request.")
    combine: Literal["sum", "max"] = Field(
        "sum", description="roofline: add compute and memory terms, or take the larger."
    )
    hardware: str | dict[str, Any] | None = Field(
        None, description="roofline: a catalog hardware name or an inline entry."
    )
    model: str | dict[str, Any] | None = Field(
        None, description="roofline: a catalog model, {config: PATH} or an inline shape."
    )
    weight_dtype: str = Field("bf16", description="roofline: dtype of the weights.")
    expert_weight_dtype: str | None = Field(
        None, description="roofline: dtype of the routed experts (e.g. mxfp4); None: weight_dtype."
    )
    kv_dtype: str | None = Field(None, description="roofline: KV dtype; None: the model's.")
    compute_dtype: str | None = Field(
        None, description="roofline: peak-FLOPs entry of the matmuls; None: weight_dtype's."
    )
    tensor_parallel_size: int = Field(1, gt=0, le=MAX_NUM_SEQS)
    expert_parallel: bool = False
    routing_skew: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="roofline: 0 uniform routing; s: top-k drawn from E*(1-s) experts (>= k).",
    )
    draft_model: str | dict[str, Any] | None = Field(
        None, description="roofline: EAGLE draft shape; None: one dense layer + LM head."
    )
    efficiency: RooflineEfficiency = RooflineEfficiency()
    # ---- either form
    noise: StepNoiseConfig | None = Field(
        None, description="Per-step multiplicative factors on the forward time; None: none."
    )

    _physics: Any = PrivateAttr(None)

    @model_serializer(mode="wrap")
    def _drop_unset_extensions(self, handler):
        data = handler(self)
        fields = StepTimeConfig.model_fields
        for name in (*ROOFLINE_KEYS, "noise"):
            if name in data and getattr(self, name) == fields[name].default:
                del data[name]
        if self.form == "roofline":  # the linear terms play no part
            for name in LINEAR_KEYS:
                data.pop(name, None)
        return data

    @model_validator(mode="after")
    def _roofline(self) -> "StepTimeConfig":
        given = self.model_fields_set
        if self.form == "linear":
            for name in ROOFLINE_KEYS:
                if name in given and name != "form":
                    raise ValueError(f"step_time.{name}: a roofline key; set form: roofline")
            return self
        for name in LINEAR_KEYS:
            if name in given and getattr(self, name) != StepTimeConfig.model_fields[name].default:
                raise ValueError(
                    f"step_time.{name}: a linear-form term; the roofline form has efficiency, "
                    "base, per_request, mixed_step and host_overhead"
                )
        for name in ("hardware", "model"):
            if getattr(self, name) is None:
                raise ValueError(f"step_time.{name}: required with form: roofline")
        from simcap.engine.step_time import RooflinePhysics

        self._physics = RooflinePhysics.from_config(self)
        return self

    @property
    def physics(self):
        """The roofline form's resolved hardware, shapes and per-unit seconds (None: linear)."""
        return self._physics


# --------------------------------------------------------------------------- speculation


class SpeculativeConfig(_Model):
    """``--speculative-config``: method, drafts per step, and measured acceptance.

    Acceptance is given either as vLLM's mean acceptance length (``1 + accepted / drafts``,
    e.g. 2.26), spread over positions with one constant conditional probability, or as
    vLLM's per-position rates ``P(accepted >= i)`` (non-increasing, one per draft position).
    """

    method: Literal["eagle3", "eagle", "ngram"]
    num_speculative_tokens: int = Field(ge=1, le=16)
    acceptance_length: float | None = Field(None, ge=1.0)
    acceptance_rates: tuple[Annotated[float, Field(ge=0.0, le=1.0)], ...] | None = None
    proposal_rate: float = Field(
        1.0, gt=0.0, le=1.0,
        description="ngram: fraction of request-steps whose prompt lookup finds a match.",
    )
    proposal_onset_tokens: int = Field(
        0, ge=0,
        description="ngram: no match before a request has this many output tokens (the lookup "
        "needs the output to repeat); proposal_rate then counts request-steps from there on.",
    )
    proposal_concentration: float | None = Field(
        None, gt=0.0,
        description="ngram: requests differ in how often their content repeats: each request's "
        "match probability is Beta with mean proposal_rate and this concentration (a + b); "
        "small values: some requests match almost always, others almost never. None: every "
        "request matches at proposal_rate.",
    )

    @model_serializer(mode="wrap")
    def _drop_unset_proposals(self, handler):
        data = handler(self)
        # Without an onset or a spread the config dumps (and hashes) as before they existed.
        if self.proposal_onset_tokens == 0:
            data.pop("proposal_onset_tokens", None)
        if self.proposal_concentration is None:
            data.pop("proposal_concentration", None)
        return data

    @model_validator(mode="after")
    def _acceptance(self) -> "SpeculativeConfig":
        k = self.num_speculative_tokens
        if (self.acceptance_length is None) == (self.acceptance_rates is None):
            raise ValueError(
                "speculative.acceptance_length: give exactly one of acceptance_length or "
                "acceptance_rates"
            )
        if self.acceptance_length is not None and self.acceptance_length > k + 1:
            raise ValueError(
                f"speculative.acceptance_length: must be in [1, k+1] = [1, {k + 1}] "
                f"(got {self.acceptance_length})"
            )
        rates = self.acceptance_rates
        if rates is not None:
            if len(rates) != k:
                raise ValueError(
                    f"speculative.acceptance_rates: need one rate per draft position, "
                    f"{k} (got {len(rates)})"
                )
            if any(b > a for a, b in zip(rates, rates[1:])):
                raise ValueError(
                    "speculative.acceptance_rates: per-position rates P(accepted >= i) cannot "
                    f"rise with position (got {list(rates)})"
                )
        if self.method != "ngram" and self.proposal_rate != 1.0:
            raise ValueError("speculative.proposal_rate: only ngram drafts selectively; allowed: 1.0")
        if self.method != "ngram" and self.proposal_onset_tokens:
            raise ValueError(
                "speculative.proposal_onset_tokens: only ngram drafts selectively; allowed: 0 "
                f"for {self.method}"
            )
        if self.method != "ngram" and self.proposal_concentration is not None:
            raise ValueError(
                "speculative.proposal_concentration: only ngram drafts selectively; allowed only "
                f"for ngram (method is {self.method})"
            )
        return self

    @property
    def per_position_rates(self) -> tuple[float, ...]:
        if self.acceptance_rates is not None:
            return self.acceptance_rates
        from simcap.engine.speculative import rates_for_length

        assert self.acceptance_length is not None
        return rates_for_length(self.acceptance_length, self.num_speculative_tokens)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots reserved ahead of each request: k for EAGLE methods, 0 for ngram."""
        return self.num_speculative_tokens if self.method != "ngram" else 0


# --------------------------------------------------------------------------- front end


class FrontendConfig(_Model):
    """What the serving front end adds between the client and the engine: vLLM's API server
    (HTTP, request processing, the round trip to the engine core, output processing,
    streaming) and the client's own loop (:mod:`simcap.simulation.frontend`).

    A request reaches the engine's waiting queue ``arrival_s`` after it was sent; a step that
    emits ``n`` chunks delivers them ``output_s + n * per_chunk_s`` after it ends. Fitted by
    ``simcap live calibrate`` from the server's request histograms, its step log and the
    client's records.
    """

    arrival_s: float = Field(0.0, ge=0.0, le=60.0, description="send -> the engine's waiting queue, s")
    output_s: float = Field(0.0, ge=0.0, le=60.0, description="step end -> its chunks at the clients, s")
    per_chunk_s: float = Field(
        0.0, ge=0.0, le=1.0,
        description="s more per chunk the step emits (its outputs are processed before any is streamed)",
    )

    @property
    def active(self) -> bool:
        return bool(self.arrival_s or self.output_s or self.per_chunk_s)


# --------------------------------------------------------------------------- workload


class PoissonArrival(_Model):
    process: Literal["poisson"]
    rate: float = Field(gt=0.0, description="requests per second")


class GammaArrival(_Model):
    process: Literal["gamma"]
    rate: float = Field(gt=0.0, description="requests per second")
    burstiness: float = Field(1.0, gt=0.0, description="gamma shape; 1 is Poisson, <1 burstier")


class ClosedArrival(_Model):
    process: Literal["closed"]
    concurrency: int = Field(
        gt=0, le=MAX_CLIENTS, description="clients, each with one request in flight"
    )
    think_time_s: float = Field(0.0, ge=0.0, le=MAX_SIMULATED_S)


Arrival = Annotated[
    Union[PoissonArrival, GammaArrival, ClosedArrival], Field(discriminator="process")
]


class FixedLength(_Model):
    dist: Literal["fixed"]
    value: int = Field(gt=0, le=MAX_TOKENS)

    @property
    def min_value(self) -> int:
        return self.value

    @property
    def max_value(self) -> int:
        return self.value


class UniformLength(_Model):
    """Integers uniform on [low, high], both included."""

    dist: Literal["uniform"]
    low: int = Field(gt=0, le=MAX_TOKENS)
    high: int = Field(gt=0, le=MAX_TOKENS)

    @model_validator(mode="after")
    def _ordered(self) -> "UniformLength":
        if self.high < self.low:
            raise ValueError(f"high must be >= low (got low={self.low}, high={self.high})")
        return self

    @property
    def min_value(self) -> int:
        return self.low

    @property
    def max_value(self) -> int:
        return self.high


class EmpiricalLength(_Model):
    """Lengths drawn with replacement from a list, given inline or as a file of numbers."""

    dist: Literal["empirical"]
    values: tuple[Annotated[int, Field(gt=0, le=MAX_TOKENS)], ...] = Field(min_length=1)

    @property
    def min_value(self) -> int:
        return min(self.values)

    @property
    def max_value(self) -> int:
        return max(self.values)


def _length_shorthand(value: Any) -> Any:
    if isinstance(value, bool):
        return value  # let validation reject it
    if isinstance(value, int):
        return {"dist": "fixed", "value": value}
    if isinstance(value, dict) and isinstance(value.get("values"), list):
        # This runs before validation, which then sees Python objects: a strict tuple field
        # takes a tuple, not the list a YAML or JSON array parsed into.
        return {**value, "values": tuple(value["values"])}
    return value


Length = Annotated[
    Union[FixedLength, UniformLength, EmpiricalLength], Field(discriminator="dist")
]


class PrefixSharing(_Model):
    """Requests open with one of ``num_prefixes`` shared prefixes (a system prompt)."""

    shared_tokens: int = Field(
        gt=0, le=MAX_TOKENS, description="tokens of the shared prefix, counted in input_len"
    )
    num_prefixes: int = Field(1, gt=0, le=MAX_REQUESTS)


class FixedSeconds(_Model):
    dist: Literal["fixed"]
    value: float = Field(ge=0.0, le=MAX_SIMULATED_S)

    @property
    def mean(self) -> float:
        return self.value


class UniformSeconds(_Model):
    """Seconds uniform on [low, high]."""

    dist: Literal["uniform"]
    low: float = Field(ge=0.0, le=MAX_SIMULATED_S)
    high: float = Field(ge=0.0, le=MAX_SIMULATED_S)

    @model_validator(mode="after")
    def _ordered(self) -> "UniformSeconds":
        if self.high < self.low:
            raise ValueError(f"high must be >= low (got low={self.low}, high={self.high})")
        return self

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2.0


class ExponentialSeconds(_Model):
    """Seconds drawn from an exponential distribution of the given mean."""

    dist: Literal["exponential"]
    mean_s: float = Field(gt=0.0, le=MAX_SIMULATED_S)

    @property
    def mean(self) -> float:
        return self.mean_s


class EmpiricalSeconds(_Model):
    """Seconds drawn with replacement from a list."""

    dist: Literal["empirical"]
    values: tuple[Annotated[float, Field(ge=0.0, le=MAX_SIMULATED_S)], ...] = Field(min_length=1)

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)


def _seconds_shorthand(value: Any) -> Any:
    if isinstance(value, bool):
        return value  # let validation reject it
    if isinstance(value, (int, float)):
        return {"dist": "fixed", "value": float(value)}
    if isinstance(value, dict) and isinstance(value.get("values"), list):
        return {**value, "values": tuple(value["values"])}
    return value


Seconds = Annotated[
    Union[FixedSeconds, UniformSeconds, ExponentialSeconds, EmpiricalSeconds],
    Field(discriminator="dist"),
]


class SessionsConfig(_Model):
    """Multi-turn sessions (conversations, agent loops): see :mod:`simcap.workloads.sessions`.

    Each turn's prompt is the whole conversation so far (every earlier turn's new tokens and
    answer) plus the turn's new tokens (``workload.input_len``; the first turn's from
    ``first_input_len`` when given); its answer is ``workload.output_len`` tokens. The next
    turn is sent ``think_time_s`` after the answer's last token. ``workload.prefix``, when
    given, opens every session's first turn with one of the shared prefixes (a system prompt
    and tool definitions, counted in the first turn's new tokens), kept when a turn is
    truncated. ``workload.arrival`` paces sessions: ``rate`` is sessions per second, a closed loop's ``concurrency`` is sessions in
    flight (its ``think_time_s`` is the pause between one session's end and the client's next).
    """

    num_sessions: int | None = Field(
        None, gt=0, le=MAX_REQUESTS, description="sessions in the run; or give workload.duration_s"
    )
    turns: Length = Field(description="turns per session")
    first_input_len: Length | None = Field(
        None, description="new tokens of a session's first turn; None: workload.input_len"
    )
    think_time_s: Seconds = Field(
        FixedSeconds(dist="fixed", value=0.0),
        description="seconds from an answer's last token to the next turn (think or tool time)",
    )
    on_overflow: Literal["truncate", "end"] = Field(
        "truncate",
        description="a turn whose prompt + answer would exceed max_model_len: drop the oldest "
        "turns from its prompt (truncate) or end the session there (end)",
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthands(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            for key in ("turns", "first_input_len"):
                if key in data:
                    data[key] = _length_shorthand(data[key])
            if "think_time_s" in data:
                data["think_time_s"] = _seconds_shorthand(data["think_time_s"])
        return data


class WorkloadConfig(_Model):
    """Arrivals and lengths: synthetic (arrival, input_len, output_len, a stop rule), or the
    requests of a public trace (``trace``, :mod:`simcap.config.traces`), sent at its own times or,
    with ``arrival``, by that process."""

    arrival: Arrival | None = None
    num_requests: int | None = Field(None, gt=0, le=MAX_REQUESTS)
    duration_s: float | None = Field(None, gt=0.0, le=MAX_SIMULATED_S)
    input_len: Length | None = None
    output_len: Length | None = None
    prefix: PrefixSharing | None = None
    trace: TraceConfig | None = None
    sessions: SessionsConfig | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_sections(self, handler):
        data = handler(self)
        # A dump (and digest) of a scenario without sessions or a trace is unchanged.
        for key in ("sessions", "trace"):
            if getattr(self, key) is None:
                data.pop(key, None)
        return data

    @model_validator(mode="before")
    @classmethod
    def _shorthands(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            for key in ("input_len", "output_len"):
                if key in data:
                    data[key] = _length_shorthand(data[key])
            trace = data.get("trace")
            if isinstance(trace, dict) and trace and not {"format", "path"} & set(trace):
                raise ValueError(
                    f"workload.trace: {', '.join(sorted(map(str, trace)))} given, but no trace to "
                    "replay; give workload.trace.format and workload.trace.path"
                )
        return data

    @model_validator(mode="after")
    def _one_stop_rule(self) -> "WorkloadConfig":
        if self.trace is not None:
            for name in ("input_len", "output_len", "prefix", "sessions", "num_requests", "duration_s"):
                if getattr(self, name) is not None:
                    where = {"num_requests": "; slice it with workload.trace.num_requests",
                             "duration_s": "; slice it with workload.trace.start_s / duration_s"}
                    raise ValueError(
                        f"workload.{name}: not with workload.trace, whose rows give the "
                        f"requests{where.get(name, '')}"
                    )
            if self.arrival is None and not self.trace.timed:
                raise ValueError(
                    f"workload.arrival: a {self.trace.format} file has no timestamps; give an "
                    "arrival process (poisson, gamma or closed) to send its requests"
                )
            if self.arrival is not None and self.trace.speedup != 1.0:
                raise ValueError(
                    "workload.trace.speedup: workload.arrival sends the requests, not the "
                    "trace's timestamps; drop one of them"
                )
            return self
        for name in ("arrival", "input_len", "output_len"):
            if getattr(self, name) is None:
                raise ValueError(f"workload.{name}: required field is missing (or give workload.trace)")
        if self.sessions is not None:
            if self.num_requests is not None:
                raise ValueError(
                    "workload.num_requests: a session workload counts sessions; give "
                    "workload.sessions.num_sessions or workload.duration_s"
                )
            if (self.sessions.num_sessions is None) == (self.duration_s is None):
                raise ValueError(
                    "workload.sessions.num_sessions: give exactly one of "
                    "sessions.num_sessions or workload.duration_s"
                )
            return self
        if (self.num_requests is None) == (self.duration_s is None):
            raise ValueError("give exactly one of num_requests or duration_s")
        return self

    @property
    def trace_requests(self) -> TraceRequests | None:
        """The loaded trace's requests, or None for a synthetic workload."""
        return self.trace.requests if self.trace is not None else None

    @property
    def max_input_len(self) -> int:
        t = self.trace_requests
        if t is not None:
            return int(t.input_lens.max())
        assert self.input_len is not None
        return self.input_len.max_value

    @property
    def max_output_len(self) -> int:
        t = self.trace_requests
        if t is not None:
            return int(t.output_lens.max())
        assert self.output_len is not None
        return self.output_len.max_value

    @property
    def max_request_len(self) -> int:
        """The most tokens (prompt + output) one request can reach."""
        t = self.trace_requests
        if t is not None:
            return int((t.input_lens + t.output_lens).max())
        return self.max_input_len + self.max_output_len

    @property
    def min_output_len(self) -> int:
        t = self.trace_requests
        if t is not None:
            return int(t.output_lens.min())
        assert self.output_len is not None
        return self.output_len.min_value

    @property
    def mean_output_len(self) -> float:
        t = self.trace_requests
        if t is not None:
            return float(t.output_lens.mean())
        assert self.output_len is not None
        return _mean_length(self.output_len)


# --------------------------------------------------------------------------- SLO

SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
SLO_STATS = ("mean", "p50", "p90", "p95", "p99")


class ProfileRef(_Model):
    """Which profile a scenario was built on (filled in when the profile is merged)."""

    path: str
    name: str
    sha256: str
    hardware: str | None = None
    model: str | None = None
    fit: str | None = None
    simcap_version: str | None = None
    # What the scenario changed of the fitted deployment ({"step_time.hardware": {"profile":
    # ..., "scenario": ...}}), and what it still takes from the profile that describes the
    # fitted one ({"engine.vllm_version": "0.26"}); None when it changed none of it.
    overridden: dict[str, dict[str, Any]] | None = None
    inherited_as_fitted: dict[str, Any] | None = None


# --------------------------------------------------------------------------- deployment

# Router policies (simcap.fleet.router); each named after its counterpart in a real router.
ROUTERS = ("roundrobin", "least_request", "kv_cache_utilization", "session", "prefix_cache")
# The prefix_cache router's scorers and their default weights (llm-d's default profile
# weighs its prefix-cache scorer 3 and its queue scorer 2).
PREFIX_CACHE_WEIGHTS = {"prefix_cache": 3.0, "queue": 2.0, "kv_cache_utilization": 0.0}
GROUP_SECTIONS = ("engine", "step_time", "speculative")


class ReplicaGroup(_Model):
    """Replicas sharing one configuration: the scenario's, with these sections merged over it
    (a ``profile`` is merged first, as for the scenario itself)."""

    replicas: int = Field(gt=0, le=MAX_NUM_SEQS)
    name: str | None = None
    profile: ProfileRef | None = None
    engine: dict[str, Any] | None = None
    step_time: dict[str, Any] | None = None
    speculative: dict[str, Any] | None = None


class KVTransfer(_Model):
    """The link a finished prefill's KV crosses to its decode replica."""

    bandwidth_gbps: float = Field(gt=0.0, description="GB/s (1e9 bytes) per transfer")
    latency_s: float = Field(0.0, ge=0.0, le=MAX_SIMULATED_S)
    kv_bytes_per_token: int | None = Field(
        None, gt=0, le=MAX_TOKENS * 1024,
        description="default: engine.memory's model shape (all layers, every KV head once)",
    )


class Pool(_Model):
    """One pool of a disaggregated deployment: its replicas and their own sections."""

    replicas: int = Field(gt=0, le=MAX_NUM_SEQS)
    profile: ProfileRef | None = None
    engine: dict[str, Any] | None = None
    step_time: dict[str, Any] | None = None
    speculative: dict[str, Any] | None = None


class Disaggregated(_Model):
    """Prefill and decode pools (vLLM's disaggregated serving behind a P/D proxy)."""

    prefill: Pool
    decode: Pool
    kv_transfer: KVTransfer


class DeploymentConfig(_Model):
    """Replicas behind a router, all on one clock (simcap.fleet.replicas)."""

    replicas: int | None = Field(None, gt=0, le=MAX_NUM_SEQS)
    router: str = "roundrobin"
    scrape_interval_s: float = Field(1.0, gt=0.0, le=MAX_SIMULATED_S)
    weights: dict[str, float] | None = Field(
        None, description="prefix_cache router: weight of each scorer, >= 0"
    )
    groups: list[ReplicaGroup] | None = None
    disaggregated: Disaggregated | None = None

    @model_validator(mode="after")
    def _check(self) -> "DeploymentConfig":
        if self.disaggregated is not None and (self.groups is not None or self.replicas is not None):
            raise ValueError(
                "deployment.disaggregated: its pools give the replicas; leave replicas and "
                "groups out"
            )
        if self.router not in ROUTERS:
            raise ValueError(
                f"deployment.router: unknown router {self.router!r}; known: {', '.join(ROUTERS)}"
            )
        if self.weights is not None:
            if self.router != "prefix_cache":
                raise ValueError("deployment.weights: only the prefix_cache router has weights")
            for key, value in self.weights.items():
                if key not in PREFIX_CACHE_WEIGHTS:
                    raise ValueError(
                        f"deployment.weights.{key}: unknown scorer; known: "
                        f"{', '.join(PREFIX_CACHE_WEIGHTS)}"
                    )
                if not value >= 0.0:
                    raise ValueError(f"deployment.weights.{key}: must be >= 0 (got {value!r})")
            if not any(self.weights.values()):
                raise ValueError("deployment.weights: at least one weight must be > 0")
        if self.groups is not None:
            if not self.groups:
                raise ValueError("deployment.groups: give at least one group, or leave it out")
            total = sum(g.replicas for g in self.groups)
            if self.replicas is not None and self.replicas != total:
                raise ValueError(
                    f"deployment.replicas: {self.replicas} but the groups have {total} replicas; "
                    "give one or make them agree"
                )
        return self

    @property
    def num_replicas(self) -> int:
        if self.disaggregated is not None:
            return self.disaggregated.prefill.replicas + self.disaggregated.decode.replicas
        if self.groups is not None:
            return sum(g.replicas for g in self.groups)
        return 1 if self.replicas is None else self.replicas

    @property
    def scorer_weights(self) -> dict[str, float]:
        """The prefix_cache router's weights: the defaults, overridden by ``weights``."""
        return {**PREFIX_CACHE_WEIGHTS, **(self.weights or {})}


class Scenario(_Model):
    """Everything a simulation needs; the same scenario and seed give the same bytes out."""

    name: str | None = None
    profile: ProfileRef | None = None
    engine: EngineConfig
    step_time: StepTimeConfig = StepTimeConfig()
    speculative: SpeculativeConfig | None = None
    frontend: FrontendConfig | None = Field(
        None, description="the API server and client between the engine and the user; None: none"
    )
    workload: WorkloadConfig
    slo: dict[str, Annotated[float, Field(gt=0.0)]] = Field(
        default_factory=dict, description="e.g. {ttft_p95: 2.0, tpot_p95: 0.05}, seconds"
    )
    seed: int = Field(0, ge=0, le=MAX_INT64)
    deployment: DeploymentConfig | None = Field(
        None, description="replicas behind a router; None: one engine (simcap.fleet.replicas)"
    )

    @model_serializer(mode="wrap")
    def _drop_no_deployment(self, handler):
        data = handler(self)
        if self.deployment is None:  # a one-engine scenario dumps (and hashes) as before
            data.pop("deployment", None)
        if self.frontend is None:  # so does one without a front end
            data.pop("frontend", None)
        return data

    @model_validator(mode="after")
    def _async_drafts(self) -> "Scenario":
        spec = self.speculative
        if self.engine.async_scheduling and spec is not None and spec.method == "ngram":
            raise ValueError(
                "engine.async_scheduling: vLLM refuses async scheduling with ngram drafts (its "
                "proposer runs on the CPU between steps); allowed with ngram: false or unset"
            )
        return self

    @model_validator(mode="after")
    def _frontend_alone(self) -> "Scenario":
        if self.frontend is not None and self.frontend.active and self.deployment is not None:
            raise ValueError(
                "frontend: modelled for one engine; a deployment's router stands in front of its "
                "replicas (allowed: frontend: null with a deployment)"
            )
        return self

    @model_validator(mode="after")
    def _slo_keys(self) -> "Scenario":
        allowed = [f"{m}_{s}" for m in SLO_METRICS for s in SLO_STATS]
        for key in self.slo:
            if key not in allowed:
                raise ValueError(
                    f"slo.{key}: unknown SLO; allowed: METRIC_STAT with METRIC in "
                    f"{', '.join(SLO_METRICS)} and STAT in {', '.join(SLO_STATS)}"
                )
        return self

    _profile_file: Path | None = PrivateAttr(None)

    @property
    def profile_file(self) -> Path | None:
        """The profile file this scenario was merged with (for its coefficient intervals)."""
        return self._profile_file

    @property
    def step_time_given(self) -> bool:
        """Whether the step-time model was chosen rather than defaulted: a ``step_time``
        section or a profile (a fleet's: its own, or each replica group's or pool's). False:
        the illustrative default coefficients stand in, which no measurement backs."""
        if "step_time" in self.model_fields_set or self.profile is not None:
            return True
        d = self.deployment
        if d is None:
            return False
        parts = [d.disaggregated.prefill, d.disaggregated.decode] if d.disaggregated else (d.groups or [])
        return bool(parts) and all(p.step_time is not None or p.profile is not None for p in parts)

    def digest(self) -> str:
        """SHA-256 of the canonical JSON form: names this exact scenario in results (a trace
        by its file's content, not by where it was read from)."""
        data = self.model_dump(mode="json")
        profile = data.get("profile")
        if profile:  # (fields added later name a scenario only when set: older digests hold)
            for key in ("overridden", "inherited_as_fitted"):
                if profile.get(key) is None:
                    profile.pop(key, None)
        if self.workload.trace is not None:
            data["workload"]["trace"]["path"] = "sha256:" + self.workload.trace.requests.summary["sha256"]
        text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


# --------------------------------------------------------------------------- loading


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` overrides; values are parsed as YAML (``3``, ``true``, ``[1,2]``)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ScenarioError(f"--set {item!r}: expected dotted.key=value")
        try:
            value = load_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ScenarioError(
                    f"{'.'.join(parts[: i + 1])}: is a value, not a section; cannot set {key}"
                )
            node = child
        node[parts[-1]] = value
    return data


def _resolve_files(data: dict[str, Any], base_dir: Path) -> None:
    """Read files a scenario names (paths relative to it) into the data they stand for.

    ``{dist: empirical, file: F}`` lengths become values; ``engine.memory.model: {hf_config:
    F, kv_cache_dtype, draft_layers}`` becomes the model shape read from a config.json;
    ``step_time.model: {config: F}`` (and ``draft_model``) the config.json's contents.
    """
    memory = (data.get("engine") or {}).get("memory") if isinstance(data.get("engine"), dict) else None
    model = memory.get("model") if isinstance(memory, dict) else None
    if isinstance(model, dict) and "hf_config" in model:
        extra = set(model) - {"hf_config", "kv_cache_dtype", "draft_layers"}
        if extra:
            raise ScenarioError(
                f"engine.memory.model.{sorted(extra)[0]}: unknown key next to hf_config; "
                "allowed: hf_config, kv_cache_dtype, draft_layers"
            )
        config = load_hf_config(base_dir / str(model["hf_config"]))
        shape = ModelShape.from_hf_config(
            config,
            kv_cache_dtype=model.get("kv_cache_dtype"),
            draft_layers=int(model.get("draft_layers", 0)),
        )
        # The KV fields only: the memory plan needs no more (and its dump stays as it was).
        memory["model"] = shape.model_dump(
            include={"num_layers", "num_kv_heads", "head_size", "dtype_bytes", "draft_layers"}
        )
    step_time = data.get("step_time")
    for key in ("model", "draft_model"):
        spec = step_time.get(key) if isinstance(step_time, dict) else None
        if isinstance(spec, dict) and set(spec) == {"config"}:
            try:
                step_time[key] = load_hf_config(base_dir / str(spec["config"]))
            except ScenarioError as exc:
                raise ScenarioError(f"step_time.{key}.config: {str(exc).split(': ', 1)[1]}") from None
    workload = data.get("workload")
    if not isinstance(workload, dict):
        return
    trace = workload.get("trace")
    if isinstance(trace, dict) and isinstance(trace.get("path"), str) and trace["path"]:
        workload["trace"] = {**trace, "path": str(base_dir / trace["path"])}
    for key in ("input_len", "output_len"):
        spec = workload.get(key)
        if isinstance(spec, dict) and "file" in spec:
            spec = dict(spec)
            path = base_dir / str(spec.pop("file"))
            try:
                text = path.read_text()
            except OSError as exc:
                raise ScenarioError(f"workload.{key}.file: cannot read {path}: {exc.strerror}")
            try:
                spec["values"] = [int(tok) for tok in text.replace(",", " ").split()]
            except ValueError:
                raise ScenarioError(
                    f"workload.{key}.file: {path} must hold whole numbers separated by "
                    "spaces, commas or newlines"
                ) from None
            workload[key] = spec


def _field_names(loc: tuple[Any, ...], root: Any = None) -> list[str] | None:
    """The keys allowed at the section ``loc`` of a scenario (or of the model ``root``), for
    'unknown key' messages."""
    model: Any = root or Scenario
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        model = field.annotation
        args = getattr(model, "__args__", ())
        if args:  # Optional[X] / Union: pick the model member whose tag we cannot see
            models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
            model = models[0] if len(models) == 1 else None
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return None


_SIZE_LIMITS = {MAX_REQUESTS, MAX_SIMULATED_S, MAX_KV_BLOCKS, MAX_TOKENS, MAX_NUM_SEQS, MAX_CLIENTS}
_TAGS = {"poisson", "gamma", "closed", "fixed", "uniform", "empirical", "lognormal", "exponential"}


def format_validation_error(exc: ValidationError, root: Any = None) -> str:
    """One line: the first error's dotted field path, what is wrong and what is allowed.
    ``root``: the model validated (default :class:`Scenario`), for the allowed keys."""
    err = exc.errors()[0]
    loc = tuple(p for p in err["loc"] if p not in _TAGS)
    path = ".".join(str(p) for p in loc) or "scenario"
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = _field_names(loc[:-1], root)
        hint = f"; allowed keys: {', '.join(allowed)}" if allowed else ""
        msg = f"{path}: unknown key{hint}"
    elif kind == "missing":
        msg = f"{path}: required field is missing"
    elif kind == "union_tag_invalid":
        msg = f"{path}: {err['msg']}"
    elif kind == "less_than_equal" and err["ctx"]["le"] in _SIZE_LIMITS:
        le = err["ctx"]["le"]
        msg = (f"{path}: must be <= {f'{le:,}' if isinstance(le, int) else f'{le:g}'}, the most "
               f"one simulation holds (README, Limits) (got {err['input']!r})")
    else:
        text = err["msg"]
        if text.startswith("Value error, "):
            text = text[len("Value error, ") :]
            if text.startswith(path.split(".")[0] + ".") or ":" in text.split(" ")[0]:
                return text  # the validator already named its field
        got = err.get("input")
        shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
        msg = f"{path}: {text[0].lower() + text[1:]}{shown}"
    extra = len(exc.errors()) - 1
    return msg + (f" [and {extra} more problem{'s' if extra > 1 else ''}]" if extra else "")


def parse_scenario(data: Any, *, base_dir: Path | None = None, check: bool = True) -> Scenario:
    """Validate a scenario given as a dict (e.g. parsed YAML) and check it is feasible.

    ``check=False`` skips :func:`check_feasible`, for questions about an infeasible
    configuration itself (e.g. "does 128K context fit?").
    """
    if not isinstance(data, dict):
        raise ScenarioError("scenario: expected a mapping of sections (engine, workload, ...)")
    data = json.loads(json.dumps(data))  # deep copy; rejects non-JSON values early
    base_dir = base_dir or Path.cwd()
    profile_ref = data.get("profile")
    data = apply_profile(data, base_dir)
    _resolve_files(data, base_dir)
    _resolve_group_profiles(data, base_dir)
    try:  # strict: a bool is no count, a string no number (YAML has typed them already)
        scenario = Scenario.model_validate_json(json.dumps(data), strict=True)
    except ValidationError as exc:
        raise ScenarioError(format_validation_error(exc)) from None
    if isinstance(profile_ref, str):
        scenario._profile_file = (base_dir / profile_ref).resolve()
    if scenario.workload.trace is not None:
        load_trace(scenario.workload.trace, max_model_len=scenario.engine.max_model_len,
                   own_times=scenario.workload.arrival is None)
    if check:
        check_feasible(scenario)
        replica_scenarios(scenario)  # each replica group's configuration must be one too
    return scenario


def _resolve_group_profiles(data: dict[str, Any], base_dir: Path) -> None:
    """A replica group naming a profile file gets it merged under its own sections."""
    deployment = data.get("deployment")
    if not isinstance(deployment, dict):
        return
    groups = deployment.get("groups")
    places = [(groups, i, f"deployment.groups.{i}") for i in range(len(groups))] if isinstance(groups, list) else []
    pools = deployment.get("disaggregated")
    if isinstance(pools, dict):
        places += [(pools, k, f"deployment.disaggregated.{k}") for k in ("prefill", "decode")]
    for holder, key, where in places:
        group = holder.get(key) if isinstance(holder, dict) else holder[key]
        if isinstance(group, dict) and isinstance(group.get("profile"), str):
            try:
                holder[key] = apply_profile(group, base_dir)
            except ScenarioError as exc:
                raise ScenarioError(f"{where}.profile: {exc}") from None


def replica_scenarios(scenario: Scenario) -> list[tuple[str | None, Scenario]]:
    """Each replica's (group name, configuration): the scenario itself for every replica, or
    per group the scenario with the group's sections merged over it. Their ``deployment`` is
    None; the workload, SLO and seed stay the scenario's. A group whose configuration is not
    valid or feasible is a ScenarioError naming ``deployment.groups.I``."""
    dep = scenario.deployment
    if dep is None:
        return [(None, scenario)]
    if getattr(scenario.workload, "sessions", None) is not None:
        raise ScenarioError(
            "deployment: a session workload (workload.sessions) runs on one engine; fleets "
            "of multi-turn sessions are not modelled yet"
        )
    if dep.groups is None and dep.disaggregated is None:
        one = scenario.model_copy(update={"deployment": None})
        return [(None, one)] * dep.num_replicas
    base = scenario.model_dump(mode="json")
    base.pop("deployment", None)
    out: list[tuple[str | None, Scenario]] = []
    if dep.disaggregated is not None:
        pools = [("prefill", dep.disaggregated.prefill), ("decode", dep.disaggregated.decode)]
        where = "deployment.disaggregated.{}"
    else:
        pools = [(g.name, g) for g in dep.groups or []]
        where = "deployment.groups.{}"
    for i, (name, group) in enumerate(pools):
        data = dict(base)
        for section in GROUP_SECTIONS:
            mine = getattr(group, section)
            if mine is not None:
                data[section] = _merge(data.get(section) or {}, mine)
        if group.profile is not None:
            data["profile"] = group.profile.model_dump()
        try:
            one = Scenario.model_validate_json(json.dumps(data), strict=True)
            check_feasible(one)
        except ValidationError as exc:
            at = where.format(name if dep.disaggregated is not None else i)
            raise ScenarioError(f"{at}.{format_validation_error(exc)}") from None
        except ScenarioError as exc:
            at = where.format(name if dep.disaggregated is not None else i)
            raise ScenarioError(f"{at}.{exc}") from None
        out += [(name, one)] * group.replicas
    if dep.disaggregated is not None and dep.disaggregated.kv_transfer.kv_bytes_per_token is None:
        if scenario.engine.memory is None:
            raise ScenarioError(
                "deployment.disaggregated.kv_transfer.kv_bytes_per_token: required without "
                "engine.memory (whose model shape gives it)"
            )
    return out


def kv_transfer_bytes_per_token(scenario: Scenario) -> int:
    """KV bytes a token of a disaggregated deployment's prefill moves to its decode replica."""
    dep = scenario.deployment
    assert dep is not None and dep.disaggregated is not None
    given = dep.disaggregated.kv_transfer.kv_bytes_per_token
    if given is not None:
        return given
    assert scenario.engine.memory is not None
    return scenario.engine.memory.model.kv_bytes_per_token_total()


def load_scenario(
    path: str | Path, overrides: list[str] | None = None, *, check: bool = True,
    profile: str | Path | None = None,
) -> Scenario:
    """Read a YAML scenario, apply ``--set`` style overrides, validate it.

    ``profile``: merge this profile instead of the one the scenario names, its step-time
    model in place of the scenario's own ``step_time`` section (a prediction from that
    profile; ``--set step_time.KEY=...`` still applies).
    """
    path = Path(path)
    data, _ = read_yaml_mapping(path, "scenario", "sections (engine, workload, ...)")
    if profile is not None:
        data.pop("step_time", None)
        data["profile"] = str(Path(profile).resolve())
    apply_overrides(data, list(overrides or []))
    return parse_scenario(data, base_dir=path.parent, check=check)


def check_feasible(scenario: Scenario) -> None:
    """Reject configurations the engine could never serve, or one simulation could not hold
    (:func:`check_limits`), naming the field at fault."""
    check_limits(scenario)
    eng, wl = scenario.engine, scenario.workload
    max_in, max_out = wl.max_input_len, wl.max_output_len
    if wl.sessions is not None:
        _check_sessions_fit(scenario)
        max_in = max_session_context(wl) - max_out
    if wl.sessions is not None and wl.prefix is not None:
        first_len = wl.sessions.first_input_len or wl.input_len
        assert first_len is not None
        if wl.prefix.shared_tokens >= first_len.min_value:
            key = "sessions.first_input_len" if wl.sessions.first_input_len is not None else "input_len"
            raise ScenarioError(
                f"workload.prefix.shared_tokens: must be < the shortest first turn "
                f"(workload.{key}: {first_len.min_value}), got {wl.prefix.shared_tokens}"
            )
    if wl.sessions is None and wl.prefix is not None and wl.input_len is not None and wl.prefix.shared_tokens >= wl.input_len.min_value:
        raise ScenarioError(
            f"workload.prefix.shared_tokens: must be < the shortest input_len "
            f"({wl.input_len.min_value}), got {wl.prefix.shared_tokens}"
        )
    longest = wl.max_request_len if wl.sessions is None else max_in + max_out
    if wl.sessions is None and longest > eng.max_model_len:
        raise ScenarioError(
            f"workload.input_len: prompt ({max_in}) + output ({max_out}) tokens exceed "
            f"engine.max_model_len ({eng.max_model_len}); vLLM rejects such a request"
        )
    # EAGLE also reserves k lookahead slots per request (capped at max_model_len).
    lookahead = scenario.speculative.num_lookahead_tokens if scenario.speculative else 0
    need = min(longest + lookahead, eng.max_model_len)
    if eng.kv_capacity_tokens < need:
        raise ScenarioError(
            f"{'engine.num_gpu_blocks' if eng.memory is None else 'engine.memory'}: a KV pool of "
            f"{eng.kv_capacity_tokens} tokens (({eng.num_blocks} - 1) x {eng.block_size}) can "
            f"never hold one request of {need} tokens; need at least "
            f"{math.ceil(need / eng.block_size) + 1} blocks"
        )


def max_session_context(wl: WorkloadConfig) -> int:
    """The longest prompt + answer a session turn can reach before ``max_model_len`` caps it:
    a first turn and then every turn at its longest."""
    sessions = wl.sessions
    assert sessions is not None
    first = (sessions.first_input_len or wl.input_len).max_value
    out = wl.output_len.max_value
    return first + out + (sessions.turns.max_value - 1) * (wl.input_len.max_value + out)


def _check_sessions_fit(scenario: Scenario) -> None:
    """One turn's new tokens and answer must fit ``max_model_len`` even with no history:
    neither truncation nor ending the session could serve it otherwise."""
    eng, wl = scenario.engine, scenario.workload
    sessions = wl.sessions
    assert sessions is not None
    max_out = wl.output_len.max_value
    for key, spec in (("sessions.first_input_len", sessions.first_input_len), ("input_len", wl.input_len)):
        if spec is not None and spec.max_value + max_out > eng.max_model_len:
            raise ScenarioError(
                f"workload.{key}: a turn's new tokens ({spec.max_value}) + output ({max_out}) "
                f"exceed engine.max_model_len ({eng.max_model_len}) even with no earlier turns"
            )
    shared = wl.prefix.shared_tokens if wl.prefix is not None else 0
    if shared and shared + wl.input_len.max_value + max_out > eng.max_model_len:
        raise ScenarioError(
            f"workload.prefix.shared_tokens: a later turn keeps the shared prefix ({shared}), "
            f"so its new tokens ({wl.input_len.max_value}) + output ({max_out}) + the prefix "
            f"exceed engine.max_model_len ({eng.max_model_len}) even with no earlier turns"
        )


def _mean_length(spec: FixedLength | UniformLength | EmpiricalLength) -> float:
    if isinstance(spec, FixedLength):
        return float(spec.value)
    if isinstance(spec, UniformLength):
        return (spec.low + spec.high) / 2.0
    return sum(spec.values) / len(spec.values)


def _shortest_request_s(scenario: Scenario) -> float:
    """A lower bound on one closed-loop request's time: its think time, and the fewest steps
    that can emit its tokens (k + 1 a step with drafts), each at least the fixed cost a step
    pays (base, the weights' read in the roofline form) or the host overhead."""
    st, wl = scenario.step_time, scenario.workload
    step = st.base
    if st.form == "roofline" and st.physics is not None:
        step += st.efficiency.weights * st.physics.weights
    step = max(step, st.host_overhead)
    per_step = 1 + (scenario.speculative.num_speculative_tokens if scenario.speculative else 0)
    steps = math.ceil(wl.min_output_len / per_step)
    assert isinstance(wl.arrival, ClosedArrival)
    think = wl.arrival.think_time_s if wl.sessions is None else 0.0  # (between sessions only)
    return think + steps * step


def expected_requests(scenario: Scenario) -> float:
    """Requests a run of ``scenario`` sends: num_requests; rate x duration_s (open loop,
    expected); clients x (duration_s / shortest request + 1) (closed loop, at most); inf when
    a closed loop's requests may take no time at all."""
    wl = scenario.workload
    if wl.trace is not None:
        return float(len(wl.trace.requests))
    if wl.sessions is not None and wl.sessions.num_sessions is not None:
        return wl.sessions.num_sessions * _mean_length(wl.sessions.turns)
    if wl.num_requests is not None:
        return float(wl.num_requests)
    assert wl.duration_s is not None
    if not isinstance(wl.arrival, ClosedArrival):
        turns = 1.0 if wl.sessions is None else _mean_length(wl.sessions.turns)
        return wl.arrival.rate * wl.duration_s * turns
    shortest = _shortest_request_s(scenario)
    if shortest <= 0.0:
        return math.inf
    return wl.arrival.concurrency * (wl.duration_s / shortest + 1.0)


def check_limits(scenario: Scenario, *, records: bool = False) -> None:
    """Refuse a scenario one simulation cannot hold (README, "Limits"), from the scenario
    alone and before anything is allocated: more than MAX_REQUESTS requests (num_requests,
    or expected from rate x duration_s, or at most for a closed loop), arrivals spread over
    more than MAX_SIMULATED_S, a KV pool over MAX_KV_BLOCKS; with ``records`` (every chunk
    kept) more than MAX_RECORDED_TOKENS expected output tokens."""
    eng, wl = scenario.engine, scenario.workload
    if eng.num_blocks > MAX_KV_BLOCKS:
        raise ScenarioError(
            f"engine.memory: a KV pool of {eng.num_blocks:,} blocks; one simulation holds at "
            f"most {MAX_KV_BLOCKS:,} blocks (a larger block_size gives fewer)"
        )
    dep = scenario.deployment
    if dep is not None and dep.groups is None and dep.num_replicas * eng.num_blocks > MAX_KV_BLOCKS:
        raise ScenarioError(
            f"deployment.replicas: {dep.num_replicas:,} replicas x {eng.num_blocks:,} KV blocks; "
            f"one simulation holds at most {MAX_KV_BLOCKS:,} blocks in all"
        )
    arrival = wl.arrival
    requests = expected_requests(scenario)
    if wl.trace is not None and requests > MAX_REQUESTS:
        raise ScenarioError(
            f"workload.trace.num_requests: the trace sends {requests:,.0f} requests; one "
            f"simulation holds at most {MAX_REQUESTS:,} (slice it: num_requests, start_s, duration_s)"
        )
    sessions = wl.sessions
    if sessions is not None and sessions.num_sessions is not None:
        if requests > MAX_REQUESTS:
            raise ScenarioError(
                f"workload.sessions.num_sessions: {sessions.num_sessions:,} sessions x "
                f"{_mean_length(sessions.turns):g} turns is ~{requests:.3g} requests; one "
                f"simulation holds at most {MAX_REQUESTS:,} requests"
            )
        if not isinstance(arrival, ClosedArrival):
            span = (sessions.num_sessions - 1) / arrival.rate
            if span > MAX_SIMULATED_S:
                raise ScenarioError(
                    f"workload.arrival.rate: {sessions.num_sessions:,} sessions at "
                    f"{arrival.rate:g} sessions/s start over ~{span:.3g} s; one simulation "
                    f"covers at most {MAX_SIMULATED_S:.0e} s of arrivals"
                )
    elif isinstance(arrival, ClosedArrival):
        if math.isinf(requests):
            raise ScenarioError(
                "workload.duration_s: closed-loop requests that take no time (step_time 0, "
                "think_time_s 0) never reach duration_s; give num_requests, a step time or "
                "a think time"
            )
        if requests > MAX_REQUESTS:
            raise ScenarioError(
                f"workload.duration_s: {arrival.concurrency:,} clients for {wl.duration_s:g} s "
                f"may send {requests:.3g} requests (each takes at least "
                f"{_shortest_request_s(scenario):.3g} s); one simulation holds at most "
                f"{MAX_REQUESTS:,} requests: give num_requests or a shorter duration_s"
            )
    elif arrival is None:  # a trace at its own times
        times = wl.trace.requests.times
        if times is not None and float(times[-1]) > MAX_SIMULATED_S:
            raise ScenarioError(
                f"workload.trace.speedup: the trace's requests arrive over ~{float(times[-1]):.3g} s; "
                f"one simulation covers at most {MAX_SIMULATED_S:.0e} s of arrivals"
            )
    elif wl.num_requests is not None or wl.trace is not None:
        count = wl.num_requests if wl.num_requests is not None else len(wl.trace.requests)
        span = (count - 1) / arrival.rate
        if span > MAX_SIMULATED_S:
            raise ScenarioError(
                f"workload.arrival.rate: {count:,} requests at {arrival.rate:g} req/s "
                f"arrive over ~{span:.3g} s; one simulation covers at most "
                f"{MAX_SIMULATED_S:.0e} s of arrivals"
            )
    elif requests > MAX_REQUESTS:
        raise ScenarioError(
            f"workload.duration_s: {wl.duration_s:g} s at {arrival.rate:g} req/s is "
            f"~{requests:.3g} requests (rate x duration_s); one simulation holds at most "
            f"{MAX_REQUESTS:,} requests"
        )
    tokens = requests * wl.mean_output_len
    if records and tokens > MAX_RECORDED_TOKENS:
        field = (
            "trace.num_requests" if wl.trace is not None
            else "num_requests" if wl.num_requests is not None
            else "sessions.num_sessions" if sessions is not None and sessions.num_sessions is not None
            else "duration_s"
        )
        raise ScenarioError(
            f"workload.{field}: ~{requests:.3g} requests x {wl.mean_output_len:g} "
            f"output tokens is ~{tokens:.3g} tokens to keep chunk by chunk (plots); a run that "
            f"keeps them holds at most {MAX_RECORDED_TOKENS:,}: give fewer requests"
        )
