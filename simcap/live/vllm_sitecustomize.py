"""The ``sitecustomize`` that :class:`simcap.live.server.VllmServer` gives a vLLM CPU server.

This file is not imported by simcap: the server copies it into a folder on the server's
``PYTHONPATH`` as ``sitecustomize.py``, so it runs at the start of every process of the server
(API server, engine core, workers), in vLLM's own venv. What it does is chosen by environment
variables the server sets:

- ``SIMCAP_AMX_HOOK=1`` (eager mode): ask the kernel for AMX state first. Eager mode dies with
  an illegal instruction on AMX machines otherwise.
- ``SIMCAP_CPU_SYNTHETIC_ACCEPTANCE=1`` (a speculative config with
  ``rejection_sample_method: synthetic``): vLLM 0.32's CPU build routes the rejection sampler's
  two Triton kernels to C++ implementations that refuse synthetic mode ("Synthetic acceptance
  not supported with CPU sampling"). The patch gives those two kernels synthetic mode as
  ``vllm/v1/sample/rejection_sampler.py``'s Triton kernels define it, and leaves every other
  call to the C++ kernels: per request, draft position ``pos`` is accepted when its uniform
  draw is below ``synthetic_conditional_rates[pos]`` and the draft id is not a padding -1;
  the first rejected position takes the target's token (greedy: the target's argmax; random:
  the recovered token) and ends the request's drafts; all accepted: the bonus token follows.
  The drafter and the verify pass run as they always do; only which drafts are accepted is
  drawn.
"""

from __future__ import annotations

import os
import sys


def synthetic_accept(output, cu_num_draft, draft, fallback, bonus, uniform, rates, rows) -> None:
    """Fill ``output`` (rows of ``max_spec_len + 1`` token ids, as nested lists) for the
    request indices in ``rows``, as the Triton kernels do in synthetic mode. Plain lists:
    ``cu_num_draft`` cumulative drafts per request, ``draft``/``fallback``/``uniform`` per
    draft token, ``bonus`` per request, ``rates`` conditional acceptance per position."""
    for i in rows:
        start = cu_num_draft[i - 1] if i else 0
        n = cu_num_draft[i] - start
        rejected = False
        for pos in range(n):
            d = draft[start + pos]
            accepted = d >= 0 and uniform[start + pos] < rates[pos]
            output[i][pos] = d if accepted else fallback[start + pos]
            if not accepted:
                rejected = True
                break
        if not rejected:
            output[i][n] = bonus[i]


def _synthetic(output_token_ids, cu_num_draft_tokens, draft_token_ids, fallback, bonus_token_ids,
               uniform_probs, rates, rows) -> None:
    out = output_token_ids.tolist()
    synthetic_accept(out, cu_num_draft_tokens.tolist(), draft_token_ids.tolist(), fallback.tolist(),
                     bonus_token_ids.reshape(-1).tolist(), uniform_probs.tolist(), rates.tolist(), rows)
    import torch

    output_token_ids.copy_(torch.tensor(out, dtype=output_token_ids.dtype))


def _patch_cpu_kernels(cpu_tl) -> None:
    greedy_cpp = cpu_tl._rejection_greedy_sample_kernel_impl
    random_cpp = cpu_tl._rejection_random_sample_kernel_impl

    def greedy(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax, bonus_token_ids,
               is_greedy, max_spec_len, uniform_probs=None, synthetic_conditional_rates=None,
               SYNTHETIC_MODE=False):
        if not SYNTHETIC_MODE:
            return greedy_cpp(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax,
                              bonus_token_ids, is_greedy, max_spec_len)
        batch = output_token_ids.shape[0]
        flags = [True] * batch if is_greedy is None else is_greedy.tolist()
        _synthetic(output_token_ids, cu_num_draft_tokens, draft_token_ids, target_argmax, bonus_token_ids,
                   uniform_probs, synthetic_conditional_rates, [i for i in range(batch) if flags[i]])

    def random(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
               bonus_token_ids, recovered_token_ids, uniform_probs, is_greedy, max_spec_len, vocab_size,
               synthetic_conditional_rates=None, NO_DRAFT_PROBS=False, SYNTHETIC_MODE=False):
        if not SYNTHETIC_MODE:
            return random_cpp(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                              bonus_token_ids, recovered_token_ids, uniform_probs, is_greedy, max_spec_len,
                              vocab_size, NO_DRAFT_PROBS=NO_DRAFT_PROBS)
        flags = is_greedy.tolist()
        _synthetic(output_token_ids, cu_num_draft_tokens, draft_token_ids, recovered_token_ids, bonus_token_ids,
                   uniform_probs, synthetic_conditional_rates, [i for i, g in enumerate(flags) if not g])

    cpu_tl._rejection_greedy_sample_kernel_impl = greedy
    cpu_tl._rejection_random_sample_kernel_impl = random
    print(f"simcap synthetic acceptance hook: pid {os.getpid()} CPU rejection kernels take synthetic mode",
          file=sys.stderr)


def _after_import(name: str, then) -> None:
    """Call ``then(module)`` once module ``name`` has been executed (first import)."""
    import importlib.abc
    import importlib.util

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                then(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


def _amx() -> None:
    try:
        import torch

        ok = torch.cpu._init_amx()
    except Exception as exc:  # keep the server starting; the log says why
        ok = repr(exc)
    print(f"simcap amx hook: pid {os.getpid()} AMX permission requested: {ok}", file=sys.stderr)


if os.environ.get("SIMCAP_AMX_HOOK") == "1":
    _amx()
if os.environ.get("SIMCAP_CPU_SYNTHETIC_ACCEPTANCE") == "1":
    _after_import("vllm.utils.cpu_triton_utils", _patch_cpu_kernels)
