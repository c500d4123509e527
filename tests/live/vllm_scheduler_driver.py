"""Drive vLLM's own V1 ``Scheduler`` through scenarios, without a model, and log every step.

Run by the vLLM venv's python (stdlib + vllm only: simcap cannot be imported there)::

    python vllm_scheduler_driver.py SCENARIOS.json LOG.json MODEL_DIR

``MODEL_DIR``: a model folder for ``ModelConfig`` (its config only: no weights are loaded).

The conformance test imports this module too (stdlib only at module level) for the scenario
generator, the token contents and the fabricated model output, so both sides read them from
one place.

A scenario is a dict (see :func:`random_scenario`): engine settings named as ``vllm serve``
names them, speculation (``method`` ngram or eagle3, ``k`` drafts, a proposal rate, seeded
acceptance), and requests as ``{"id", "arrival_step", "segments": [[key, length], ...],
"max_tokens"}``. A segment's tokens are a function of its key and offset (:func:`token_id`), so two prompts share a
prefix exactly where simcap's segment model says they do. Each step the "model" samples
one token for every request whose scheduled tokens reach its length (none for a non-final
prefill chunk), plus the accepted drafts (:func:`num_accepted`; drafts that are the
scheduler's padding placeholders, -1, are never accepted), and after the step proposes
``k`` drafts to each request that sampled and still runs when :func:`proposes` says so.

Each step's log row: the ordered batch ``[[id, tokens, drafts], ...]`` and its prefill and
decode token counts as simcap's step log classes them, the preempted and finished ids, the
prefix-cache hit of each admitted request (``hits``: tokens it skipped), the free KV blocks
once scheduled (``free_scheduled``),
the free KV blocks after the step (their number, and a digest of their eviction order), and
the running and waiting counts after scheduling.

A scenario with ``"async_scheduling": true`` gets vLLM's ``AsyncScheduler``, driven as the engine
core's batch queue drives it (two batches in flight: step ``n + 1`` is scheduled before
step ``n``'s output is applied); drafts are placeholders the scheduler sets itself.

An engine with ``"prefill_schedule_interval": N > 1`` is scheduled as vLLM's data-parallel
engine core schedules one rank (``DPEngineCoreProc._should_throttle_prefills``): a schedule
whose count since the engine was last idle is not a multiple of N passes
``throttle_prefills=True``.
"""

from __future__ import annotations

import json
import random
from array import array
import sys
import time
import zlib

TOKEN_STRIDE = 1 << 20  # offsets within a segment stay below this
PAD = -1  # vLLM's placeholder draft token


# ---------------------------------------------------------------------------- shared model


def token_id(key: int, offset: int) -> int:
    """The token at ``offset`` in a segment keyed ``key`` (distinct for distinct pairs)."""
    return (key + (1 << 24)) * TOKEN_STRIDE + offset


def output_key(request_id: int) -> int:
    """simcap's key of a request's output segment (``Request.output_key`` default)."""
    return -2 * request_id - 2


def num_accepted(seed: int, request_id: int, num_output_tokens: int, num_drafts: int) -> int:
    """Seeded accepted-draft count of a verification (0..num_drafts)."""
    if num_drafts <= 0:
        return 0
    return random.Random(f"accept:{seed}:{request_id}:{num_output_tokens}").randint(0, num_drafts)


def accepted_for(sc: dict, request_id: int, num_output_tokens: int, num_drafts: int) -> int:
    """The scenario's accepted-draft count: seeded, or every draft (``"accept": "all"``)."""
    if (sc.get("speculative") or {}).get("accept") == "all":
        return num_drafts
    return num_accepted(sc["seed"], request_id, num_output_tokens, num_drafts)


def proposes(seed: int, rate: float, request_id: int, num_output_tokens: int) -> bool:
    """Whether the drafter proposes after a step (ngram: only where the lookup matches)."""
    if rate >= 1.0:
        return True
    return random.Random(f"propose:{seed}:{request_id}:{num_output_tokens}").random() < rate


def free_order_digest(block_ids: list[int]) -> int:
    """CRC-32 of the free queue's block ids in eviction order (the LRU order, compared cheaply)."""
    return zlib.crc32(array("q", block_ids))


