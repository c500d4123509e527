"""Speculative decoding: hand cases, budget truncation, acceptance statistics."""

from __future__ import annotations

import numpy as np
import pytest

from simcap.config.scenario import SpeculativeConfig
from simcap.engine.scheduler import Scheduler
from simcap.engine.speculative import AcceptanceModel, Proposer, rates_for_length
from simcap.fleet.run import simulate
from tests.conftest import make_engine, make_request, make_scenario, run_to_completion


def spec_scenario(rates, k=3, **step_time):
    return make_scenario(
        engine={"max_num_batched_tokens": 256},
        step_time={"base": 0.01, **step_time},
        speculative={"method": "eagle3", "num_speculative_tokens": k, "acceptance_rates": rates},
        workload={"input_len": 100, "output_len": 128, "num_requests": 1},
    )


def test_full_acceptance_emits_k_plus_one_tokens_per_step():
    # Prefill step emits 1 token; then 4 per step; 1 + 4*31 = 125, the 33rd step is trimmed to 3.
    result = simulate(spec_scenario([1.0, 1.0, 1.0]), records=True)
    rec = result.records[0]
    assert rec.chunk_tokens == [1] + [4] * 31 + [3]
    assert rec.finish_time == pytest.approx(0.33)
    assert result.summary.spec_decode["mean_acceptance_length"] == pytest.approx(4.0)


def test_zero_acceptance_emits_one_token_per_step_and_still_pays_for_drafting():
    result = simulate(spec_scenario([0.0, 0.0, 0.0], draft_per_pass=0.002), records=True)
    rec = result.records[0]
    assert rec.chunk_tokens == [1] * 128
    # Every step: 10 ms forward + 3 draft passes x 2 ms.
    assert rec.finish_time == pytest.approx(128 * 0.016)
    assert result.summary.spec_decode["mean_acceptance_length"] == pytest.approx(1.0)


def test_verify_and_draft_costs_are_separate_terms():
    plain = simulate(spec_scenario([0.0] * 3), records=True).records[0].finish_time
    verify = simulate(spec_scenario([0.0] * 3, per_verify_token=0.001), records=True).records[0].finish_time
    draft = simulate(spec_scenario([0.0] * 3, draft_per_request=0.001), records=True).records[0].finish_time
    # 127 decode steps verify 3 drafts each; every one of the 128 steps drafts 3 passes.
    assert verify - plain == pytest.approx(127 * 3 * 0.001)
    assert draft - plain == pytest.approx(128 * 3 * 0.001)


def test_budget_truncates_drafts_and_eagle_reserves_lookahead_slots():
    sched = Scheduler(make_engine(max_num_batched_tokens=6), num_lookahead_tokens=3)
    a, b = make_request(0, 4, 10), make_request(1, 2, 10)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert out.num_scheduled_tokens == [4, 2]
    sched.update_from_output(out)
    a.num_spec_tokens = b.num_spec_tokens = 3
    out = sched.schedule()
    assert out.num_scheduled_tokens == [4, 2] and out.num_scheduled_spec_tokens == [3, 1]
    assert b.num_spec_tokens == 1  # drafts that did not fit are dropped
    # a: 5 computed + 3 drafts... its blocks cover computed tokens plus 3 lookahead slots.
    assert sched.kv.num_blocks_held(a) * 16 >= a.num_computed_tokens + 3


def test_rates_for_length_matches_the_mean_and_is_geometric():
    rates = rates_for_length(2.26, 3)
    assert 1 + sum(rates) == pytest.approx(2.26)
    assert rates[1] / rates[0] == pytest.approx(rates[0]) and rates[2] / rates[1] == pytest.approx(rates[0])
    assert rates_for_length(1.0, 3) == (0.0, 0.0, 0.0)
    assert rates_for_length(4.0, 3) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("rates", [(0.749, 0.547, 0.402), (0.923, 0.839, 0.756)])
def test_sampled_acceptance_has_the_configured_per_position_rates(rates):
    model = AcceptanceModel(rates, np.random.default_rng(0))
    accepted = np.array(model.sample([3] * 40_000))
    for i, r in enumerate(rates):
        assert np.mean(accepted >= i + 1) == pytest.approx(r, abs=0.01)


def test_acceptance_draws_ahead_yet_samples_what_drawing_per_call_gives():
    rates = (0.8, 0.6, 0.45)
    model = AcceptanceModel(rates, np.random.default_rng(7))
    model.uniforms.block = 5  # refills inside and across calls
    rng = np.random.default_rng(7)
    for n in [1, 3, 0, 7, 2, 12, 4]:
        drafts = [(3, 1, 2, 0)[i % 4] for i in range(n)]
        expected = [sum(u < r for r in rates[:d]) for u, d in zip(rng.random(n).tolist(), drafts)]
        assert model.sample(drafts) == expected


