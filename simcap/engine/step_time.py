"""How long one engine step takes, from the batch it computes.

Two forms, chosen by ``step_time.form``. Both are fitted like scikit-learn estimators (``fit``
returns self, learned values end in ``_``).

**linear** (default, :class:`StepTimeModel`): a small physical, linear form::

    forward = base
            + per_prefill_token  * prefill tokens      (prompt chunks, recomputation)
            + per_decode_token   * decode tokens       (1 per decoding request)
            + per_verify_token   * verified drafts     (speculation: k more per request)
            + per_context_token  * attended KV tokens  (sum of context lengths in the batch)
            + mixed_step         * [step mixes prefill into decodes]
            + k * (draft_per_pass + draft_per_request * requests in the batch)
                                                       (EAGLE: k sequential draft passes)

**roofline** (:class:`RooflineStepTimeModel`): bytes and FLOPs of the step on named hardware
(``simcap/catalog``), each physical term in seconds per step per rank at the roofline, times a
fitted efficiency (1: kernels at the roofline; > 1 slower). From the step's integers: P prefill
tokens, D decode tokens, V verified drafts, n = P + D + V, R scheduled requests, C attended
context tokens, Q causal (query, key) pairs of the prefill chunks (``n*s + n(n+1)/2`` for a
chunk of n after s computed tokens), k drafts::

    weights           dense (non-expert) weight bytes per rank / bandwidth: attention, dense
                      MLPs, routers, shared experts, LM head, read once per step
    experts           MoE layers x E_eff (1 - (1 - k_route/E_eff)^n) distinct experts x bytes
                      per expert (expert_weight_dtype, e.g. mxfp4) / tp / bandwidth;
                      E_eff = max(k_route, E (1 - routing_skew)): skewed routing as if each
                      token's top-k came from a smaller pool.
                      With expert parallelism a rank holds E/tp whole experts instead of a
                      1/tp slice of each: the same expected bytes per rank
    compute           2 x (active params per token x n + LM head x (R + V) logit rows)
                      / (peak FLOPs of compute_dtype x tp)
    attention_prefill 4 x layers x query heads x head_dim x Q / (peak x tp)
    kv_read           C x KV bytes per token per rank / bandwidth; on sliding-window layers
                      (gpt-oss: half of them) each request reads its whole window instead
                      (contexts longer than the window, as a 1k-token prompt already is)
    tp_comm           tp > 1: 2 ring all-reduces per layer of n x hidden activations (bf16):
                      2 (tp-1)/tp x bytes / link bandwidth
    tp_latency        tp > 1: 2 x layers x link latency
    draft             EAGLE/EAGLE3: k passes of the draft model (weights, compute and logits of
                      the R requests' tokens, KV over C) plus its compute over the P prefill
                      tokens; default draft: one dense layer of the target's width + LM head

    forward = base + per_request x R + mixed_step x [mixed] + sum_i efficiency_i x term_i

``combine: max`` replaces the sum of the compute group (compute, attention_prefill) and the
memory group (weights, experts, kv_read) by the larger of the two. The sum form is linear in
``base``, ``per_request``, ``mixed_step`` and the efficiencies: :meth:`features` gives the
basis (``ROOFLINE_FEATURES``), :meth:`RooflineStepTimeModel.fit` fits it by non-negative least
squares with an optional pull toward efficiency 1. Every term is non-decreasing in tokens and
context, so a pure-decode stretch's periods never shrink (the fast path relies on it).
Constants are folded at construction: a step costs a few float operations.

Both forms price a stretch of pure-decode steps with ``decode_periods``, and of verify steps
(speculative decoding) with ``verify_periods`` (integers in, the same float operations as
``step_period`` out), which the fast path uses.

The engine's step period adds ``host_overhead`` (scheduling, output processing, messaging:
work vLLM's per-iteration log does not time). With async scheduling that host work overlaps
the next forward, so the period is ``max(forward, host_overhead)``; without it (the CPU
server, and vLLM before async scheduling) the two add up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from simcap.catalog import HardwareSpec, dtype_info, resolve_hardware, resolve_model
from simcap.catalog.memory import GB, ModelShape
from simcap.engine.scheduler import SchedulerOutput
from simcap.errors import ScenarioError


class StepTimeSettings(Protocol):
    """What the step-time models read of a scenario's ``step_time`` section
    (:class:`simcap.config.scenario.StepTimeConfig` is one): the form, the linear form's terms
    (:meth:`model_dump`), or the roofline form's hardware, shapes, dtypes, efficiencies and
    resolved :attr:`physics`."""

    form: str
    hardware: Any
    model: Any
    draft_model: Any
    weight_dtype: str
    kv_dtype: str | None
    compute_dtype: str | None
    tensor_parallel_size: int
    routing_skew: float
    base: float
    per_request: float
    mixed_step: float
    host_overhead: float
    efficiency: Any
    combine: str
    physics: Any

    def model_dump(self) -> dict[str, Any]: ...

FEATURES = (
    "base",
    "per_prefill_token",
    "per_decode_token",
    "per_verify_token",
    "per_context_token",
    "mixed_step",
    "draft_per_pass",
    "draft_per_request",
)


def step_features(out: SchedulerOutput, num_speculative_tokens: int = 0) -> tuple[float, ...]:
    """The feature row of one step, in the order of ``FEATURES``."""
    mixed = 1.0 if (out.num_prefill_tokens and out.num_decode_reqs) else 0.0
    k = float(num_speculative_tokens)
    return (
        1.0,
        float(out.num_prefill_tokens),
        float(out.num_decode_tokens),
        float(out.num_verify_tokens),
        float(out.num_context_tokens),
        mixed,
        k,
        k * len(out.reqs),
    )


@dataclass
class StepTimeModel:
    """Linear step-time model; coefficients in seconds per unit of each feature."""

    base: float = 0.004
    per_prefill_token: float = 1.0e-5
    per_decode_token: float = 5.0e-5
    per_verify_token: float = 5.0e-5
    per_context_token: float = 0.0
    mixed_step: float = 0.0
    draft_per_pass: float = 0.0
    draft_per_request: float = 0.0
    host_overhead: float = 0.0
    async_scheduling: bool = False
    # Drafts per step (k) when speculative decoding is on; 0 disables the draft term.
    num_speculative_tokens: int = 0

    @classmethod
    def from_config(
        cls, config: StepTimeSettings, async_scheduling: bool = False, num_speculative_tokens: int = 0
    ) -> "StepTimeModel":
        values = config.model_dump()
        values.pop("noise", None)  # per-step factors: simcap.engine.noise, not the mean model
        if values["per_verify_token"] is None:
            values["per_verify_token"] = values["per_decode_token"]
        return cls(
            **values, async_scheduling=async_scheduling, num_speculative_tokens=num_speculative_tokens
        )

    @property
    def coef_(self) -> np.ndarray:
        return np.array([getattr(self, name) for name in FEATURES])

    def forward_time(self, out: SchedulerOutput) -> float:
        """Seconds of the forward pass (and sampling) for the batch ``out``."""
        t = self.base + self.per_prefill_token * out.num_prefill_tokens
        t += self.per_decode_token * out.num_decode_tokens
        if out.num_verify_tokens:
            t += self.per_verify_token * out.num_verify_tokens
        if self.per_context_token:
            t += self.per_context_token * out.num_context_tokens
        if self.mixed_step and out.num_prefill_tokens and out.num_decode_reqs:
            t += self.mixed_step
        k = self.num_speculative_tokens
        if k:
            t += k * (self.draft_per_pass + self.draft_per_request * len(out.reqs))
        return t

    def step_period(self, out: SchedulerOutput) -> float:
        """Seconds from one step's start to the next's, host work included.

        A step that only preempted (a request could not grow and gave up its own blocks)
        runs no forward pass.
        """
        forward = self.forward_time(out) if out.total_num_scheduled_tokens else 0.0
        if self.async_scheduling:
            return forward if forward > self.host_overhead else self.host_overhead
        return forward + self.host_overhead

    # Periods never shrink along a pure-decode stretch (see decode_periods).
    @property
    def decode_nondecreasing(self) -> bool:
        return self.per_context_token >= 0

    # Whether verify_periods depends on the contexts (else every step of a batch is priced
    # alike).
    @property
    def periods_depend_on_context(self) -> bool:
        return bool(self.per_context_token)

    def decode_periods(self, num_reqs: int, context: int, count: int) -> list[float]:
        """:meth:`step_period` of ``count`` pure-decode steps of ``num_reqs`` requests (one
        token each, no drafts in play) whose attended context is ``context + num_reqs * j``
        at step j = 1..count: the same float operations, in the same order, as step_period
        on those steps' SchedulerOutputs."""
        return self.verify_periods(
            num_reqs, 0, range(context + num_reqs, context + num_reqs * count + 1, num_reqs)
            if num_reqs else [context] * count,
        )

    def verify_periods(self, num_reqs: int, num_verify: int, contexts) -> list[float]:
        """:meth:`step_period` of steps in which each of ``num_reqs`` requests computes one
        token and the batch verifies ``num_verify`` drafts (no prompt tokens), step i
        attending ``contexts[i]`` tokens: step_period's float operations, in its order."""
        t0 = self.base + self.per_prefill_token * 0
        t0 += self.per_decode_token * num_reqs
        if num_verify:
            t0 += self.per_verify_token * num_verify
        host = self.host_overhead
        per_context = self.per_context_token
        k = self.num_speculative_tokens
        if not per_context:  # every step alike: priced once
            f = t0 + k * (self.draft_per_pass + self.draft_per_request * num_reqs) if k else t0
            return [(f if f > host else host) if self.async_scheduling else f + host] * len(contexts)
        # (t0 + per_context * c) + draft: forward_time's additions, in its order.
        if k:
            draft = k * (self.draft_per_pass + self.draft_per_request * num_reqs)
            if self.async_scheduling:
                return [f if (f := t0 + per_context * c + draft) > host else host
                        for c in contexts]
            return [t0 + per_context * c + draft + host for c in contexts]
        if self.async_scheduling:
            return [f if (f := t0 + per_context * c) > host else host for c in contexts]
        return [t0 + per_context * c + host for c in contexts]

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Forward seconds for rows of ``FEATURES``."""
        return np.asarray(X, dtype=float) @ self.coef_

    def fit(self, X: np.ndarray, y: np.ndarray) -> "StepTimeModel":
        """Non-negative least squares on measured forward seconds; sets ``residuals_``."""
        from scipy.optimize import nnls  # fitting only: scipy.optimize is slow to import

        X = np.asarray(X, dtype=float)
        y = np.asarray(y, dtype=float)
        coef, _ = nnls(X, y)
        for name, value in zip(FEATURES, coef):
            setattr(self, name, float(value))
        self.residuals_ = y - X @ coef
        return self


# --------------------------------------------------------------------------- roofline form

ROOFLINE_FEATURES = (
    "base",
    "per_request",
    "mixed_step",
    "weights",
    "experts",
    "compute",
    "attention_prefill",
    "kv_read",
    "tp_comm",
    "tp_latency",
    "draft",
)
# The physical terms, each multiplied by its efficiency (the rest are seconds themselves).
ROOFLINE_TERMS = ROOFLINE_FEATURES[3:]
ROOFLINE_SECONDS = ROOFLINE_FEATURES[:3]
# The coefficients in ROOFLINE_FEATURES order, as calibration names them.
ROOFLINE_COEFFICIENTS = (*ROOFLINE_SECONDS, *(f"efficiency.{t}" for t in ROOFLINE_TERMS))


def _rename(exc: ScenarioError, path: str) -> ScenarioError:
    return ScenarioError(f"{path}: {str(exc).split(': ', 1)[1]}")


@dataclass(frozen=True)
class RooflinePhysics:
    """The roofline form's inputs resolved to seconds per unit, per step and per rank, at
    efficiency 1 (every figure below is one of them)."""

    hardware: HardwareSpec
    model: ModelShape
    draft_model: ModelShape
    tensor_parallel_size: int
    weights: float  # s: the dense (non-expert) weights, read once per step
    experts_all: float  # s: every expert of the effective pool (this rank's share), all MoE layers
    experts_q: float  # 1 - k / E_eff: a token misses a given expert (1.0: dense model)
    compute_per_token: float  # s: 2 x active params (LM head apart) per token
    compute_per_logit: float  # s: 2 x LM head params per row of logits
    attention_per_pair: float  # s: 4 x layers x heads x head_dim per (query, key) pair
    kv_per_token: float  # s: KV bytes of one attended token (this rank's heads)
    kv_window_per_request: float  # s: one request's sliding-window layers (their whole window)
    tp_comm_per_token: float  # s: 2 ring all-reduces per layer of one token's activations
    tp_latency: float  # s: 2 x layers x link latency
    draft_weights: float  # the draft model's figures, one pass
    draft_per_token: float
    draft_per_logit: float
    draft_per_pair: float
    draft_kv_per_token: float

    @classmethod
    def from_config(cls, cfg: StepTimeSettings) -> "RooflinePhysics":
        """Resolve and check ``cfg`` (form roofline); every problem is one ScenarioError line."""
        hw = resolve_hardware(cfg.hardware, "step_time.hardware")
        weight_bytes, weight_key = dtype_info(cfg.weight_dtype, "step_time.weight_dtype")
        expert_bytes = weight_bytes
        if cfg.expert_weight_dtype is not None:
            expert_bytes, _ = dtype_info(cfg.expert_weight_dtype, "step_time.expert_weight_dtype")
        if cfg.kv_dtype is not None:
            kv_bytes, kv_key = dtype_info(cfg.kv_dtype, "step_time.kv_dtype")
            if kv_key is None:
                raise ScenarioError(f"step_time.kv_dtype: {cfg.kv_dtype} is a weight format; "
                                    "allowed: bf16, fp16, fp8, int8, fp32")
        compute_key = weight_key
        if cfg.compute_dtype is not None:
            _, compute_key = dtype_info(cfg.compute_dtype, "step_time.compute_dtype")
        if compute_key is None:
            raise ScenarioError(
                "step_time.compute_dtype: the matmuls' dtype is required where the weights are "
                f"stored as {cfg.compute_dtype or cfg.weight_dtype} (dequantised); allowed: bf16, "
                "fp16, fp8, int8, fp32")
        peak = hw.peak_flops(compute_key, "step_time.compute_dtype")
        tp = cfg.tensor_parallel_size

        def shape(value: Any, path: str) -> ModelShape:
            m = resolve_model(value, kv_dtype=cfg.kv_dtype, path=path)
            if cfg.kv_dtype is not None and m.dtype_bytes != kv_bytes:
                m = m.model_copy(update={"dtype_bytes": int(kv_bytes)})
            if m.draft_layers:
                m = m.model_copy(update={"draft_layers": 0})
            missing = m.missing_compute_field()
            if missing:
                raise ScenarioError(f"{path}: the roofline form needs {missing} (not given)")
            if m.is_moe and m.num_experts_per_tok > m.num_experts:
                raise ScenarioError(
                    f"{path}.num_experts_per_tok: top-{m.num_experts_per_tok} routing exceeds the "
                    f"{m.num_experts} routed experts"
                )
            if m.num_dense_layers > m.num_layers:
                raise ScenarioError(f"{path}.num_dense_layers: exceeds num_layers ({m.num_layers})")
            try:
                m.kv_heads_per_rank(tp)
            except ScenarioError as exc:
                raise _rename(exc, "step_time.tensor_parallel_size") from None
            return m

        model = shape(cfg.model, "step_time.model")
        if cfg.draft_model is not None:
            draft = shape(cfg.draft_model, "step_time.draft_model")
        else:
            draft = default_draft_shape(model)

        held = (model.total_weight_params() - model.expert_params()) * weight_bytes / tp
        held += model.expert_params() * expert_bytes / tp
        if held > hw.memory_gb * GB:
            raise ScenarioError(
                f"step_time.model: {held / GB:.1f} GB of weights per rank (tensor_parallel_size "
                f"{tp}) exceed the hardware's memory_gb ({hw.memory_gb:g})"
            )
        bandwidth = hw.memory_bandwidth_gbps * 1e9
        flops = peak * tp

        if model.is_moe:
            k, e = model.num_experts_per_tok, model.num_experts
            # Skewed routing: each token's top-k as if drawn from E_eff = E (1 - skew) experts.
            e_eff = max(float(k), e * (1.0 - cfg.routing_skew))
            experts_q = 1.0 - k / e_eff
            # Per rank: E_eff / tp whole experts (expert parallel) or a 1/tp slice of E_eff
            # experts (tensor parallel): the same expected bytes.
            experts_all = (model.num_moe_layers * e_eff * model.params_per_expert()
                           * expert_bytes / tp / bandwidth)
        else:
            experts_q, experts_all = 1.0, 0.0

        layers = model.num_layers
        assert model.hidden_size and model.num_attention_heads
        tp_comm = tp_latency = 0.0
        if tp > 1:
            link = hw.interconnect
            if link is None or link.bandwidth_gbps is None:
                raise ScenarioError(
                    "step_time.hardware.interconnect: a link bandwidth_gbps is required with "
                    "tensor_parallel_size > 1"
                )
            activation_bytes = 4 if compute_key == "fp32" else 2
            tp_comm = (2 * layers * model.hidden_size * activation_bytes * 2 * (tp - 1) / tp
                       / (link.bandwidth_gbps * 1e9))
            tp_latency = 2 * layers * (link.latency_us or 0.0) * 1e-6

        def pair(m: ModelShape) -> float:
            return m.attention_flops_per_pair() / flops

        kv_full, kv_window = model.kv_read_bytes(tp)

        return cls(
            hardware=hw, model=model, draft_model=draft, tensor_parallel_size=tp,
            weights=model.dense_weight_params() * weight_bytes / tp / bandwidth,
            experts_all=experts_all, experts_q=experts_q,
            compute_per_token=2 * model.active_params_per_token(False) / flops,
            compute_per_logit=2 * model.lm_head_params() / flops,
            attention_per_pair=pair(model),
            kv_per_token=kv_full / bandwidth, kv_window_per_request=kv_window / bandwidth,
            tp_comm_per_token=tp_comm, tp_latency=tp_latency,
            draft_weights=draft.dense_weight_params() * weight_bytes / tp / bandwidth,
            draft_per_token=2 * draft.active_params_per_token(False) / flops,
            draft_per_logit=2 * draft.lm_head_params() / flops,
            draft_per_pair=pair(draft),
            draft_kv_per_token=draft.kv_bytes_per_token(tp) / bandwidth,
        )

    def experts(self, n: int) -> float:
        """Seconds reading the distinct experts ``n`` tokens touch: all MoE layers, expected
        ``E_eff (1 - (1 - k/E_eff)^n)`` experts per layer."""
        return self.experts_all * (1.0 - self.experts_q**n)


def default_draft_shape(model: ModelShape) -> ModelShape:
    """An EAGLE/EAGLE3 head: one dense decoder layer of the target's width and attention
    layout, plus the LM head (vocab x hidden)."""
    mla = {name: getattr(model, name) for name in
           ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")}
    return ModelShape(
        num_layers=1, num_kv_heads=model.num_kv_heads, head_size=model.head_size,
        dtype_bytes=model.dtype_bytes, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        intermediate_size=model.intermediate_size or model.moe_intermediate_size,
        vocab_size=model.vocab_size, tie_word_embeddings=model.tie_word_embeddings, **mla,
    )


class RooflineStepTimeModel:
    """The roofline form: a step's seconds from its bytes, FLOPs and messages.

    ``forward = base + per_request * R + mixed_step * [mixed] + sum_i efficiency_i * term_i``
    (``combine="sum"``), or with ``combine="max"`` the larger of the compute group (compute,
    attention_prefill) and the memory group (weights, experts, kv_read) in place of their sum.
    Everything constant is folded into a few coefficients at construction, so a step costs a
    few float operations.
    """

    FEATURES = ROOFLINE_FEATURES

    def __init__(
        self,
        physics: RooflinePhysics,
        *,
        base: float = 0.0,
        per_request: float = 0.0,
        mixed_step: float = 0.0,
        host_overhead: float = 0.0,
        efficiency: dict[str, float] | None = None,
        combine: str = "sum",
        async_scheduling: bool = False,
        num_draft_passes: int = 0,
    ) -> None:
        self.physics = physics
        self.base = base
        self.per_request = per_request
        self.mixed_step = mixed_step
        self.host_overhead = host_overhead
        self.efficiency = {name: 1.0 for name in ROOFLINE_TERMS}
        self.efficiency.update(efficiency or {})
        self.combine = combine
        self.async_scheduling = async_scheduling
        self.num_draft_passes = num_draft_passes  # k with an EAGLE draft, else 0
        self._fold()

    @classmethod
    def from_config(
        cls, config: StepTimeSettings, async_scheduling: bool = False, num_draft_passes: int = 0
    ) -> "RooflineStepTimeModel":
        assert config.physics is not None, "form roofline"
        return cls(
            config.physics, base=config.base, per_request=config.per_request,
            mixed_step=config.mixed_step, host_overhead=config.host_overhead,
            efficiency=config.efficiency.model_dump(), combine=config.combine,
            async_scheduling=async_scheduling, num_draft_passes=num_draft_passes,
        )

    def _fold(self) -> None:
        ph, e, k = self.physics, self.efficiency, self.num_draft_passes
        ed = e["draft"]
        self._w = e["weights"] * ph.weights
        self._x = e["experts"] * ph.experts_all
        self._q = ph.experts_q
        self._c_tok = e["compute"] * ph.compute_per_token
        self._c_logit = e["compute"] * ph.compute_per_logit
        self._pair = e["attention_prefill"] * ph.attention_per_pair
        self._kv = e["kv_read"] * ph.kv_per_token
        self._kv_req = e["kv_read"] * ph.kv_window_per_request
        self._comm = e["tp_comm"] * ph.tp_comm_per_token
        self._lat = e["tp_latency"] * ph.tp_latency
        # Draft: k passes over the requests' tokens (weights, compute, logits, KV each pass),
        # the prefill tokens once.
        self._d_const = ed * k * ph.draft_weights
        self._d_req = ed * k * (ph.draft_per_token + ph.draft_per_logit)
        self._d_prefill = ed * ph.draft_per_token if k else 0.0
        self._d_pair = ed * ph.draft_per_pair if k else 0.0
        self._d_ctx = ed * k * ph.draft_kv_per_token
        # The sum form's coefficients, grouped by the count they multiply.
        self._const = self.base + self._w + self._lat + self._d_const
        self._per_req = self.per_request + self._d_req + self._kv_req
        self._per_tok = self._c_tok + self._comm
        self._per_pair = self._pair + self._d_pair
        self._per_ctx = self._kv + self._d_ctx

    # ------------------------------------------------------------------ per step

    def _head(self, n: int, reqs: int, logits: int, prefill: int, pairs: int) -> float:
        """The sum form without its context and mixed terms."""
        t = self._const + self._per_req * reqs
        t += self._per_tok * n
        t += self._c_logit * logits
        if self._x:
            t += self._x * (1.0 - self._q**n)
        if pairs:
            t += self._per_pair * pairs
        if prefill and self._d_prefill:
            t += self._d_prefill * prefill
        return t

    def _forward_max(
        self, n: int, reqs: int, logits: int, prefill: int, pairs: int, context: int, mixed: bool
    ) -> float:
        compute = self._c_tok * n + self._c_logit * logits + self._pair * pairs
        memory = self._w + self._x * (1.0 - self._q**n) + self._kv * context + self._kv_req * reqs
        t = self.base + self.per_request * reqs
        t += compute if compute > memory else memory
        t += self._comm * n + self._lat
        if self.num_draft_passes:
            t += self._d_const + self._d_req * reqs + self._d_prefill * prefill
            t += self._d_pair * pairs + self._d_ctx * context
        if mixed:
            t += self.mixed_step
        return t

    def forward_time(self, out: SchedulerOutput) -> float:
        """Seconds of the forward pass (and the draft passes) for the batch ``out``."""
        prefill = out.num_prefill_tokens
        n = prefill + out.num_decode_tokens + out.num_verify_tokens
        reqs = len(out.reqs)
        mixed = bool(prefill and out.num_decode_reqs)
        # Logits: one row per request (its last position) plus one per verified draft.
        logits = reqs + out.num_verify_tokens
        if self.combine == "max":
            return self._forward_max(
                n, reqs, logits, prefill, out.num_prefill_pairs, out.num_context_tokens, mixed
            )
        t = self._head(n, reqs, logits, prefill, out.num_prefill_pairs)
        t += self._per_ctx * out.num_context_tokens
        if mixed:
            t += self.mixed_step
        return t

    def step_period(self, out: SchedulerOutput) -> float:
        """Seconds from one step's start to the next's (as :meth:`StepTimeModel.step_period`)."""
        forward = self.forward_time(out) if out.total_num_scheduled_tokens else 0.0
        if self.async_scheduling:
            return forward if forward > self.host_overhead else self.host_overhead
        return forward + self.host_overhead

    decode_nondecreasing = True  # every term is non-decreasing in tokens and context
    periods_depend_on_context = True  # (the KV read)

    def decode_periods(self, num_reqs: int, context: int, count: int) -> list[float]:
        """:meth:`step_period` of ``count`` pure-decode steps (see StepTimeModel's)."""
        return self.verify_periods(
            num_reqs, 0, range(context + num_reqs, context + num_reqs * count + 1, num_reqs)
            if num_reqs else [context] * count,
        )

    def verify_periods(self, num_reqs: int, num_verify: int, contexts) -> list[float]:
        """:meth:`step_period` of verify steps (see StepTimeModel's)."""
        host, asynchronous = self.host_overhead, self.async_scheduling
        n = num_reqs + num_verify  # tokens, and rows of logits
        periods = []
        if self.combine == "max":
            for c in contexts:
                f = self._forward_max(n, num_reqs, n, 0, 0, c, False)
                periods.append((f if f > host else host) if asynchronous else f + host)
            return periods
        head = self._head(n, num_reqs, n, 0, 0)
        per_ctx = self._per_ctx
        if asynchronous:
            return [f if (f := head + per_ctx * c) > host else host for c in contexts]
        return [head + per_ctx * c + host for c in contexts]

    # ------------------------------------------------------------------ calibration

    def features(self, out: SchedulerOutput) -> tuple[float, ...]:
        """The step's basis in the order of ``ROOFLINE_FEATURES``: 1, requests, [mixed], then
        each physical term in seconds at efficiency 1 (:func:`roofline_basis` of one step).
        With ``combine="sum"`` the forward time is this row times :attr:`coef_`."""
        row = roofline_basis(
            self.physics, prefill=[out.num_prefill_tokens], decode=[out.num_decode_tokens],
            verify=[out.num_verify_tokens], reqs=[len(out.reqs)],
            mixed=[1.0 if (out.num_prefill_tokens and out.num_decode_reqs) else 0.0],
            context=[out.num_context_tokens], pairs=[out.num_prefill_pairs],
            num_draft_passes=self.num_draft_passes,
        )[0]
        return tuple(float(x) for x in row)

    @property
    def coef_(self) -> np.ndarray:
        e = self.efficiency
        return np.array([self.base, self.per_request, self.mixed_step,
                         *(e[name] for name in ROOFLINE_TERMS)])

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Forward seconds (sum form) for rows of ``ROOFLINE_FEATURES``."""
        return np.asarray(X, dtype=float) @ self.coef_

    def fit(self, X: np.ndarray, y: np.ndarray, prior_weight: float = 0.0) -> "RooflineStepTimeModel":
        """Non-negative least squares on measured forward seconds (sum form), each efficiency
        pulled toward its prior 1.0 with weight ``prior_weight`` (in units of the squared
        residual seconds of one step: ``prior_weight * (e - 1)^2`` is added to the loss)."""
        from scipy.optimize import nnls  # fitting only: scipy.optimize is slow to import

        X = np.asarray(X, dtype=float)
        y = np.asarray(y, dtype=float)
        A, b = X, y
        if prior_weight > 0:
            m = len(ROOFLINE_TERMS)
            rows = np.zeros((m, X.shape[1]))
            rows[:, 3:] = np.eye(m) * np.sqrt(prior_weight)
            A = np.vstack([X, rows])
            b = np.concatenate([y, np.full(m, np.sqrt(prior_weight))])
        coef, _ = nnls(A, b)
        self.base, self.per_request, self.mixed_step = (float(c) for c in coef[:3])
        self.efficiency = {name: float(c) for name, c in zip(ROOFLINE_TERMS, coef[3:])}
        self._fold()
        self.residuals_ = y - X @ coef
        return self


def roofline_basis(
    physics: RooflinePhysics,
    *,
    prefill: np.ndarray,
    decode: np.ndarray,
    verify: np.ndarray,
    reqs: np.ndarray,
    mixed: np.ndarray,
    context: np.ndarray,
    pairs: np.ndarray,
    num_draft_passes: int = 0,
) -> np.ndarray:
    """:meth:`RooflineStepTimeModel.features` of many steps at once, from per-step counts
    (arrays of equal length): one row per step in the order of ``ROOFLINE_FEATURES``."""
    ph, k = physics, num_draft_passes
    prefill, decode, verify, reqs, mixed, context, pairs = (
        np.asarray(a, dtype=float) for a in (prefill, decode, verify, reqs, mixed, context, pairs))
    n = prefill + decode + verify
    logits = reqs + verify
    m = len(n)
    draft = np.zeros(m)
    if k:
        draft = (k * ph.draft_weights + k * (ph.draft_per_token + ph.draft_per_logit) * reqs
                 + ph.draft_per_token * prefill + ph.draft_per_pair * pairs
                 + k * ph.draft_kv_per_token * context)
    return np.column_stack([
        np.ones(m), reqs, mixed, np.full(m, ph.weights),
        ph.experts_all * (1.0 - ph.experts_q**n),
        ph.compute_per_token * n + ph.compute_per_logit * logits,
        ph.attention_per_pair * pairs, ph.kv_per_token * context + ph.kv_window_per_request * reqs,
        ph.tp_comm_per_token * n, np.full(m, ph.tp_latency), draft,
    ])


def roofline_forward(X: np.ndarray, coef: np.ndarray, combine: str = "sum") -> np.ndarray:
    """Forward seconds of rows of ``ROOFLINE_FEATURES`` for coefficients in that order (base,
    per_request, mixed_step, then the efficiencies): the sum form, or with ``combine="max"``
    the larger of the compute group (compute, attention_prefill) and the memory group
    (weights, experts, kv_read), as :class:`RooflineStepTimeModel` computes a step."""
    X = np.asarray(X, dtype=float)
    coef = np.asarray(coef, dtype=float)
    if combine != "max":
        return X @ coef
    parts = X * coef
    compute = parts[:, 5] + parts[:, 6]
    memory = parts[:, 3] + parts[:, 4] + parts[:, 7]
    return parts[:, [0, 1, 2, 8, 9, 10]].sum(axis=1) + np.maximum(compute, memory)


def make_step_model(
    config: StepTimeSettings, *, async_scheduling: bool = False, speculative_method: str | None = None,
    num_speculative_tokens: int = 0,
) -> StepTimeModel | RooflineStepTimeModel:
    """The step-time model a scenario's ``step_time`` section asks for.

    The roofline form runs its draft model (k passes) for EAGLE and EAGLE3; ngram drafts cost
    no forward of their own.
    """
    if config.form == "roofline":
        drafting = speculative_method in ("eagle", "eagle3")
        return RooflineStepTimeModel.from_config(
            config, async_scheduling, num_speculative_tokens if drafting else 0
        )
    return StepTimeModel.from_config(config, async_scheduling, num_speculative_tokens)
