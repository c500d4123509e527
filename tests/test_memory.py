"""KV arithmetic (simcap.catalog.memory): hand-computed cases, the field's two deployments, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simcap.errors import ScenarioError
from simcap.catalog.memory import (
    GB,
    GiB,
    KVPlan,
    MemorySpec,
    ModelShape,
    fit_activation_fixed,
    fit_activation_per_token,
    load_hf_config,
    parse_memory_spec,
    plan_kv,
)

SHAPES = Path(__file__).resolve().parents[1] / "calibration" / "data" / "model-shapes"
TOY = ModelShape(num_layers=4, num_kv_heads=2, head_size=64, dtype_bytes=2)


def m27(**kw) -> ModelShape:
    """MiniMax-M2.7 + one EAGLE3 draft layer, as deployed on the 910B4s."""
    return ModelShape.from_hf_config(load_hf_config(SHAPES / "minimax-m2.7.json"), draft_layers=1, **kw)


def spec(**kw) -> MemorySpec:
    values = dict(gpu_memory_gb=80.0, weights_gb=10.0, model=TOY)
    values.update(kw)
    return MemorySpec(**values)


def one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(ScenarioError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# --------------------------------------------------------------------------- (e) hand-computed


def test_toy_bytes_per_token():
    assert TOY.kv_bytes_per_token(1) == 2 * 2 * 64 * 2 * 4 == 2048
    assert TOY.kv_bytes_per_token_total() == 2048


def test_toy_one_gib_of_kv_gives_16384_blocks():
    plan = plan_kv(spec(kv_cache_gb=GiB / GB), block_size=32, max_model_len=4096,
                   max_num_batched_tokens=2048)
    assert plan.page_bytes_per_block_per_card == 2048 * 32 == 65536
    assert plan.num_gpu_blocks == 2**30 // 65536 == 16384
    assert plan.pool_tokens == 16384 * 32
    assert plan.usable_tokens == 16383 * 32
    assert plan.blocks_per_max_model_len == 128
    assert plan.max_concurrency_at_max_model_len == 16384 / 128
    assert plan.source == "measured kv_cache_gb"


def test_estimate_subtracts_weights_graphs_and_activations():
    s = spec(gpu_memory_utilization=0.9, weights_gb=60.0, cuda_graph_gb=4.0,
             activation_gb_fixed=1.0, activation_gb_per_batched_token=1e-4)
    plan = plan_kv(s, block_size=16, max_model_len=4096, max_num_batched_tokens=10000)
    assert plan.usable_gb == pytest.approx(72.0)
    assert plan.activation_gb == pytest.approx(2.0)
    assert plan.kv_gb == pytest.approx(72.0 - 60.0 - 4.0 - 2.0)
    assert plan.num_gpu_blocks == math.floor(6.0e9 / (2048 * 16))
    assert plan.source == "estimate"
    # VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0: the graphs are not subtracted.
    off = plan_kv(s.model_copy(update={"reserve_cuda_graphs": False}), block_size=16,
                  max_model_len=4096, max_num_batched_tokens=10000)
    assert off.cuda_graph_gb == 0.0 and off.kv_gb == pytest.approx(10.0)


def test_lower_batch_budget_grows_the_pool():
    s = spec(weights_gb=60.0, activation_gb_per_batched_token=1e-4)
    small = plan_kv(s, block_size=16, max_model_len=4096, max_num_batched_tokens=2048)
    large = plan_kv(s, block_size=16, max_model_len=4096, max_num_batched_tokens=32768)
    assert small.num_gpu_blocks > large.num_gpu_blocks


def test_measured_blocks_win_over_kv_size_which_wins_over_estimate():
    s = spec(weights_gb=100.0, kv_cache_gb=1.0, num_gpu_blocks=500)  # estimate alone would fail
    plan = plan_kv(s, block_size=16, max_model_len=4096, max_num_batched_tokens=2048)
    assert plan.source == "measured num_gpu_blocks" and plan.num_gpu_blocks == 500
    assert plan.kv_gb == pytest.approx(500 * 2048 * 16 / GB)
    plan = plan_kv(s.model_copy(update={"num_gpu_blocks": None}), block_size=16,
                   max_model_len=4096, max_num_batched_tokens=2048)
    assert plan.source == "measured kv_cache_gb" and plan.num_gpu_blocks == 1_000_000_000 // 32768


def test_plan_to_dict_has_the_breakdown():
    plan = plan_kv(spec(), block_size=16, max_model_len=4096, max_num_batched_tokens=2048)
    d = plan.to_dict()
    assert isinstance(plan, KVPlan)
    assert d["num_gpu_blocks"] == plan.num_gpu_blocks and d["source"] == "estimate"
    assert json.loads(json.dumps(d)) == d


@given(budget=st.integers(1, 65536), extra=st.integers(1, 65536),
       per_token=st.floats(0.0, 1e-4), weights=st.floats(0.0, 60.0))
def test_blocks_floor_the_kv_share_and_never_grow_with_the_budget(budget, extra, per_token, weights):
    s = spec(weights_gb=weights, activation_gb_per_batched_token=per_token)
    plan = lambda n: plan_kv(s, block_size=16, max_model_len=64, max_num_batched_tokens=n)  # noqa: E731
    try:
        a = plan(budget)
    except ScenarioError:
        # Memory too small at this budget (weights + activations, or too few blocks): then
        # at every larger budget too.
        with pytest.raises(ScenarioError):
            plan(budget + extra)
        return
    try:
        b = plan(budget + extra)
    except ScenarioError:
        return  # a larger budget left no room: fewer blocks, as the property says
    assert b.num_gpu_blocks <= a.num_gpu_blocks
    page = a.page_bytes_per_block_per_card
    assert a.num_gpu_blocks * page <= a.kv_gb * GB < (a.num_gpu_blocks + 1) * page


# --------------------------------------------------------------------------- (g) shapes


def test_tp_splits_kv_heads_and_replicates_when_fewer_heads_than_ranks():
    assert TOY.kv_bytes_per_token(2) == 1024  # one head per rank
    assert TOY.kv_bytes_per_token(4) == 1024  # 2 heads on 4 ranks: each holds one replica
    assert TOY.kv_heads_per_rank(4) == 1
    assert TOY.kv_bytes_per_token_total() == 2048
    msg = one_line_error(TOY.kv_bytes_per_token, 3)
    assert msg.startswith("engine.memory.tensor_parallel_size: 3 and the model's 2 KV heads")


def test_fp8_kv_cache_dtype_halves_bf16():
    assert m27(kv_cache_dtype="fp8").kv_bytes_per_token_total() == 258048 // 2
    assert m27(kv_cache_dtype="auto").dtype_bytes == 2
    msg = one_line_error(m27, kv_cache_dtype="fp4_magic")
    assert msg.startswith("engine.kv_cache_dtype: unknown dtype 'fp4_magic'")


def test_hf_config_fallbacks():
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512,
           "head_dim": None, "dtype": "float16"}
    shape = ModelShape.from_hf_config(cfg)  # MHA: KV heads = attention heads; head = 512 / 8
    assert (shape.num_kv_heads, shape.head_size, shape.dtype_bytes) == (8, 64, 2)
    nested = ModelShape.from_hf_config({"torch_dtype": "bfloat16", "text_config": {
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}})
    assert nested.kv_bytes_per_token(1) == 2 * 2 * 32 * 2 * 3


@pytest.mark.parametrize("drop, expected", [
    ("num_hidden_layers", "model.config: config.json has no num_hidden_layers"),
    ("torch_dtype", "model.config: config.json has no torch_dtype (or dtype); give kv_cache_dtype"),
])
def test_missing_config_fields_are_named(drop, expected):
    cfg = load_hf_config(SHAPES / "minimax-m2.7.json")
    del cfg[drop]
    assert one_line_error(ModelShape.from_hf_config, cfg) == expected


def test_missing_heads_and_bad_values_are_named():
    cfg = {"num_hidden_layers": 2, "hidden_size": 512, "torch_dtype": "bfloat16"}
    assert one_line_error(ModelShape.from_hf_config, cfg) == (
        "model.config: config.json has no num_key_value_heads (or num_attention_heads)")
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 8, "torch_dtype": "bfloat16"}
    assert one_line_error(ModelShape.from_hf_config, cfg) == "model.config: config.json has no hidden_size"
    cfg = {"num_hidden_layers": "62", "num_attention_heads": 8, "torch_dtype": "bfloat16"}
    assert one_line_error(ModelShape.from_hf_config, cfg).startswith(
        "model.config: num_hidden_layers must be a positive integer")
    mla = {"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512, "torch_dtype": "bfloat16"}
    assert one_line_error(ModelShape.from_hf_config, mla) == "model.config: config.json has no qk_rope_head_dim"
    assert one_line_error(load_hf_config, SHAPES / "no-such.json").startswith("model.config: cannot read")


# --------------------------------------------------------------------------- (f) bad input


def test_memory_that_leaves_nothing_for_kv():
    s = spec(gpu_memory_gb=80, gpu_memory_utilization=0.9, weights_gb=68.5, cuda_graph_gb=4.1,
             activation_gb_fixed=1.2)
    msg = one_line_error(plan_kv, s, block_size=128, max_model_len=4096, max_num_batched_tokens=4096)
    assert msg == ("engine.memory: weights 68.5 GB + graphs 4.1 GB + activations 1.2 GB exceed "
                   "usable 72.0 GB (80 x 0.9) by 1.8 GB")


def test_kv_share_under_two_blocks():
    s = spec(kv_cache_gb=2048 * 16 * 1.5 / GB)
    msg = one_line_error(plan_kv, s, block_size=16, max_model_len=16, max_num_batched_tokens=16)
    assert msg.startswith("engine.memory: a KV share of") and "holds 1 block(s)" in msg


def test_max_model_len_that_never_fits():
    s = spec(num_gpu_blocks=800)
    msg = one_line_error(plan_kv, s, block_size=128, max_model_len=131072, max_num_batched_tokens=8192)
    assert msg == ("engine.max_model_len: 131072 tokens need 1025 blocks (1024 + reserved block 0) "
                   "of 128 but the pool has 800 (short by 225 blocks)")
    plan = plan_kv(s, block_size=128, max_model_len=131072, max_num_batched_tokens=8192,
                   require_fit=False)
    assert plan.max_model_len_fits is False
    assert plan.max_concurrency_at_max_model_len == 800 / 1024


def test_bad_engine_integers_and_spec_fields():
    msg = one_line_error(plan_kv, spec(), block_size=0, max_model_len=16, max_num_batched_tokens=16)
    assert msg == "engine.block_size: must be a positive integer (got 0)"
    data = dict(gpu_memory_gb=80, weights_gb=10, model=TOY.model_dump())
    assert parse_memory_spec(data).usable_gb == pytest.approx(72.0)
    msg = one_line_error(parse_memory_spec, {**data, "gpu_memory_utilization": 1.5})
    assert msg.startswith("engine.memory.gpu_memory_utilization: input should be less than or equal to 1")
    msg = one_line_error(parse_memory_spec, {**data, "gpu_mem": 1})
    assert msg.startswith("engine.memory.gpu_mem: unknown key; allowed keys: gpu_memory_gb,")
    msg = one_line_error(parse_memory_spec, {"gpu_memory_gb": 80, "model": TOY.model_dump()})
    assert msg == "engine.memory.weights_gb: required field is missing"
    msg = one_line_error(parse_memory_spec, {**data, "model": {**TOY.model_dump(), "head_size": 0}})
    assert msg.startswith("engine.memory.model.head_size: input should be greater than 0")


def test_fit_errors():
    assert one_line_error(fit_activation_per_token, [(8192, 100)], 10).startswith("calibration.points:")
    assert one_line_error(fit_activation_per_token, [(8192, 100), (8192, 90)], 10).startswith(
        "calibration.points:")
    assert "grows" in one_line_error(fit_activation_per_token, [(8192, 100), (16384, 200)], 10)
    msg = one_line_error(fit_activation_fixed, spec(weights_gb=70.0), kv_cache_gb=5.0,
                         max_num_batched_tokens=2048)
    assert msg.startswith("calibration.kv_cache_gb: 5.0 GB of KV is more than the spec leaves")


# --------------------------------------------------------------------------- field: 910B4


M27_TP = 8
M27_PER_CARD = 258048 // 8  # 32256 bytes per token per card
POOL_AT_32768, POOL_AT_8192 = 695_936, 767_872
KV_GB_AT_32768 = 20.91 * GiB / GB  # the published "20.91 GiB per card", in GB


def test_a_minimax_m27_with_eagle3_is_252_kib_per_token():
    shape = m27()
    assert (shape.num_layers, shape.num_kv_heads, shape.head_size, shape.dtype_bytes) == (62, 8, 128, 2)
    assert shape.kv_bytes_per_token_total() == 63 * 2 * 8 * 128 * 2 == 258_048 == 252 * 1024
    assert shape.kv_bytes_per_token(M27_TP) == M27_PER_CARD == 32_256  # one KV head per card


def test_b_910b4_pool_from_20_91_gib_per_card():
    s = MemorySpec(gpu_memory_gb=64 * GiB / GB, gpu_memory_utilization=0.85,
                   weights_gb=(216 + 2.68) / 8, tensor_parallel_size=M27_TP, model=m27(),
                   kv_cache_gb=KV_GB_AT_32768)
    plan = plan_kv(s, block_size=128, max_model_len=204_800, max_num_batched_tokens=32768)
    # 20.91 GiB / (32256 x 128) = 5437.93 -> 5437 blocks x 128 = 695,936: the published pool.
    assert abs(plan.pool_tokens - POOL_AT_32768) / POOL_AT_32768 < 1e-3
    assert plan.num_gpu_blocks == 5437 and plan.pool_tokens == POOL_AT_32768
    assert plan.max_concurrency_at_max_model_len == pytest.approx(5437 / 1600)


def test_c_activation_coefficient_from_the_two_budgets_and_pool_predicted_back():
    coef = fit_activation_per_token([(32768, POOL_AT_32768), (8192, POOL_AT_8192)], M27_PER_CARD)
    by_hand = (POOL_AT_8192 - POOL_AT_32768) * M27_PER_CARD / (32768 - 8192)  # bytes per token
    assert by_hand == 71_936 * 32_256 / 24_576 == 94_416.0
    assert coef == pytest.approx(by_hand / GB) == pytest.approx(9.4416e-05)
    # Build an estimate: card taken as 64 GiB (assumption: the 64 GB 910B4 variant, the only one
    # that holds 27 GB of weights and 22 GB of KV); the fixed term absorbs everything else.
    base = MemorySpec(gpu_memory_gb=64 * GiB / GB, gpu_memory_utilization=0.85,
                      weights_gb=(216 + 2.68) / 8, tensor_parallel_size=M27_TP, model=m27(),
                      activation_gb_per_batched_token=coef)
    fixed = fit_activation_fixed(base, kv_cache_gb=KV_GB_AT_32768, max_num_batched_tokens=32768)
    s = MemorySpec(**{**base.model_dump(), "activation_gb_fixed": fixed})
    at_32768 = plan_kv(s, block_size=128, max_model_len=204_800, max_num_batched_tokens=32768)
    at_8192 = plan_kv(s, block_size=128, max_model_len=204_800, max_num_batched_tokens=8192)
    assert at_32768.source == "estimate" and at_32768.kv_gb == pytest.approx(KV_GB_AT_32768)
    assert at_32768.pool_tokens == POOL_AT_32768
    assert at_8192.pool_tokens == POOL_AT_8192  # 5999 blocks
    assert at_8192.activation_gb == pytest.approx(fixed + coef * 8192)


# --------------------------------------------------------------------------- field: A800


# ASSUMPTION (not measured; see calibration/data/model-shapes/minimax-m3.json): MiniMax-M3 KV is
# 60 layers + 1 EAGLE3 draft layer, one KV head of 128 per card at TP8 (4 or 8 KV heads, either
# way one per rank), bf16, and no indexer side cache: 61 x 2 x 1 x 128 x 2 = 31,232 B/token/card.
M3_ASSUMED_PER_CARD = 31_232


def test_d_a800_kv_share_to_pool_under_the_stated_m3_assumption():
    cfg = load_hf_config(SHAPES / "minimax-m3.json")
    assert "ASSUMED" in cfg["_assumption"]
    shape = ModelShape.from_hf_config(cfg, draft_layers=1)
    assert shape.kv_bytes_per_token(8) == M3_ASSUMED_PER_CARD == 61 * 2 * 1 * 128 * 2
    kv_gb = 10.2  # field: "KV cache ~10.2 GB" per card (GB = 10**9 bytes)
    s = MemorySpec(gpu_memory_gb=81.9, gpu_memory_utilization=0.99, weights_gb=58.5,
                   cuda_graph_gb=4.1, reserve_cuda_graphs=False, tensor_parallel_size=8,
                   model=shape, kv_cache_gb=kv_gb)
    plan = plan_kv(s, block_size=128, max_model_len=131072, max_num_batched_tokens=4096)
    page = M3_ASSUMED_PER_CARD * 128
    assert plan.page_bytes_per_block_per_card == page == 3_997_696
    assert plan.num_gpu_blocks == math.floor(10.2e9 / page) == 2551  # 2551.47
    assert plan.pool_tokens == 2551 * 128 == 326_528
    assert plan.usable_tokens == 326_400
    assert plan.blocks_per_max_model_len == 1024 and plan.max_model_len_fits
    assert plan.max_concurrency_at_max_model_len == pytest.approx(2551 / 1024)  # 2.49
    assert plan.cuda_graph_gb == 0.0  # VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0


def test_mla_caches_one_latent_per_token_whole_on_every_rank():
    """DeepSeek-R1 (the catalog's shape, from its config.json), by hand: the cache holds
    kv_lora_rank + qk_rope_head_dim = 576 bf16 values per token and layer, 61 layers: 70,272
    bytes, the same on each of 8 TP ranks (vLLM's MLA spec: one KV head, no separate V).
    Attention weights per layer: q 1536 x (7168 + 128 x 192), kv 7168 x 576 + 512 x 128 x 256,
    o 128 x 128 x 7168. Totals: 671.0B parameters (published 671B), 36.6B active (37B)."""
    from simcap.catalog import resolve_model

    m = resolve_model("deepseek-r1", path="step_time.model")
    assert (m.num_kv_heads, m.head_size, m.is_mla) == (1, 576, True)
    assert m.kv_bytes_per_token(8) == m.kv_bytes_per_token(1) == m.kv_bytes_per_token_total() == 576 * 2 * 61
    assert m.kv_heads_per_rank(8) == 1
    assert m.attention_params_per_layer() == 1536 * (7168 + 128 * 192) + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    assert round(m.total_weight_params() / 1e9, 1) == 671.0
    assert round(m.active_params_per_token() / 1e9, 1) == 36.6
    assert m.attention_flops_per_pair() == 2 * 61 * 128 * (576 + 512)
    # A standard model's pair: QK and AV over head_size each (4 x layers x heads x head_size).
    plain = ModelShape(num_layers=2, num_kv_heads=2, head_size=64, dtype_bytes=2, num_attention_heads=8)
    assert plain.attention_flops_per_pair() == 4 * 2 * 8 * 64 and not plain.is_mla