def test_simulated_mean_acceptance_length_matches_the_configured_one():
    scenario = make_scenario(
        engine={"max_num_batched_tokens": 2048},
        speculative={"method": "eagle3", "num_speculative_tokens": 3, "acceptance_length": 2.26},
        workload={"arrival": {"process": "closed", "concurrency": 8}, "num_requests": 200,
                  "input_len": 64, "output_len": 256},
    )
    sd = simulate(scenario).summary.spec_decode
    # ~22,000 drafts, accepted count sd <= 1.2: standard error ~0.008.
    assert sd["mean_acceptance_length"] == pytest.approx(2.26, abs=0.03)


def test_ngram_drafts_only_where_a_match_is_found():
    scenario = make_scenario(
        speculative={"method": "ngram", "num_speculative_tokens": 3, "acceptance_length": 3.0,
                     "proposal_rate": 0.5},
        workload={"arrival": {"process": "closed", "concurrency": 4}, "num_requests": 40,
                  "input_len": 64, "output_len": 128},
    )
    result = simulate(scenario, records=True)
    sd = result.summary.spec_decode
    steps_with_tokens = sum(len(r.chunk_times) for r in result.records) - 40
    assert sd["num_drafts"] == pytest.approx(0.5 * steps_with_tokens, rel=0.1)


def ngram_scenario(rate, concentration=None, seed=0, concurrency=4, num_requests=400):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "acceptance_rates": [1.0, 1.0, 1.0],
            "proposal_rate": rate}
    if concentration is not None:
        spec["proposal_concentration"] = concentration
    return make_scenario(
        speculative=spec, seed=seed,
        workload={"arrival": {"process": "closed", "concurrency": concurrency},
                  "num_requests": num_requests, "input_len": 64, "output_len": 200},
    )


def test_ngram_match_probability_is_the_requests_own_beta_draw():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, acceptance_length=1.0,
                               proposal_rate=0.3, proposal_concentration=0.5)
    proposer = Proposer(config, np.random.default_rng(0), content_seed=11)
    # Nothing accepted: a request takes as many steps however often it matches, so the mean
    # over requests is the rate of request-steps.
    assert proposer.beta_mean == pytest.approx(0.3, abs=1e-6)
    p = np.array([proposer.content_match_probability(i) for i in range(20000)])
    # Beta(0.15, 0.35): mean 0.3, variance 0.3 * 0.7 / 1.5 = 0.14, mass at both ends.
    assert p.mean() == pytest.approx(0.3, abs=0.01)
    assert p.var() == pytest.approx(0.14, abs=0.01)
    from scipy.stats import beta

    for x in (0.01, 0.5, 0.99):  # the distribution, not only its moments
        assert (p < x).mean() == pytest.approx(beta.cdf(x, 0.15, 0.35), abs=0.01)
    assert (p < 0.01).mean() > 0.3 and (p > 0.9).mean() > 0.1  # mass at both ends
    # A request's probability is its content's: the same for another proposer of that seed
    # (another stream, another order of asking), another for another seed.
    again = Proposer(config, np.random.default_rng(5), content_seed=11)
    assert [again.content_match_probability(i) for i in (7, 3, 19999)] == [p[7], p[3], p[19999]]
    other = Proposer(config, np.random.default_rng(0), content_seed=12)
    assert other.content_match_probability(7) != p[7]
    # Without a concentration (or at rate 1) every request matches at the rate.
    fixed = SpeculativeConfig(method="ngram", num_speculative_tokens=3, acceptance_length=1.0,
                              proposal_rate=0.3)
    assert Proposer(fixed, np.random.default_rng(0)).content_match_probability(7) == 0.3
    always = SpeculativeConfig(method="ngram", num_speculative_tokens=3, acceptance_length=3.0,
                               proposal_concentration=0.5)
    assert Proposer(always, np.random.default_rng(0)).content_match_probability(7) == 1.0