def random_scenario(seed: int, spec: bool = False) -> dict:
    """A random scenario over the scheduler's dimensions (fixed by ``seed``)."""
    r = random.Random(seed)
    block_size = r.choice([4, 8, 16, 32])
    max_num_seqs = r.choice([1, 2, 3, 4, 6, 8, 16])
    budget = r.choice([8, 16, 33, 64, 100, 128, 256, 512])
    budget = max(budget, max_num_seqs)
    max_model_len = r.choice([128, 256, 512, 1024])
    threshold = r.choice([0, 0, 0, 4, 16, 40, 100])
    watermark = r.choice([0.0, 0.0, 0.0, 0.01, 0.05, 0.1])
    caching = r.random() < 0.75
    k = r.choice([1, 2, 3, 4, 5]) if spec else 0
    if 0 < threshold < 1 + k:
        # vLLM 0.32 asserts when it pads a waiting request's drafts (1 + k tokens) and the
        # threshold then cuts them: a setting that server would not survive.
        threshold = 1 + k
    groups = [(g, r.randint(1, max_model_len // 2)) for g in range(r.randint(0, 3))]
    num_requests = r.randint(2, 16)
    stagger = r.choice([0, 0, 1, 3, 8])
    requests = []
    step = 0
    for i in range(num_requests):
        segments = []
        if groups and r.random() < 0.7:
            key, length = r.choice(groups)
            segments.append([key, r.randint(1, length) if r.random() < 0.3 else length])
        tail = r.randint(0 if segments else 1, max(1, max_model_len // 3))
        if tail:
            segments.append([-2 * i - 1, tail])
        prompt = sum(n for _, n in segments)
        if prompt >= max_model_len:  # vLLM refuses such a prompt before the scheduler
            segments[-1][1] -= prompt - max_model_len + 1
            segments = [s for s in segments if s[1] > 0]
            prompt = sum(n for _, n in segments)
        max_tokens = r.randint(1, 32)
        if r.random() < 0.1:  # some run into max_model_len
            max_tokens = max_model_len
        requests.append(dict(id=i, arrival_step=step, segments=segments, max_tokens=max_tokens))
        step += r.randint(0, stagger) if stagger else 0
    # Pool: from "barely fits the longest request" (and its drafts) to ample.
    need = [-(-(min(sum(n for _, n in q["segments"]) + q["max_tokens"], max_model_len) + k) // block_size)
            for q in requests]
    lo, hi = max(need), sum(need)
    blocks = lo + int((hi - lo) * r.choice([0.0, 0.0, 0.05, 0.2, 0.5, 1.0, 1.5])) + 1
    return dict(
        name=f"random-{seed}{'-spec' if spec else ''}", seed=seed,
        engine=dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, block_size=block_size,
                    num_gpu_blocks=blocks, max_model_len=max_model_len, enable_prefix_caching=caching,
                    long_prefill_token_threshold=threshold, watermark=watermark),
        speculative=_speculative(r, k) if spec else None,
        requests=requests,
    )


def _speculative(r: random.Random, k: int) -> dict:
    """ngram (drafts where the lookup matches) or EAGLE3 (drafts for all, lookahead slots)."""
    rate = r.choice([1.0, 0.7, 0.3])
    if r.random() < 0.3:
        return dict(method="eagle3", k=k, proposal_rate=1.0)
    return dict(method="ngram", k=k, proposal_rate=rate)


def num_lookahead_tokens(spec: dict | None) -> int:
    """KV slots reserved past the scheduled tokens: k for EAGLE, 0 for ngram (as vLLM's)."""
    return spec["k"] if spec and spec.get("method", "ngram") != "ngram" else 0


MAX_STEPS = 20000  # a scenario that runs longer is reported as stalled


# ---------------------------------------------------------------------------- vLLM side


def _make_scheduler(sc: dict, model_dir: str, async_scheduling: bool):
    import torch
    from vllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    e = sc["engine"]
    model_config = _model_config(model_dir, e["max_model_len"])
    scheduler_config = SchedulerConfig(
        max_num_seqs=e["max_num_seqs"], max_num_batched_tokens=e["max_num_batched_tokens"],
        max_model_len=e["max_model_len"], is_encoder_decoder=False,
        long_prefill_token_threshold=e["long_prefill_token_threshold"], enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
        **({"watermark": e["watermark"]} if e["watermark"] else {}),  # (0.24+)
    )
    cache_config = CacheConfig(block_size=e["block_size"], enable_prefix_caching=e["enable_prefix_caching"])
    spec = sc.get("speculative")
    speculative_config = None
    if spec and spec.get("method", "ngram") == "ngram":
        speculative_config = SpeculativeConfig(method="ngram", num_speculative_tokens=spec["k"],
                                               prompt_lookup_max=4, prompt_lookup_min=1)
    elif spec:  # EAGLE needs a draft model folder: the model's own config serves (no weights load)
        key = (spec["method"], spec["k"], model_dir, e["max_model_len"])
        if key not in _DRAFT_CONFIGS:  # (building one reads the draft's config: 0.3 s)
            from vllm.config import ParallelConfig

            _DRAFT_CONFIGS[key] = SpeculativeConfig(method=spec["method"], model=model_dir,
                                                    num_speculative_tokens=spec["k"],
                                                    target_model_config=model_config,
                                                    target_parallel_config=ParallelConfig())
        speculative_config = _DRAFT_CONFIGS[key]
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config, speculative_config=speculative_config)
    # CPU platform hooks may turn async scheduling off in the config: the scheduler class
    # and its config flag are set as asked.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    kv_cache_config = KVCacheConfig(
        num_blocks=e["num_gpu_blocks"], kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
            block_size=e["block_size"], num_kv_heads=1, head_size=1, dtype=torch.float32))],
    )
    cache_config.num_gpu_blocks = e["num_gpu_blocks"]
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
               structured_output_manager=StructuredOutputManager(vllm_config),
               block_size=e["block_size"], log_stats=True)


