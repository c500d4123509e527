"""KV pool speed: the paged pool with prefix caching, old vs new, side by side.

Run by hand: ``python benchmarks/bench_kv.py``. Replays the KV operations the simulator makes
for the reference workload of ``bench_simulate.py`` (10,000 requests, 1000-token unique
prompts, 200 outputs, block 16, 16,384 blocks), with requests overlapping as in a busy
engine: at tick t request t is admitted (get_computed_blocks + allocate_slots for its whole
prompt) and every running request decodes one token; a request that reaches its output
length is freed. ``--decode step`` calls allocate_slots for every decode token (the
step-by-step path); ``--decode stretch`` makes the fast path's calls (append_block when a
block fills, commit_full_blocks). "old" is the pre-optimisation implementation kept in
``tests/kv_oracle.py``. Prints the median per-request microseconds of each (harness included:
a pool that does nothing costs about 4 us/request with --decode stretch, 35 with step) and
the ratio; ``--shared-prefix N`` gives every prompt one of ``--num-prefixes`` shared openings.
Machines are shared and noisy: trust medians of interleaved repeats, not lone figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from simcap.engine.kv_cache import KVCacheManager  # noqa: E402
from simcap.engine.request import Request, RequestStatus  # noqa: E402
from tests.kv_oracle import OracleKVCacheManager  # noqa: E402


def make_requests(args) -> list[Request]:
    reqs = []
    for i in range(args.num_requests):
        segments = None
        if args.shared_prefix:
            group = i % args.num_prefixes
            segments = ((group, args.shared_prefix), (-2 * i - 1, args.input_len - args.shared_prefix))
        reqs.append(Request(i, 0.0, args.input_len, args.output_len, segments))
    return reqs


def run_step(pool, reqs, output_len: int) -> None:
    """allocate_slots for every decode token, as the step-by-step scheduler does."""
    active: list[Request] = []
    allocate = pool.allocate_slots
    n = len(reqs)
    t = 0
    while t < n or active:
        if t < n:
            req = reqs[t]
            hits, num_hit = pool.get_computed_blocks(req)
            pool.record_prefix_cache_stats(req.num_tokens, num_hit)
            if not allocate(req, req.num_tokens - num_hit, num_hit, hits):
                raise RuntimeError("pool too small for the replay")
            req.num_computed_tokens = req.num_tokens
            req.num_output_tokens = 1
            active.append(req)
        still = []
        for req in active:
            if req.num_output_tokens >= output_len:
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                pool.free(req)
                continue
            allocate(req, 1)
            req.num_computed_tokens += 1
            req.num_output_tokens += 1
            still.append(req)
        active = still
        t += 1


def stretch_events(reqs, output_len: int, block_size: int) -> list[list[tuple[int, Request]]]:
    """events[t]: requests that need a new block (op 0) or finish (op 1) at tick t."""
    n = len(reqs)
    events: list[list[tuple[int, Request]]] = [[] for _ in range(n + output_len + 2)]
    for i, req in enumerate(reqs):
        p = req.num_prompt_tokens
        held = -(-p // block_size)
        for k in range(1, output_len):  # decode k computes token p + k - 1 -> p + k slots
            if p + k > held * block_size:
                events[i + k].append((0, req))
                held += 1
        events[i + output_len].append((1, req))
    return events


def run_stretch(pool, reqs, events) -> None:
    """The fast path's calls: append_block as a block is needed, commit_full_blocks as one fills."""
    n = len(reqs)
    for t, todo in enumerate(events):
        if t < n:
            req = reqs[t]
            hits, num_hit = pool.get_computed_blocks(req)
            pool.record_prefix_cache_stats(req.num_tokens, num_hit)
            if not pool.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits):
                raise RuntimeError("pool too small for the replay")
            req.num_computed_tokens = req.num_tokens
            req.num_output_tokens = 1
        for op, req in todo:
            k = t - req.request_id
            if op == 0:
                pool.append_block(req)
                req.num_computed_tokens = req.num_prompt_tokens + k
                req.num_output_tokens = k + 1
                pool.commit_full_blocks(req)
            else:
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                pool.free(req)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-requests", type=int, default=10000)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=16384)
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens of a shared prompt prefix")
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--decode", choices=["step", "stretch", "both"], default="both")
    args = parser.parse_args()
    modes = ["step", "stretch"] if args.decode == "both" else [args.decode]
    impls = {"old": OracleKVCacheManager, "new": KVCacheManager}
    print(f"{args.num_requests:,} requests, {args.input_len} in / {args.output_len} out, "
          f"block {args.block_size}, {args.num_blocks:,} blocks, shared prefix {args.shared_prefix}")
    for mode in modes:
        times: dict[str, list[float]] = {name: [] for name in impls}
        stats: dict[str, tuple] = {}
        for _ in range(args.repeats):
            for name, cls in impls.items():  # interleaved: old and new see the same noise
                pool = cls(args.num_blocks, args.block_size, max_model_len=1 << 20)
                reqs = make_requests(args)
                if mode == "stretch":
                    events = stretch_events(reqs, args.output_len, args.block_size)
                t0 = time.perf_counter()
                if mode == "step":
                    run_step(pool, reqs, args.output_len)
                else:
                    run_stretch(pool, reqs, events)
                times[name].append((time.perf_counter() - t0) / args.num_requests * 1e6)
                stats[name] = (pool.prefix_cache_queries, pool.prefix_cache_hits, pool.num_free_blocks)
        if stats["old"] != stats["new"]:
            raise AssertionError(f"old and new disagree: {stats}")
        old, new = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"decode={mode:8s} median: old {old:7.1f} us/request  new {new:7.1f} us/request  "
              f"old/new {old / new:4.2f}x   (min: old {min(times['old']):.1f}  new {min(times['new']):.1f}; "
              f"hits {stats['new'][1]:,} tokens)")


if __name__ == "__main__":
    main()
