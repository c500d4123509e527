"""The roofline step-time form: each physical term against hand-computed cases, the catalog,
validation, the calibration basis, and monotonicity in tokens and context."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simcap.catalog import hardware_names, model_names, resolve_hardware, resolve_model
from simcap.engine.scheduler import SchedulerOutput
from simcap.engine.step_time import (
    ROOFLINE_FEATURES,
    RooflineStepTimeModel,
    StepTimeModel,
    make_step_model,
)
from simcap.catalog.memory import ModelShape
from simcap.config.scenario import StepTimeConfig
from simcap.errors import ScenarioError
from tests.conftest import make_request, make_scheduler

# 1e12 B/s memory, 1e14 FLOP/s bf16, 1e11 B/s link with 5 us latency
HW = {"memory_gb": 80, "memory_bandwidth_gbps": 1000, "peak_tflops": {"bf16": 100, "fp8": 200},
      "interconnect": {"name": "link", "bandwidth_gbps": 100, "latency_us": 5}}
# 2 layers, hidden 64, 4 query heads, 2 KV heads of 16, dense MLP 128, vocab 1000, bf16
DENSE = {"num_layers": 2, "num_kv_heads": 2, "head_size": 16, "dtype_bytes": 2,
         "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 1000}
ATTN = 64 * 16 * 2 * (4 + 2)  # q, k, v, o per layer
MLP = 3 * 64 * 128
LM = 1000 * 64
MOE = {**DENSE, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 32}


def config(**kw) -> StepTimeConfig:
    values = {"form": "roofline", "base": 0.0, "hardware": HW, "model": DENSE, **kw}
    return StepTimeConfig(**values)


def model(**kw) -> RooflineStepTimeModel:
    spec = kw.pop("speculative", None)
    cfg = config(**kw)
    return make_step_model(cfg, speculative_method=spec[0] if spec else None,
                           num_speculative_tokens=spec[1] if spec else 0)


def step(prefill=0, decode=0, verify=0, reqs=None, context=0, pairs=0, decode_reqs=None):
    reqs = reqs if reqs is not None else decode + (1 if prefill else 0)
    decode_reqs = decode if decode_reqs is None else decode_reqs
    return SchedulerOutput(
        reqs=[None] * reqs, total_num_scheduled_tokens=prefill + decode + verify,
        num_prefill_tokens=prefill, num_decode_tokens=decode, num_decode_reqs=decode_reqs,
        num_verify_tokens=verify, num_context_tokens=context, num_prefill_pairs=pairs,
    )


def terms(m: RooflineStepTimeModel, out: SchedulerOutput) -> dict[str, float]:
    return dict(zip(ROOFLINE_FEATURES, m.features(out)))


# --------------------------------------------------------------------------- terms


def test_shape_counts_and_dense_terms_by_hand():
    shape = ModelShape(**DENSE)
    assert shape.dense_weight_params() == 2 * (ATTN + MLP) + LM
    assert shape.total_weight_params() == 2 * (ATTN + MLP) + 2 * LM  # untied embedding
    assert shape.active_params_per_token(include_lm_head=False) == 2 * (ATTN + MLP)
    m = model()
    t = terms(m, step(decode=3, context=300))
    assert t["weights"] == pytest.approx((2 * (ATTN + MLP) + LM) * 2 / 1e12)
    assert t["experts"] == 0.0
    # 3 tokens through the layers, 3 rows of logits
    assert t["compute"] == pytest.approx((2 * 2 * (ATTN + MLP) * 3 + 2 * LM * 3) / 1e14)
    assert t["kv_read"] == pytest.approx(300 * (2 * 2 * 16 * 2 * 2) / 1e12)  # 256 B a token
    assert t["tp_comm"] == t["tp_latency"] == t["draft"] == t["attention_prefill"] == 0.0
    assert m.forward_time(step(decode=3, context=300)) == pytest.approx(
        t["weights"] + t["compute"] + t["kv_read"])


def test_prefill_attention_pairs_by_hand():
    m = model()
    t = terms(m, step(prefill=10, pairs=55, context=10))
    assert t["attention_prefill"] == pytest.approx(4 * 2 * 4 * 16 * 55 / 1e14)


def test_scheduler_counts_causal_pairs_of_each_prefill_chunk():
    scheduler = make_scheduler(max_num_batched_tokens=10, long_prefill_token_threshold=0)
    scheduler.add_request(make_request(0, 25, 4))
    pairs = []
    while scheduler.running or scheduler.waiting:
        out = scheduler.schedule()
        pairs.append(out.num_prefill_pairs)
        scheduler.update_from_output(out)
        if len(pairs) == 4:
            break
    # chunks 10, 10, 5 after 0, 10, 20 computed tokens; then a decode step
    assert pairs == [55, 10 * 10 + 55, 5 * 20 + 15, 0]
    assert sum(pairs) == 25 * 26 // 2


def test_distinct_experts_uniform_and_skewed():
    m = model(model=MOE)
    ph = m.physics
    distinct = {n: 256 * ph.experts(n) / ph.experts_all for n in (1, 8, 16, 32, 64, 128)}
    assert distinct[1] == pytest.approx(8.0)
    assert round(distinct[8]) == 57 and round(distinct[16]) == 102 and round(distinct[32]) == 163
    assert round(distinct[64]) == 222 and round(distinct[128]) == 252
    per_expert = 3 * 64 * 32 * 2  # bytes
    assert ph.experts_all == pytest.approx(2 * 256 * per_expert / 1e12)
    # skew 0.75: as if top-8 of 64; never fewer experts than k
    sk = model(model=MOE, routing_skew=0.75).physics
    assert sk.experts(1) == pytest.approx(ph.experts(1))
    assert sk.experts(16) / sk.experts_all * 64 == pytest.approx(64 * (1 - (1 - 8 / 64) ** 16))
    assert sk.experts(16) < ph.experts(16)
    full = model(model=MOE, routing_skew=0.99).physics  # E_eff = k: every token reads all 8
    assert full.experts(1) == full.experts(50) == pytest.approx(full.experts_all)


def test_moe_active_params_and_weights():
    shape = ModelShape(**MOE, num_shared_experts=1, num_dense_layers=1)
    expert = 3 * 64 * 32
    router = 64 * 256
    assert shape.num_moe_layers == 1
    assert shape.params_per_expert() == expert
    assert shape.dense_weight_params() == 2 * ATTN + MLP + router + expert + LM
    assert shape.active_params_per_token(include_lm_head=False) == (
        2 * ATTN + MLP + router + expert + 8 * expert)
    assert shape.expert_params() == 256 * expert


def test_expert_parallel_reads_the_same_expected_bytes_per_rank():
    tp = model(model=MOE, tensor_parallel_size=2).physics
    ep = model(model=MOE, tensor_parallel_size=2, expert_parallel=True).physics
    assert ep.experts(16) == pytest.approx(tp.experts(16))
    one = model(model=MOE).physics
    assert tp.experts(16) == pytest.approx(one.experts(16) / 2)


def test_mxfp4_experts_cost_their_bytes_and_the_rest_its_own_dtype():
    bf16 = model(model=MOE).physics
    fp4 = model(model=MOE, expert_weight_dtype="mxfp4").physics
    # 4.25 bits per weight (4-bit elements, one 8-bit scale per 32) against bf16's 16
    assert fp4.experts_all == pytest.approx(bf16.experts_all * 4.25 / 16)
    assert fp4.weights == pytest.approx(bf16.weights)
    assert fp4.compute_per_token == pytest.approx(bf16.compute_per_token)


def test_sliding_window_layers_read_their_window_per_request():
    shape = {**DENSE, "sliding_window": 8, "num_sliding_layers": 1}
    t = terms(model(model=shape), step(decode=3, context=300))
    # one full layer reads every context token (2 KV heads x 16 x 2 bytes x K and V = 128 B);
    # the sliding layer reads its 8-token window for each of the 3 requests
    assert t["kv_read"] == pytest.approx((300 * 128 + 3 * 8 * 128) / 1e12)
    m = model(model=shape, efficiency={"kv_read": 2.0})
    full = model(efficiency={"kv_read": 2.0})
    out = step(decode=3, context=300)
    assert m.forward_time(out) == pytest.approx(full.forward_time(out) - 2 * (300 - 3 * 8) * 128 / 1e12)


def test_hf_config_reads_sliding_layers():
    base = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "hidden_size": 64, "torch_dtype": "bfloat16"}
    gpt_oss = ModelShape.from_hf_config(
        {**base, "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert (gpt_oss.sliding_window, gpt_oss.num_sliding_layers) == (128, 2)
    mistral = ModelShape.from_hf_config({**base, "sliding_window": 4096})
    assert mistral.num_sliding_layers == 4
    qwen = ModelShape.from_hf_config({**base, "sliding_window": 4096, "use_sliding_window": False})
    assert (qwen.sliding_window, qwen.num_sliding_layers) == (None, 0)
    # the KV pool still counts every layer
    assert gpt_oss.kv_bytes_per_token(1) == qwen.kv_bytes_per_token(1)
    shape = resolve_model("gpt-oss-120b")
    assert shape.total_weight_params() == pytest.approx(116.8e9, rel=1e-3)  # published 116.83B
    assert shape.active_params_per_token() == pytest.approx(5.13e9, rel=1e-3)  # published 5.13B


def test_tensor_parallel_terms_by_hand():
    m = model(tensor_parallel_size=2)
    t = terms(m, step(decode=4, context=40))
    # 2 all-reduces x 2 layers of 4 x 64 bf16 activations; ring: 2 (tp-1)/tp of the bytes
    assert t["tp_comm"] == pytest.approx(2 * 2 * 4 * 64 * 2 * 1.0 / 1e11)
    assert t["tp_latency"] == pytest.approx(2 * 2 * 5e-6)
    assert t["weights"] == pytest.approx(terms(model(), step(decode=4))["weights"] / 2)
    assert t["kv_read"] == pytest.approx(40 * 128 / 1e12)  # one KV head per rank


def test_draft_passes_default_shape_and_ngram():
    m = model(speculative=("eagle3", 3))
    draft = m.physics.draft_model
    assert (draft.num_layers, draft.hidden_size, draft.vocab_size) == (1, 64, 1000)
    assert draft.dense_weight_params() == ATTN + MLP + LM
    out = step(prefill=5, decode=2, verify=6, reqs=3, context=100, pairs=15)
    t = terms(m, out)
    w = (ATTN + MLP + LM) * 2 / 1e12
    tok = 2 * (ATTN + MLP) / 1e14
    logit = 2 * LM / 1e14
    expect = (3 * w + 3 * (tok + logit) * 3 + tok * 5 + 4 * 1 * 4 * 16 * 15 / 1e14
              + 3 * 100 * (2 * 2 * 16 * 2) / 1e12)
    assert t["draft"] == pytest.approx(expect)
    assert terms(model(speculative=("ngram", 3)), out)["draft"] == 0.0
    assert terms(model(), out)["draft"] == 0.0


def test_forward_is_features_times_coefficients_and_max_combines_groups():
    eff = {"weights": 1.3, "experts": 1.1, "compute": 2.0, "attention_prefill": 1.5,
           "kv_read": 1.2, "tp_comm": 1.7, "tp_latency": 0.5, "draft": 1.4}
    m = model(model=MOE, tensor_parallel_size=2, base=0.001, per_request=1e-5, mixed_step=2e-4,
              efficiency=eff, speculative=("eagle", 2))
    out = step(prefill=50, decode=7, verify=14, reqs=8, context=5000, pairs=1275)
    row = np.array(m.features(out))
    assert m.forward_time(out) == pytest.approx(float(row @ m.coef_), rel=1e-12)
    mx = model(model=MOE, tensor_parallel_size=2, base=0.001, per_request=1e-5, mixed_step=2e-4,
               efficiency=eff, speculative=("eagle", 2), combine="max")
    t = dict(zip(ROOFLINE_FEATURES, row))
    e = eff
    compute = e["compute"] * t["compute"] + e["attention_prefill"] * t["attention_prefill"]
    memory = e["weights"] * t["weights"] + e["experts"] * t["experts"] + e["kv_read"] * t["kv_read"]
    expect = (0.001 + 1e-5 * 8 + 2e-4 + max(compute, memory) + e["tp_comm"] * t["tp_comm"]
              + e["tp_latency"] * t["tp_latency"] + e["draft"] * t["draft"])
    assert mx.forward_time(out) == pytest.approx(expect, rel=1e-12)
    assert mx.forward_time(out) < m.forward_time(out)


def test_step_period_host_overhead_and_empty_step():
    m = make_step_model(config(host_overhead=0.5), async_scheduling=True)
    assert m.step_period(step(decode=1)) == 0.5
    assert m.step_period(step()) == 0.5
    sync = make_step_model(config(host_overhead=0.5))
    assert sync.step_period(step(decode=1)) == pytest.approx(0.5 + sync.forward_time(step(decode=1)))


@pytest.mark.parametrize("form", ["linear", "linear-flat", "sum", "max"])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [0, 3])
def test_decode_periods_equal_step_period_float_for_float(form, async_scheduling, k):
    if form.startswith("linear"):
        # linear-flat: no context term, so every step of a batch is priced once
        cfg = StepTimeConfig(base=0.004, per_decode_token=3e-5,
                             per_context_token=1e-8 if form == "linear" else 0.0,
                             host_overhead=0.006, draft_per_pass=1e-3, draft_per_request=1e-5)
    else:
        cfg = config(model=MOE, combine=form, tensor_parallel_size=2, host_overhead=2e-4,
                     efficiency={"compute": 3.0})
    m = make_step_model(cfg, async_scheduling=async_scheduling, speculative_method="eagle3",
                        num_speculative_tokens=k)
    for num_reqs, context in [(1, 0), (7, 1234), (64, 90_000)]:
        got = m.decode_periods(num_reqs, context, 20)
        want = [m.step_period(step(decode=num_reqs, context=context + num_reqs * j))
                for j in range(1, 21)]
        assert got == want
        assert got == sorted(got)
        # Verify steps (k drafts per request), at contexts that rise unevenly.
        contexts = [context + num_reqs * (k + 1) * j + j * j for j in range(20)]
        got = m.verify_periods(num_reqs, num_reqs * k, contexts)
        want = [m.step_period(step(decode=num_reqs, verify=num_reqs * k, context=c))
                for c in contexts]
        assert got == want


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 4000), extra=st.integers(0, 4000), context=st.integers(0, 10**6),
    more_context=st.integers(0, 10**6), prefill=st.booleans(), combine=st.sampled_from(["sum", "max"]),
    skew=st.sampled_from([0.0, 0.5, 0.9]), k=st.sampled_from([0, 3]),
)
def test_roofline_step_time_is_nondecreasing_in_tokens_and_context(
    n, extra, context, more_context, prefill, combine, skew, k
):
    m = model(model=MOE, combine=combine, routing_skew=skew, tensor_parallel_size=2,
              speculative=("eagle3", k) if k else None)

    def t(tokens, ctx):
        if prefill:
            return m.forward_time(step(prefill=tokens, context=ctx, pairs=tokens * (tokens + 1) // 2))
        return m.forward_time(step(decode=tokens, context=ctx))

    assert t(n, context) <= t(n + extra, context)
    assert t(n, context) <= t(n, context + more_context)


def test_fit_recovers_efficiencies():
    """At tp 1 (no communication columns), with verified drafts so that logit rows vary apart
    from requests, the token, expert, KV and attention terms are identified; base and weights
    are both constant per step, so only their sum is."""
    truth = model(model=MOE, base=0.002, per_request=3e-5,
                  efficiency={"weights": 1.4, "experts": 1.2, "compute": 2.5, "kv_read": 1.6,
                              "attention_prefill": 1.8})
    rng = np.random.default_rng(0)
    rows, ys = [], []
    for _ in range(300):
        d = int(rng.integers(1, 200))
        v = d * int(rng.integers(0, 4))
        p = int(rng.integers(0, 2000)) * int(rng.integers(0, 2))
        out = step(prefill=p, decode=d, verify=v, reqs=d + (p > 0),
                   context=int(rng.integers(d, 200_000)), pairs=p * (p + 1) // 2)
        rows.append(truth.features(out))
        ys.append(truth.forward_time(out))
    X, y = np.array(rows), np.array(ys)
    fitted = model(model=MOE).fit(X, y)
    for name in ("experts", "compute", "kv_read", "attention_prefill"):
        assert fitted.efficiency[name] == pytest.approx(truth.efficiency[name], rel=1e-3), name
    assert fitted.per_request == pytest.approx(3e-5, rel=1e-3)
    w = X[0, 3]
    assert fitted.base + fitted.efficiency["weights"] * w == pytest.approx(0.002 + 1.4 * w, rel=1e-6)
    assert np.allclose(fitted.predict(X), y, rtol=1e-6)
    # a strong prior holds efficiencies near 1
    pulled = model(model=MOE).fit(X, y, prior_weight=1e-3)
    assert abs(pulled.efficiency["compute"] - 1.0) < abs(fitted.efficiency["compute"] - 1.0)


# --------------------------------------------------------------------------- config, catalog


def test_linear_dump_is_unchanged_by_the_roofline_keys():
    assert set(StepTimeConfig().model_dump()) == {
        "base", "per_prefill_token", "per_decode_token", "per_context_token", "mixed_step",
        "host_overhead", "per_verify_token", "draft_per_pass", "draft_per_request"}
    assert set(ModelShape(num_layers=1, num_kv_heads=1, head_size=8, dtype_bytes=2).model_dump()) \
        == {"num_layers", "num_kv_heads", "head_size", "dtype_bytes", "draft_layers"}
    cfg = config(model=MOE, routing_skew=0.2)
    again = StepTimeConfig(**cfg.model_dump())
    assert again == cfg and again.physics == cfg.physics
    assert isinstance(make_step_model(StepTimeConfig()), StepTimeModel)


def test_every_catalog_entry_loads():
    for name in hardware_names():
        assert resolve_hardware(name).memory_bandwidth_gbps > 0
    for name in model_names():
        shape = resolve_model(name)
        assert shape.missing_compute_field() is None, name
        assert shape.total_weight_params() > 0


@pytest.mark.parametrize("hw, name", [("h200-sxm", "llama-3.1-8b"), ("h200-sxm", "qwen3-30b-a3b")])
def test_catalog_names_resolve_in_a_scenario_config(hw, name):
    if hw not in hardware_names() or name not in model_names():
        pytest.skip("catalog entry absent")
    m = make_step_model(StepTimeConfig(form="roofline", hardware=hw, model=name))
    single = m.forward_time(step(decode=1, context=1000))
    assert 1e-4 < single < 0.1  # a decode step of a few ms on an H200
    with pytest.raises(ScenarioError, match=r"step_time\.model: unknown model 'no-such'; known: "):
        resolve_model("no-such")
    with pytest.raises(ScenarioError, match=r"step_time\.hardware: unknown hardware 'no-such'; known: "):
        resolve_hardware("no-such")


@pytest.mark.parametrize("kw, message", [
    (dict(hardware={**HW, "memory_bandwidth_gbps": 0}),
     "step_time.hardware.memory_bandwidth_gbps: input should be greater than 0 (got 0)"),
    (dict(hardware={**HW, "peak_tflops": {"bf16": -1}}),
     "step_time.hardware.peak_tflops.bf16: must be > 0 or null (got -1.0)"),
    (dict(model={**MOE, "num_experts_per_tok": 300}),
     "step_time.model.num_experts_per_tok: top-300 routing exceeds the 256 routed experts"),
    (dict(hardware={**HW, "memory_gb": 1e-4}),
     "step_time.model: 0.0 GB of weights per rank (tensor_parallel_size 1) exceed the hardware's "
     "memory_gb (0.0001)"),
    (dict(compute_dtype="int8"), "step_time.compute_dtype: the hardware has no peak_tflops.int8 "
     "(has: bf16, fp8)"),
    (dict(weight_dtype="fp4"), "step_time.weight_dtype: unknown dtype 'fp4'"),
    (dict(weight_dtype="mxfp4"), "step_time.compute_dtype: the matmuls' dtype is required where the "
     "weights are stored as mxfp4 (dequantised); allowed: bf16"),
    (dict(kv_dtype="mxfp4"), "step_time.kv_dtype: mxfp4 is a weight format; allowed: bf16"),
    (dict(model={k: v for k, v in DENSE.items() if k != "vocab_size"}),
     "step_time.model: the roofline form needs vocab_size (not given)"),
    (dict(tensor_parallel_size=2, hardware={k: v for k, v in HW.items() if k != "interconnect"}),
     "step_time.hardware.interconnect: a link bandwidth_gbps is required"),
    (dict(tensor_parallel_size=3), "step_time.tensor_parallel_size: 3 and the model's 2 KV heads"),
])
def test_validation_errors_name_the_field(kw, message):
    with pytest.raises(ValueError) as info:
        config(**kw)
    assert message in str(info.value)


def test_skew_must_stay_below_one():
    with pytest.raises(ValueError, match="routing_skew"):
        config(routing_skew=1.0)
    assert math.isclose(config(model=MOE, routing_skew=0.5).physics.experts_q, 1 - 8 / 128)