_MODEL_CONFIGS: dict = {}
_DRAFT_CONFIGS: dict = {}


def _model_config(model_dir: str, max_model_len: int):
    from vllm.config import ModelConfig

    key = (model_dir, max_model_len)
    if key not in _MODEL_CONFIGS:
        _MODEL_CONFIGS[key] = ModelConfig(model=model_dir, max_model_len=max_model_len, dtype="float32",
                                          seed=0, skip_tokenizer_init=True)
    return _MODEL_CONFIGS[key]


def run_scenario(sc: dict, model_dir: str) -> dict:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request

    init_none_hash(sha256)
    async_scheduling = bool(sc.get("async_scheduling"))
    sched = _make_scheduler(sc, model_dir, async_scheduling)
    e = sc["engine"]
    spec = sc.get("speculative") or {}
    k = spec.get("k", 0)
    seed = sc["seed"]
    hasher = get_request_block_hasher(e["block_size"], sha256)
    pending = sorted(sc["requests"], key=lambda q: (q["arrival_step"], q["id"]))
    pool = sched.kv_cache_manager.block_pool
    log: list[dict] = []
    queue: list[tuple] = []  # batches in flight (async): (step row, output, sampled ids)
    step = 0
    # Prefill cadence: the data-parallel engine core's step counter (schedules since the
    # engine was last idle) and its _should_throttle_prefills rule.
    interval = e.get("prefill_schedule_interval", 1)
    counter = 0

    def add_arrivals():
        while pending and pending[0]["arrival_step"] <= step:
            q = pending.pop(0)
            prompt = [token_id(key, o) for key, n in q["segments"] for o in range(n)]
            sched.add_request(Request(
                request_id=str(q["id"]), prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=q["max_tokens"], ignore_eos=True),
                pooling_params=None, arrival_time=float(q["arrival_step"]), block_hasher=hasher))

    def apply(row, out, samplers):
        """The fabricated model output of a scheduled step, applied."""
        req_ids, sampled = [], []
        for rid in out.num_scheduled_tokens:
            req = sched.requests.get(rid)
            req_ids.append(rid)
            if rid not in samplers or req is None:
                sampled.append([])
                continue
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            n_out = samplers[rid]
            # Synchronous: -1 drafts are the scheduler's padding. Async: every draft is a -1
            # placeholder the worker fills from its last draft for the request, so all are real
            # but those of the step that admits it (it has no draft yet: padding).
            padded = rid in row["hits"] if async_scheduling else PAD in drafts
            a = 0 if (not drafts or padded) else accepted_for(sc, int(rid), n_out, len(drafts))
            sampled.append([token_id(output_key(int(rid)), n_out + j) for j in range(a + 1)])
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        outputs = sched.update_from_output(out, mro)
        finished = sorted(int(o.request_id) for eco in outputs.values() for o in eco.outputs
                          if o.finish_reason is not None)
        row["finished"] = finished
        row["free"] = pool.get_num_free_blocks()
        free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        row["free_order"] = free_order_digest(free_ids)
        if k and not async_scheduling:
            ids, drafts = [], []
            for rid, toks in zip(req_ids, sampled):
                req = sched.requests.get(rid)
                if toks and req is not None and not req.is_finished() and proposes(
                        seed, spec["proposal_rate"], int(rid), len(req.output_token_ids)):
                    ids.append(rid)
                    drafts.append([token_id(output_key(int(rid)), 10**5 + j) for j in range(k)])
            if ids:
                sched.update_draft_token_ids(DraftTokenIds(ids, drafts))

    while pending or sched.has_unfinished_requests() or queue:
        add_arrivals()
        if not sched.has_unfinished_requests() and not queue:
            step = pending[0]["arrival_step"]
            counter = 0  # (a new wave)
            continue
        if len(log) >= MAX_STEPS:
            return dict(name=sc["name"], steps=log, stalled=True)
        out = None
        if sched.has_unfinished_requests():
            out = sched.schedule(throttle_prefills=interval > 1 and counter % interval != 0)
            counter += 1
        if out is not None and (out.total_num_scheduled_tokens or not async_scheduling):
            admitted = {q.req_id for q in out.scheduled_new_reqs} | out.scheduled_cached_reqs.resumed_req_ids
            batch, hits, samplers = [], {}, {}
            num_prefill = num_decode = 0
            for rid, n in out.num_scheduled_tokens.items():
                req = sched.requests[rid]
                d = len(out.scheduled_spec_decode_tokens.get(rid, []))
                batch.append([int(rid), n, d])
                if rid in admitted:
                    hits[rid] = req.num_computed_tokens - n
                if not req.is_prefill_chunk:
                    samplers[rid] = len(req.output_token_ids)
                # simcap's step-log classes: a decode computes its last token (+ drafts).
                # (Async: num_tokens lacks the placeholders of outputs not yet applied; the
                # step reaches the request's end when it is no prefill chunk.)
                if n - d == 1 and (not req.is_prefill_chunk if async_scheduling
                                   else req.num_computed_tokens - d == req.num_tokens):
                    num_decode += 1
                else:
                    num_prefill += n
            row = dict(step=step, batch=batch, preempted=sorted(int(r) for r in out.preempted_req_ids),
                       hits=hits, running=len(sched.running), waiting=sum(sched.get_request_counts()[1:]),
                       num_prefill_tokens=num_prefill, num_decode_tokens=num_decode,
                       free_scheduled=pool.get_num_free_blocks())
            log.append(row)
            queue.append((row, out, samplers))
            if async_scheduling and len(queue) < 2:
                step += 1
                continue
        elif out is not None and queue:
            # (async) nothing to run until the step in flight is applied: no step, the clock
            # stays (the engine core's next schedule comes as that step ends)
            apply(*queue.pop(0))
            continue
        if queue:
            apply(*queue.pop(0))
        step += 1
    return dict(name=sc["name"], steps=log, stalled=False)


def main(argv: list[str]) -> int:
    scenarios_path, log_path, model_dir = argv[1], argv[2], argv[3]
    t0 = time.perf_counter()
    import vllm  # noqa: F401  (timed apart: the import is most of a short run)

    t1 = time.perf_counter()
    with open(scenarios_path) as f:
        scenarios = json.load(f)
    logs = [run_scenario(sc, model_dir) for sc in scenarios]
    t2 = time.perf_counter()
    from importlib.metadata import version

    with open(log_path, "w") as f:
        json.dump(dict(vllm_version=version("vllm"), import_s=t1 - t0, run_s=t2 - t1, logs=logs), f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
