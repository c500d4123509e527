"""KV-cache arithmetic as vLLM does it: bytes per token, memory budget, blocks, pool size.

Reading guide. A :class:`ModelShape` says how many bytes of K and V one token leaves in each
attention layer (read from a Hugging Face ``config.json`` dict or given explicitly, plus the KV
layers of a speculative draft such as EAGLE3's one layer). A :class:`MemorySpec` says what one
card has and what vLLM takes from it before the KV cache: weights, CUDA-graph memory (when the
profiler counts it) and the activations of the profiling run, which grow with
``max_num_batched_tokens``. :func:`plan_kv` turns both into a :class:`KVPlan`: how many blocks
the pool holds (``num_gpu_blocks``, what ``engine.num_gpu_blocks`` of a scenario wants), how many
tokens that is, and whether ``max_model_len`` fits. :func:`fit_activation_per_token` and
:func:`fit_activation_fixed` calibrate the activation terms from measured pool sizes.

The arithmetic (``vllm/v1/core/kv_cache_utils.py``):

- bytes per token per layer on one card = 2 (K, V) x KV heads per rank x head_size x dtype bytes,
  KV heads per rank = ``max(1, num_kv_heads // tensor_parallel_size)`` (fewer heads than ranks:
  each rank holds one replicated head);
- page of one block on one card = that x block_size x KV layers;
- ``num_gpu_blocks = floor(kv_bytes_per_card / page)``; the log's "GPU KV cache size" is
  ``num_gpu_blocks x block_size`` tokens (``pool_tokens``); block 0 is vLLM's reserved null block,
  so requests can use ``(num_gpu_blocks - 1) x block_size`` tokens (``usable_tokens``);
- "Maximum concurrency for N tokens per request" = ``num_gpu_blocks / cdiv(max_model_len,
  block_size)``.

The KV share of a card is ``gpu_memory_gb x gpu_memory_utilization - weights_gb - cuda_graph_gb
(if reserved) - activation_gb``; a measured size wins over it: ``num_gpu_blocks`` (from the server
log, ``vllm:cache_config_info`` or ``--num-gpu-blocks-override``) over ``kv_cache_gb`` over the
estimate.

Units: every ``*_gb`` is decimal, 1 GB = 10**9 bytes (:data:`GB`). Figures published in GiB
(2**30 bytes, :data:`GiB`), such as vLLM's own "Available KV cache memory: 20.91 GiB", are
converted with ``x * GiB / GB`` before they enter a spec.

Not modelled: MLA caches (DeepSeek-style latent KV), sliding-window or hybrid (Mamba) layers,
side caches such as a sparse-attention indexer's keys, and per-layer head layouts that differ
(a draft layer is assumed to have the target's layout).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from simcap.errors import ScenarioError

GB = 10**9
"""Bytes in one GB; every ``*_gb`` field of this module is in these units."""
GiB = 2**30
"""Bytes in one GiB, for converting figures vLLM logs in GiB: ``gb = gib * GiB / GB``."""

# torch dtype names (config.json's torch_dtype / dtype) and vLLM --kv-cache-dtype values -> bytes.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
}

KVSource = Literal["measured num_gpu_blocks", "measured kv_cache_gb", "estimate"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, defer_build=True)


MAX_CARD_GB = 1.0e6  # memory of one card, GB: far above any card, and bytes stay exact integers


def _fmt(x: float) -> str:
    """A GB figure for a message: one decimal, more when that would print 0.0."""
    return f"{x:.1f}" if abs(x) >= 0.05 else f"{x:.3g}"


def _dtype_bytes(name: str, path: str) -> int:
    key = name.lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ScenarioError(f"{path}: unknown dtype {name!r}; allowed: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


# --------------------------------------------------------------------------- model shape

_SHAPE_EXTRAS = (
    "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
    "tie_word_embeddings", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "num_shared_experts", "shared_expert_intermediate_size", "num_dense_layers",
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
    "sliding_window", "num_sliding_layers",
)


class ModelShape(_Model):
    """What one token costs in KV: attention layers, KV heads, head size, dtype bytes.

    >>> ModelShape(num_layers=4, num_kv_heads=2, head_size=64, dtype_bytes=2).kv_bytes_per_token(1)
    2048
    """

    num_layers: int = Field(gt=0, description="Attention layers of the target model holding KV.")
    num_kv_heads: int = Field(gt=0, description="KV heads of the whole model (before TP split).")
    head_size: int = Field(gt=0)
    dtype_bytes: int = Field(gt=0, description="Bytes per KV element (2 for bf16, 1 for fp8).")
    draft_layers: int = Field(
        0, ge=0, description="Extra KV layers of a speculative draft (EAGLE3: 1), same layout."
    )
    # What the roofline step-time form needs besides KV (None / 0: not given; a dump leaves
    # them out then, so a shape given for the KV pool alone prints and hashes as before).
    hidden_size: int | None = Field(None, gt=0)
    num_attention_heads: int | None = Field(None, gt=0, description="Query heads (before TP).")
    intermediate_size: int | None = Field(
        None, gt=0, description="Width of a dense MLP (gated: 3 matrices hidden x width)."
    )
    vocab_size: int | None = Field(None, gt=0)
    tie_word_embeddings: bool = False
    num_experts: int = Field(0, ge=0, description="Routed experts per MoE layer (0: dense model).")
    num_experts_per_tok: int = Field(0, ge=0, description="Top-k routed experts per token.")
    moe_intermediate_size: int | None = Field(
        None, gt=0, description="Width of one routed expert; None: intermediate_size."
    )
    num_shared_experts: int = Field(0, ge=0, description="Always-active experts per MoE layer.")
    shared_expert_intermediate_size: int | None = Field(
        None, gt=0, description="Width of one shared expert; None: the routed expert's width."
    )
    num_dense_layers: int = Field(
        0, ge=0, description="Layers of an MoE model with a dense MLP (first_k_dense_replace)."
    )
    # Multi-head latent attention (DeepSeek-V2/V3/R1): the cache holds one latent of
    # kv_lora_rank + qk_rope_head_dim values per token and layer, whole on every TP rank (vLLM's
    # MLA spec: one KV head of that size, no separate V); num_kv_heads is 1 and head_size that
    # latent's width.
    kv_lora_rank: int | None = Field(None, gt=0, description="MLA: width of the compressed KV latent.")
    q_lora_rank: int | None = Field(None, gt=0, description="MLA: width of the compressed query (None: none).")
    qk_rope_head_dim: int | None = Field(None, gt=0, description="MLA: rotary part of each query/key head.")
    qk_nope_head_dim: int | None = Field(None, gt=0, description="MLA: non-rotary part of each query/key head.")
    v_head_dim: int | None = Field(None, gt=0, description="MLA: width of each value head.")
    # Sliding-window attention (gpt-oss, Gemma, Mistral): num_sliding_layers of the layers
    # attend only the last sliding_window tokens. The KV pool here still counts every layer's
    # tokens (an upper bound of what vLLM's hybrid allocator holds); the roofline form reads
    # at most the window on those layers.
    sliding_window: int | None = Field(None, gt=0, description="Tokens a sliding-window layer attends.")
    num_sliding_layers: int = Field(0, ge=0, description="Layers with sliding-window attention.")

    @model_serializer(mode="wrap")
    def _drop_unset_extras(self, handler):
        data = handler(self)
        for name in _SHAPE_EXTRAS:
            if name in data and data[name] == ModelShape.model_fields[name].default:
                del data[name]
        return data

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], *, kv_cache_dtype: str | None = None, draft_layers: int = 0
    ) -> "ModelShape":
        """Read the shape from a Hugging Face ``config.json`` dict, as vLLM's ModelConfig does.

        ``num_hidden_layers``; ``num_key_value_heads`` (else ``num_attention_heads``: MHA);
        ``head_dim`` (else ``hidden_size // num_attention_heads``); ``torch_dtype`` (or the newer
        ``dtype``) for the KV dtype unless ``kv_cache_dtype`` (vLLM's ``--kv-cache-dtype``, e.g.
        ``"fp8"``; ``"auto"`` = the model's dtype) overrides it. A multimodal config's
        ``text_config`` is read when the top level has no layers. Raises :class:`ScenarioError`
        naming the missing or bad field.
        """
        if not isinstance(config, dict):
            raise ScenarioError("model.config: expected a config.json mapping")
        top = config
        if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
            config = config["text_config"]
        def get_int(name: str, fallback: str | None = None) -> int:
            value = config.get(name)
            if value is None and fallback is not None:
                value = config.get(fallback)
            if value is None:
                alt = f" (or {fallback})" if fallback else ""
                raise ScenarioError(f"model.config: config.json has no {name}{alt}")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ScenarioError(f"model.config: {name} must be a positive integer (got {value!r})")
            return value

        num_layers = get_int("num_hidden_layers")
        mla: dict[str, Any] = {}
        if "kv_lora_rank" in config:  # MLA: one latent per token and layer (see the fields)
            for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
                mla[name] = get_int(name)
            if config.get("q_lora_rank") is not None:
                mla["q_lora_rank"] = get_int("q_lora_rank")
        num_kv_heads = 1 if mla else get_int("num_key_value_heads", "num_attention_heads")
        if mla:
            head_size = mla["kv_lora_rank"] + mla["qk_rope_head_dim"]
        elif config.get("head_dim") is not None:
            head_size = get_int("head_dim")
        else:
            hidden, heads = get_int("hidden_size"), get_int("num_attention_heads")
            if hidden % heads:
                raise ScenarioError(
                    f"model.config: config.json has no head_dim and hidden_size {hidden} is not "
                    f"a multiple of num_attention_heads {heads}"
                )
            head_size = hidden // heads
        if kv_cache_dtype not in (None, "auto"):
            dtype_bytes = _dtype_bytes(kv_cache_dtype, "engine.kv_cache_dtype")
        else:
            dtype = config.get("torch_dtype") or config.get("dtype") or top.get("torch_dtype") \
                or top.get("dtype")
            if not isinstance(dtype, str):
                raise ScenarioError(
                    "model.config: config.json has no torch_dtype (or dtype); give kv_cache_dtype"
                )
            dtype_bytes = _dtype_bytes(dtype, "model.config.torch_dtype")
        return cls(num_layers=num_layers, num_kv_heads=num_kv_heads, head_size=head_size,
                   dtype_bytes=dtype_bytes, draft_layers=draft_layers,
                   **_compute_fields(config, top, num_layers), **_sliding_fields(config), **mla)

    # ------------------------------------------------------------ weights (roofline form)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is routed experts (0 for a dense model)."""
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    def missing_compute_field(self) -> str | None:
        """The first field the weight and FLOP counts need that this shape lacks, or None."""
        need = ["hidden_size", "num_attention_heads", "vocab_size"]
        if not self.is_moe or self.num_dense_layers:
            need.append("intermediate_size")
        if self.is_moe:
            if self.moe_intermediate_size is None and self.intermediate_size is None:
                need.append("moe_intermediate_size")
            need.append("num_experts_per_tok")
        for name in need:
            if not getattr(self, name):
                return name
        return None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    def attention_params_per_layer(self) -> int:
        """Q, K, V and O projections: hidden x head_size x (2 query heads + 2 KV heads). MLA:
        the query (through q_lora_rank when given), the KV down-projection to the latent and
        the rotary key, its up-projection to every head's key and value, and the output."""
        assert self.hidden_size and self.num_attention_heads
        h, heads = self.hidden_size, self.num_attention_heads
        if self.is_mla:
            assert self.kv_lora_rank and self.qk_rope_head_dim and self.qk_nope_head_dim and self.v_head_dim
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = h * heads * qk if not self.q_lora_rank else self.q_lora_rank * (h + heads * qk)
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + heads * self.v_head_dim * h
        return h * self.head_size * 2 * (heads + self.num_kv_heads)

    def attention_flops_per_pair(self) -> int:
        """FLOPs of one query token attending one cached token, all layers: 2 x heads x (the
        query-key width + the value width). MLA as vLLM decodes it (the up-projections absorbed:
        keys over the whole latent and its rotary part, values over the latent)."""
        assert self.num_attention_heads
        if self.is_mla:
            assert self.kv_lora_rank
            qk, v = self.head_size, self.kv_lora_rank
        else:
            qk = v = self.head_size
        return 2 * self.num_layers * self.num_attention_heads * (qk + v)

    def dense_mlp_params(self) -> int:
        """One gated dense MLP (gate, up, down): 3 x hidden x intermediate_size."""
        assert self.hidden_size and self.intermediate_size
        return 3 * self.hidden_size * self.intermediate_size

    def params_per_expert(self) -> int:
        """One routed expert: 3 x hidden x expert width (0 for a dense model)."""
        if not self.is_moe:
            return 0
        width = self.moe_intermediate_size or self.intermediate_size
        assert self.hidden_size and width
        return 3 * self.hidden_size * width

    def shared_expert_params(self) -> int:
        """The always-active experts of one MoE layer."""
        if not self.num_shared_experts:
            return 0
        assert self.hidden_size
        width = self.shared_expert_intermediate_size or self.moe_intermediate_size \
            or self.intermediate_size
        assert width
        return self.num_shared_experts * 3 * self.hidden_size * width

    def lm_head_params(self) -> int:
        """The output projection, vocab x hidden (read in full by every step)."""
        assert self.vocab_size and self.hidden_size
        return self.vocab_size * self.hidden_size

    def _layer_dense_params(self) -> int:
        """Non-expert parameters of all decoder layers: attention, dense MLPs, routers, shared
        experts (norms and biases neglected)."""
        total = self.num_layers * self.attention_params_per_layer()
        if self.num_layers - self.num_moe_layers:
            total += (self.num_layers - self.num_moe_layers) * self.dense_mlp_params()
        if self.num_moe_layers:
            assert self.hidden_size
            router = self.hidden_size * self.num_experts
            total += self.num_moe_layers * (router + self.shared_expert_params())
        return total

    def dense_weight_params(self) -> int:
        """Non-expert parameters one step reads in full: every layer's attention, dense MLPs,
        routers and shared experts, plus the LM head (the input embedding is only gathered)."""
        return self._layer_dense_params() + self.lm_head_params()

    def expert_params(self) -> int:
        """All routed experts of all MoE layers."""
        return self.num_moe_layers * self.num_experts * self.params_per_expert()

    def total_weight_params(self) -> int:
        """Every parameter held in memory: dense + experts + the input embedding (unless tied)."""
        embedding = 0 if self.tie_word_embeddings else self.lm_head_params()
        return self.dense_weight_params() + self.expert_params() + embedding

    def active_params_per_token(self, include_lm_head: bool = True) -> int:
        """Parameters one token multiplies through (2 FLOPs each): the dense part of every layer
        plus its top-k routed experts, and the LM head (only for tokens that get logits)."""
        body = self._layer_dense_params()
        body += self.num_moe_layers * self.num_experts_per_tok * self.params_per_expert()
        return body + (self.lm_head_params() if include_lm_head else 0)

    @property
    def kv_layers(self) -> int:
        """Layers holding KV: the target's plus the draft's."""
        return self.num_layers + self.draft_layers

    def kv_heads_per_rank(self, tensor_parallel_size: int) -> int:
        """KV heads one TP rank holds: ``max(1, num_kv_heads // tp)``, as vLLM splits them.

        vLLM needs one of the two to divide the other; otherwise :class:`ScenarioError`.
        """
        tp, heads = tensor_parallel_size, self.num_kv_heads
        if tp <= 0:
            raise ScenarioError(f"engine.memory.tensor_parallel_size: must be > 0 (got {tp})")
        if self.is_mla:
            return 1  # the latent, whole on every rank
        if (heads >= tp and heads % tp) or (heads < tp and tp % heads):
            raise ScenarioError(
                f"engine.memory.tensor_parallel_size: {tp} and the model's {heads} KV heads do "
                "not divide one another; vLLM cannot split the heads"
            )
        return max(1, heads // tp)

    def kv_bytes_per_token(self, tensor_parallel_size: int) -> int:
        """KV bytes one token takes on ONE card (all KV layers, this rank's heads)."""
        heads = self.kv_heads_per_rank(tensor_parallel_size)
        return self._kv_tensors * heads * self.head_size * self.dtype_bytes * self.kv_layers

    def kv_read_bytes(self, tensor_parallel_size: int) -> tuple[int, int]:
        """What a decode step's attention reads on ONE card: (bytes per attended context token
        on the layers that attend all of it, bytes per request on the sliding-window layers,
        which read at most ``sliding_window`` tokens: the whole window once the context is
        longer, as the roofline form takes it)."""
        per_layer = self.kv_bytes_per_token(tensor_parallel_size) // self.kv_layers
        sliding = min(self.num_sliding_layers, self.num_layers) if self.sliding_window else 0
        return per_layer * (self.kv_layers - sliding), per_layer * sliding * (self.sliding_window or 0)

    @property
    def _kv_tensors(self) -> int:
        """K and V (2), or MLA's one latent (1)."""
        return 1 if self.is_mla else 2

    def kv_bytes_per_token_total(self) -> int:
        """KV bytes one token takes in the whole model, each head counted once.

        Equals ``kv_bytes_per_token(tp) * tp`` when the heads split evenly; when ``tp`` exceeds
        the KV heads the cards hold replicas, and their sum exceeds this figure.
        """
        return self._kv_tensors * self.num_kv_heads * self.head_size * self.dtype_bytes * self.kv_layers


def _compute_fields(config: dict[str, Any], top: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The weight-shape fields of a config.json (absent ones left out), for the roofline form.

    Routed experts: ``num_local_experts`` (Mixtral), ``n_routed_experts`` (DeepSeek) or
    ``num_experts`` (Qwen-MoE); top-k: ``num_experts_per_tok`` (or ``experts_per_token``);
    shared experts: ``n_shared_experts`` (DeepSeek, expert width each) or one of
    ``shared_expert_intermediate_size`` (Qwen2-MoE); dense layers of an MoE model:
    ``first_k_dense_replace``, or Qwen-MoE's ``decoder_sparse_step`` / ``mlp_only_layers``.
    """

    def opt_int(*names: str) -> int | None:
        for name in names:
            value = config.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    out: dict[str, Any] = {}
    for name in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                 "moe_intermediate_size", "shared_expert_intermediate_size"):
        value = opt_int(name)
        if value is not None:
            out[name] = value
    tie = config.get("tie_word_embeddings", top.get("tie_word_embeddings"))
    if isinstance(tie, bool):
        out["tie_word_embeddings"] = tie
    experts = opt_int("num_local_experts", "n_routed_experts", "num_experts")
    if experts:
        out["num_experts"] = experts
        top_k = opt_int("num_experts_per_tok", "experts_per_token")
        if top_k:
            out["num_experts_per_tok"] = top_k
        shared = opt_int("n_shared_experts")
        if shared:
            out["num_shared_experts"] = shared
        elif "shared_expert_intermediate_size" in out:
            out["num_shared_experts"] = 1
        dense = opt_int("first_k_dense_replace") or 0
        step = opt_int("decoder_sparse_step") or 1
        only = config.get("mlp_only_layers") or []
        if step > 1 or only:
            dense = sum(1 for i in range(num_layers) if i in only or (i + 1) % step)
        if dense:
            out["num_dense_layers"] = min(dense, num_layers)
    return out


def _sliding_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Sliding-window attention of a config.json: ``sliding_window`` with ``layer_types``
    (entries ``"sliding_attention"``, as gpt-oss and Gemma write them), or with every layer
    sliding when ``layer_types`` is absent (Mistral's ``sliding_window``); none where
    ``use_sliding_window`` is false."""
    window = config.get("sliding_window")
    if config.get("use_sliding_window") is False:  # Qwen2/3 write a window they do not use
        return {}
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return {}
    types = config.get("layer_types")
    if isinstance(types, list):
        sliding = sum(1 for t in types if t == "sliding_attention")
    else:
        sliding = config.get("num_hidden_layers") or 0
    return {"sliding_window": window, "num_sliding_layers": sliding} if sliding else {}


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """Read a ``config.json`` file into a dict; any problem is a one-line ScenarioError."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ScenarioError(f"model.config: cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ScenarioError(f"model.config: {path} is not JSON (line {exc.lineno}): {exc.msg}") from None
    if not isinstance(data, dict):
        raise ScenarioError(f"model.config: {path} holds no JSON object")
    return data


# --------------------------------------------------------------------------- memory spec


class MemorySpec(_Model):
    """One card's memory and what vLLM takes from it before the KV cache; all GB = 10**9 bytes.

    Every ``*_gb`` is per card. ``reserve_cuda_graphs=False`` reproduces
    ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0`` (the KV estimate ignores the graphs, which then
    live in the ``1 - gpu_memory_utilization`` margin). The profiling run's activations are
    ``activation_gb_fixed + activation_gb_per_batched_token x max_num_batched_tokens``; the fixed
    term also absorbs non-torch memory (communication buffers, allocator slack) the profiler sees.
    """

    gpu_memory_gb: float = Field(
        gt=0.0, le=MAX_CARD_GB, description="Total memory of one card, GB."
    )
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    weights_gb: float = Field(
        ge=0.0, le=MAX_CARD_GB, description="Weights on one card (target + draft), GB."
    )
    cuda_graph_gb: float = Field(
        0.0, ge=0.0, le=MAX_CARD_GB, description="CUDA-graph capture memory, GB."
    )
    reserve_cuda_graphs: bool = Field(True, description="Whether the KV estimate subtracts graphs.")
    activation_gb_fixed: float = Field(0.0, ge=0.0, le=MAX_CARD_GB)
    activation_gb_per_batched_token: float = Field(0.0, ge=0.0, le=MAX_CARD_GB)
    tensor_parallel_size: int = Field(1, gt=0)
    model: ModelShape
    kv_cache_gb: float | None = Field(
        None, gt=0.0, le=MAX_CARD_GB, description="Measured KV size per card, GB."
    )
    num_gpu_blocks: int | None = Field(None, gt=1, description="Measured pool size, blocks.")

    @property
    def usable_gb(self) -> float:
        """``gpu_memory_gb x gpu_memory_utilization``: what vLLM may use on one card."""
        return self.gpu_memory_gb * self.gpu_memory_utilization

    def activation_gb(self, max_num_batched_tokens: int) -> float:
        """Peak activation memory of the profiling run at this batch budget, GB per card."""
        return self.activation_gb_fixed + self.activation_gb_per_batched_token * max_num_batched_tokens

    def reserved_graph_gb(self) -> float:
        """Graph memory the estimate subtracts: ``cuda_graph_gb`` if reserved, else 0."""
        return self.cuda_graph_gb if self.reserve_cuda_graphs else 0.0

    def kv_budget_gb(self, max_num_batched_tokens: int) -> float:
        """The estimated KV share of one card (may be <= 0: nothing left)."""
        return (self.usable_gb - self.weights_gb - self.reserved_graph_gb()
                - self.activation_gb(max_num_batched_tokens))


def parse_memory_spec(data: Any, *, path: str = "engine.memory") -> MemorySpec:
    """Validate a dict (e.g. a YAML section) into a MemorySpec; errors name ``path.field``."""
    try:
        return MemorySpec.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join([path, *(str(p) for p in err["loc"])])
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(MemorySpec.model_fields)
            raise ScenarioError(f"{where}: unknown key; allowed keys: {allowed}") from None
        if err["type"] == "missing":
            raise ScenarioError(f"{where}: required field is missing") from None
        got = err.get("input")
        shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
        text = err["msg"]
        raise ScenarioError(f"{where}: {text[0].lower()}{text[1:]}{shown}") from None


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class KVPlan:
    """The KV pool of one deployment and how it came about; GB = 10**9 bytes, per card."""

    usable_gb: float  # gpu_memory_gb x gpu_memory_utilization
    weights_gb: float
    cuda_graph_gb: float  # as subtracted: 0 when the estimate does not reserve graphs
    activation_gb: float  # profiling-run activations at max_num_batched_tokens
    kv_gb: float  # KV share: estimate, measured kv_cache_gb, or blocks x page when blocks measured
    kv_bytes_per_token_per_card: int
    block_size: int
    page_bytes_per_block_per_card: int
    num_gpu_blocks: int
    pool_tokens: int  # num_gpu_blocks x block_size, vLLM's "GPU KV cache size"
    usable_tokens: int  # (num_gpu_blocks - 1) x block_size: block 0 is reserved
    max_model_len: int
    blocks_per_max_model_len: int  # cdiv(max_model_len, block_size)
    max_concurrency_at_max_model_len: float  # vLLM's log: num_gpu_blocks / cdiv(...)
    max_model_len_fits: bool  # one request of max_model_len fits in usable_tokens
    source: KVSource

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field, for JSON/YAML reports."""
        return asdict(self)


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ScenarioError(f"engine.{name}: must be a positive integer (got {value!r})")


def plan_kv(
    spec: MemorySpec,
    *,
    block_size: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    require_fit: bool = True,
) -> KVPlan:
    """Size the KV pool of one deployment the way vLLM does at start-up.

    Raises :class:`ScenarioError` (one line, naming the field) when the memory leaves nothing
    (or under two blocks) for the KV cache, and, with ``require_fit`` (default), when one request
    of ``max_model_len`` tokens can never fit the pool; ``require_fit=False`` returns the plan with
    ``max_model_len_fits=False`` instead, for what-if questions ("will 128K fit?").
    """
    _positive("block_size", block_size)
    _positive("max_model_len", max_model_len)
    _positive("max_num_batched_tokens", max_num_batched_tokens)
    tp = spec.tensor_parallel_size
    per_token = spec.model.kv_bytes_per_token(tp)
    page = per_token * block_size
    graphs = spec.reserved_graph_gb()
    activation = spec.activation_gb(max_num_batched_tokens)
    source: KVSource
    if spec.num_gpu_blocks is not None:
        source, blocks = "measured num_gpu_blocks", spec.num_gpu_blocks
        kv_gb = blocks * page / GB
    elif spec.kv_cache_gb is not None:
        source, kv_gb = "measured kv_cache_gb", spec.kv_cache_gb
        blocks = math.floor(kv_gb * GB / page)
    else:
        source, kv_gb = "estimate", spec.kv_budget_gb(max_num_batched_tokens)
        if kv_gb <= 0:
            parts = [f"weights {_fmt(spec.weights_gb)} GB"]
            if graphs:
                parts.append(f"graphs {_fmt(graphs)} GB")
            parts.append(f"activations {_fmt(activation)} GB")
            raise ScenarioError(
                f"engine.memory: {' + '.join(parts)} exceed usable {_fmt(spec.usable_gb)} GB "
                f"({spec.gpu_memory_gb:g} x {spec.gpu_memory_utilization:g}) by {_fmt(-kv_gb)} GB"
            )
        blocks = math.floor(kv_gb * GB / page)
    if blocks < 2:
        raise ScenarioError(
            f"engine.memory: a KV share of {_fmt(kv_gb)} GB per card holds {blocks} block(s) of "
            f"{page} bytes; vLLM needs at least 2 (block 0 is reserved)"
        )
    per_seq = -(-max_model_len // block_size)
    fits = (blocks - 1) >= per_seq
    if not fits and require_fit:
        raise ScenarioError(
            f"engine.max_model_len: {max_model_len} tokens need {per_seq + 1} blocks "
            f"({per_seq} + reserved block 0) of {block_size} but the pool has {blocks} "
            f"(short by {per_seq + 1 - blocks} blocks)"
        )
    return KVPlan(
        usable_gb=spec.usable_gb,
        weights_gb=spec.weights_gb,
        cuda_graph_gb=graphs,
        activation_gb=activation,
        kv_gb=kv_gb,
        kv_bytes_per_token_per_card=per_token,
        block_size=block_size,
        page_bytes_per_block_per_card=page,
        num_gpu_blocks=blocks,
        pool_tokens=blocks * block_size,
        usable_tokens=(blocks - 1) * block_size,
        max_model_len=max_model_len,
        blocks_per_max_model_len=per_seq,
        max_concurrency_at_max_model_len=blocks / per_seq,
        max_model_len_fits=fits,
        source=source,
    )


# --------------------------------------------------------------------------- calibration


def fit_activation_per_token(
    points: Sequence[tuple[int, int]], bytes_per_token_per_card: int
) -> float:
    """GB of activation memory per batched token, from pools measured at different budgets.

    ``points`` are ``(max_num_batched_tokens, pool_tokens)`` pairs with everything else equal;
    ``pool_tokens`` as vLLM logs it (``num_gpu_blocks x block_size``). The pool shrinks by the
    activation growth: coefficient = -slope of (pool_tokens x bytes_per_token_per_card) against
    the budget, least squares over all points (with two: delta pool x bytes / delta budget).
    Each pool is floored to whole blocks, so the result carries up to two blocks' bytes over the
    budget difference of error.
    """
    if len(points) < 2 or len({b for b, _ in points}) < 2:
        raise ScenarioError(
            "calibration.points: need pools measured at two or more different max_num_batched_tokens"
        )
    if bytes_per_token_per_card <= 0:
        raise ScenarioError(
            f"calibration.bytes_per_token_per_card: must be > 0 (got {bytes_per_token_per_card})"
        )
    xs = [float(b) for b, _ in points]
    ys = [float(p) * bytes_per_token_per_card for _, p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    coef = -slope / GB
    if coef < 0:
        raise ScenarioError(
            "calibration.points: the pool grows with max_num_batched_tokens; an activation "
            f"coefficient cannot be negative (got {coef:.3g} GB per token)"
        )
    return coef


def fit_activation_fixed(spec: MemorySpec, *, kv_cache_gb: float, max_num_batched_tokens: int) -> float:
    """``activation_gb_fixed`` that makes the estimate of ``spec`` give ``kv_cache_gb`` per card.

    Use after :func:`fit_activation_per_token`: with both terms the estimate reproduces the
    measured pool at one budget and predicts it at others. The fixed term is what the profiler
    saw beyond weights, reserved graphs and the per-token activations.
    """
    fixed = (spec.usable_gb - spec.weights_gb - spec.reserved_graph_gb() - kv_cache_gb
             - spec.activation_gb_per_batched_token * max_num_batched_tokens)
    if fixed < 0:
        raise ScenarioError(
            f"calibration.kv_cache_gb: {_fmt(kv_cache_gb)} GB of KV is more than the spec leaves "
            f"before fixed activations ({_fmt(kv_cache_gb + fixed)} GB); check gpu_memory_gb, "
            "weights_gb and cuda_graph_gb"
        )
    return fixed