def test_ngram_requests_that_repeat_draft_and_the_others_do_not():
    """With a small concentration a request drafts in almost every step or almost none; its
    TPOT follows (full acceptance: 4 tokens a step with drafts, 1 without), while the fixed
    rate gives every request the same mix. Both keep the rate of request-steps."""
    fixed = simulate(ngram_scenario(0.5), records=True)
    mixed = simulate(ngram_scenario(0.5, concentration=0.2), records=True)
    for result in (fixed, mixed):
        steps = sum(len(r.chunk_times) for r in result.records) - len(result.records)
        assert result.summary.spec_decode["num_drafts"] == pytest.approx(0.5 * steps, rel=0.15)

    def tokens_per_step(result):  # per request: output tokens per decode step
        return np.array([(r.num_output_tokens - 1) / (len(r.chunk_times) - 1) for r in result.records])

    f, m = tokens_per_step(fixed), tokens_per_step(mixed)
    # Fixed: every request near 1 + 3 * 0.5 = 2.5 tokens a step (proposals one step late).
    assert np.percentile(f, 5) > 2.0 and np.percentile(f, 95) < 3.0
    # Mixed (concentration 0.2): most requests near 1 or near 4 tokens a step; more of them
    # near 4 (requests drafting often take fewer steps, so the mean over requests is above
    # the rate of request-steps).
    assert (m < 1.3).mean() > 0.1 and (m > 3.5).mean() > 0.5
    assert ((m > 2.0) & (m < 3.0)).mean() < 0.2


def test_ngram_match_probabilities_follow_the_requests_not_the_load():
    """The same request (same seed and id) repeats its content at any concurrency."""
    low = simulate(ngram_scenario(0.4, concentration=0.3, concurrency=2, num_requests=60), records=True)
    high = simulate(ngram_scenario(0.4, concentration=0.3, concurrency=16, num_requests=60), records=True)

    def rate_by_request(result):
        return {r.request_id: (r.num_output_tokens - 1) / (len(r.chunk_times) - 1) for r in result.records}

    a, b = rate_by_request(low), rate_by_request(high)
    ids = sorted(a)
    corr = np.corrcoef([a[i] for i in ids], [b[i] for i in ids])[0, 1]
    assert corr > 0.8
    fixed_low = simulate(ngram_scenario(0.4, concurrency=2, num_requests=60), records=True)
    fixed_high = simulate(ngram_scenario(0.4, concurrency=16, num_requests=60), records=True)
    c, d = rate_by_request(fixed_low), rate_by_request(fixed_high)
    assert abs(np.corrcoef([c[i] for i in ids], [d[i] for i in ids])[0, 1]) < 0.5


def test_ngram_drafts_only_once_the_output_repeats():
    """Onset 5: the lookup finds nothing before a request has 5 output tokens. Full
    acceptance, rate 1: the prefill's token, then 4 one-token steps (outputs 2..5), then
    4 tokens a step."""
    scenario = ngram_scenario(1.0, num_requests=3)
    scenario = scenario.model_copy(update={"speculative": scenario.speculative.model_copy(
        update={"proposal_onset_tokens": 5})})
    result = simulate(scenario, records=True)
    for rec in result.records:
        assert rec.chunk_tokens[:6] == [1, 1, 1, 1, 1, 4]
        assert set(rec.chunk_tokens[5:-1]) == {4}
    sd = result.summary.spec_decode
    assert sd["num_drafts"] == 3 * (len(result.records[0].chunk_tokens) - 5)


def test_scenarios_without_onset_or_spread_dump_and_hash_as_before():
    plain = SpeculativeConfig(method="ngram", num_speculative_tokens=3, acceptance_length=2.0, proposal_rate=0.5)
    assert "proposal_onset_tokens" not in plain.model_dump() and "proposal_concentration" not in plain.model_dump()
    both = plain.model_copy(update={"proposal_onset_tokens": 5, "proposal_concentration": 0.5})
    assert both.model_dump()["proposal_onset_tokens"] == 5 and both.model_dump()["proposal_concentration"] == 0.5
    a = ngram_scenario(0.5)
    b = a.model_copy(update={"speculative": a.speculative.model_copy(update={"proposal_onset_tokens": 5})})
    assert a.digest() != b.digest()


def test_proposal_concentration_is_ngram_only():
    with pytest.raises(ValueError, match="proposal_concentration: only ngram"):
        SpeculativeConfig(method="eagle3", num_speculative_tokens=3, acceptance_length=2.0,
                          proposal_concentration=1.0)
    with pytest.raises(ValueError, match="proposal_concentration"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, acceptance_length=2.0,
                          proposal_concentration=0.0)


def test_speculation_keeps_scheduler_invariants_and_exact_output_lengths():
    engine = make_engine(num_gpu_blocks=30, block_size=8, max_num_batched_tokens=20, max_num_seqs=4,
                         max_model_len=120)
    config = SpeculativeConfig(method="eagle3", num_speculative_tokens=3, acceptance_length=2.4)
    sched = Scheduler(engine, num_lookahead_tokens=3)
    reqs = [make_request(i, 30 + 7 * i, 40 + i) for i in range(6)]
    acceptance = AcceptanceModel.from_config(config, np.random.default_rng(1))
    proposer = Proposer(config, np.random.default_rng(2))
    emitted, order, _ = run_to_completion(sched, reqs, acceptance=acceptance, proposer=proposer)
    assert sched.num_preemptions > 0
    for req in reqs:
        assert sum(emitted[req.request_id]) == req.max_tokens
    assert order == sorted(order)


def test_accepted_drafts_fill_blocks_that_are_cached_only_at_the_next_allocation():
    # vLLM caches blocks as far as the tokens known when it allocates: drafts accepted in a
    # request's last step fill a block, but a request that finishes there never caches it.
    sched = Scheduler(make_engine(block_size=4), num_speculative_tokens=3)
    a = make_request(0, 6, 4)
    sched.add_request(a)
    sched.update_from_output(sched.schedule())  # prompt (blocks 0, 1), first token
    a.num_spec_tokens = 3
    out = sched.schedule()  # 1 + 3 tokens at positions 6..9: block 2 for 8, 9
    assert out.num_scheduled_spec_tokens == [3]
    blocks = list(sched.kv.req_to_blocks[0])
    result = sched.update_from_output(out, [3])  # all accepted: 4 more tokens, max_tokens reached
    assert result.finished == [a] and a.num_computed_tokens == 10
    # Block 1 (tokens 4..7) is full, but was allocated when only 7 tokens were known: no
    # hash, so it goes to the head with block 2; block 0 (cached) to the tail.
    free = sched.kv.free_block_ids()
    assert free[:2] == [blocks[2], blocks[1]] and free[-1] == blocks[0]


def test_a_waiting_request_with_one_token_left_gets_padded_drafts_that_none_accepts():
    # vLLM 0.26 and 0.32 pad an admitted request with one token to compute (a prefix hit or
    # a resumption) to 1 + k tokens when no running request prefills in the step; 0.23 not.
    seg = ((3, 9),)
    sched = Scheduler(make_engine(block_size=4, enable_prefix_caching=True), num_speculative_tokens=3)
    a = make_request(0, 9, 1, seg)
    sched.add_request(a)
    sched.update_from_output(sched.schedule())  # a: prompt, one token, finished: blocks cached
    b = make_request(1, 9, 2, seg)
    sched.add_request(b)
    out = sched.schedule()  # b hits 8 tokens: 1 left, padded to 4 with 3 placeholder drafts
    assert out.num_scheduled_tokens == [4] and out.num_scheduled_spec_tokens == [3]
    assert out.spec_padded_reqs == [b] and out.num_decode_reqs == 1 and out.num_verify_tokens == 3
    accepted = out.reject_padding([3])
    assert accepted == [0]
    result = sched.update_from_output(out, accepted)
    assert result.num_new_tokens == [1] and b.num_computed_tokens == 9
    # Without speculation, before 0.26, or with a running request prefilling in the step: no
    # padding.
    for plain in (Scheduler(make_engine(block_size=4, enable_prefix_caching=True)),
                  Scheduler(make_engine(block_size=4, enable_prefix_caching=True, vllm_version="0.23"),
                            num_speculative_tokens=3)):
        for req in (make_request(2, 9, 1, seg), make_request(3, 9, 2, seg)):
            plain.add_request(req)
            out = plain.schedule()
            plain.update_from_output(out)
        assert out.num_scheduled_tokens == [1] and not out.spec_padded_reqs
    long = make_request(6, 300, 2)
    sched = Scheduler(make_engine(block_size=4, enable_prefix_caching=True, long_prefill_token_threshold=32),
                      num_speculative_tokens=3)
    sched.add_request(make_request(7, 9, 1, seg))
    sched.update_from_output(sched.schedule())
    sched.add_request(long)
    sched.add_request(make_request(8, 9, 2, seg))
    out = sched.schedule()  # long's first chunk; 8 is padded beside it (long does not run yet)
    assert out.num_scheduled_tokens == [32, 4] and out.spec_padded_reqs == [out.reqs[1]]
    sched.update_from_output(out, out.reject_padding([0, 3]))
    sched.add_request(make_request(9, 9, 2, seg))
    out = sched.schedule()  # long still prefills: the new request is not padded
    assert out.reqs[0] is long and out.num_scheduled_tokens[-1] == 1 and not out.spec_padded_reqs
