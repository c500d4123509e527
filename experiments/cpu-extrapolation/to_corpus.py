#!/usr/bin/env python
"""Write this experiment's recorded levels as accuracy-corpus cases (``calibration/corpus/``).

    PYTHONPATH=. python experiments/cpu-extrapolation/to_corpus.py

One live case per model and protocol (``CASES``): each run of a case is one server instance;
the fit part is the case's first run's levels 1, 2 and 4 (the calibration workload of this
experiment), the held-out points levels 8, 16 and 32 of every run of the case.
``cpu-dense-closed-levels`` and ``cpu-moe-closed-levels`` hold runs 1 and 2 (AMD EPYC, one
round); ``cpu-moe-closed-rounds`` holds runs 5-8 (Intel Xeon, three interleaved rounds of the
levels, each round its own recorded run). Runs 3 and 4 (Xeon, one round) are in no case: the
rounds replaced their protocol. Each level (round) becomes one recorded run
(:func:`simcap.live.recording.save_run`) with its iteration-log lines and the host-load facts
of ``run.json``. These records predate ``client_id``: each request's client is rebuilt from
the closed loop's own rule (a client sends its next request when its previous one ends: a
request goes to the client whose last request ended latest at or before its send). The
prompts were random token ids, one private segment per request. The levels left no
``/metrics`` snapshots; the KV pool is the one 1 GiB gives (as ``extrapolate.py``).
"""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import analyse as A  # noqa: E402
import extrapolate as X  # noqa: E402

from simcap.accuracy.corpus import FORMAT, write_case  # noqa: E402
from simcap.live.client import LiveRun  # noqa: E402
from simcap.live.recording import save_run  # noqa: E402
from simcap.workloads.requests import RequestSpec  # noqa: E402

CORPUS = ROOT / "calibration" / "corpus"
FIT_LEVELS = (1, 2, 4)
HELD_LEVELS = (8, 16, 32)


def with_clients(records, level: int):
    """Each record with the closed-loop client that sent it (see the module doc)."""
    last: list[float] = []  # per client: when its latest request ended
    for r in sorted(records, key=lambda r: (r.arrival_time, r.request_id)):
        if len(last) < level:
            r.client_id = len(last)
            last.append(r.finish_time or r.arrival_time)
            continue
        ended = [c for c, t in enumerate(last) if t <= r.arrival_time + 1e-6]
        c = max(ended, key=lambda c: last[c]) if ended else min(range(level), key=lambda c: last[c])
        r.client_id = c
        last[c] = r.finish_time or r.arrival_time
    return records


def level_runs(model: str, run: int, level: int) -> list[tuple[LiveRun, list[str], dict]]:
    """The level's recorded runs, one per round: the client's records, the server's step-log
    lines and the round's host-load facts."""
    facts = json.loads((A.DATA / model / f"run{run}" / "run.json").read_text())["levels"][str(level)]
    logs = A.round_files(model, run, level, "iterations.log.gz")
    out = []
    for i, (records, log) in enumerate(zip(A.records_by_round(model, run, level), logs)):
        stats = facts["rounds"][i] if "rounds" in facts else facts
        records = with_clients(records, level)
        specs = {r.request_id: RequestSpec(r.request_id, r.num_prompt_tokens, r.max_tokens,
                                           ((-2 * r.request_id - 1, r.num_prompt_tokens),)) for r in records}
        with gzip.open(log, "rt") as fh:
            lines = [line.rstrip("\n") for line in fh if "Iteration(" in line]
        sends = sorted(r.arrival_time for r in records)
        live = LiveRun(records=records, specs=specs, base_url="http://127.0.0.1:8000", model="tiny",
                       endpoint="completions", closed_loop=True, requested_rate=None, scheduled_rate=None,
                       achieved_rate=(len(sends) - 1) / (sends[-1] - sends[0]) if sends[-1] > sends[0] else None,
                       wall_duration_s=stats["wall_s"], max_send_lag_s=None)
        cpu = {k: stats[k] for k in ("foreign_cores", "steal_cores", "top_foreign", "disturbed") if k in stats}
        out.append((live, lines, cpu))
    return out


def scenario(model: str, level: int, num_requests: int) -> dict:
    return {"name": f"{model} closed loop of {level}", "seed": level,
            "engine": {**X.ENGINE, "num_gpu_blocks": X.BLOCKS[model]},
            "workload": {"arrival": {"process": "closed", "concurrency": level}, "num_requests": num_requests,
                         "input_len": {"dist": "uniform", "low": 64, "high": 128},
                         "output_len": {"dist": "uniform", "low": 64, "high": 128}}}


# name -> (model, runs); the first run is also the fit part's
CASES = {
    "cpu-dense-closed-levels": ("dense", (1, 2)),
    "cpu-moe-closed-levels": ("moe", (1, 2)),
    "cpu-moe-closed-rounds": ("moe", (5, 6, 7, 8)),
}
NUMBER = {2: "two", 3: "three", 4: "four"}


def description(model: str, machine: str, runs: tuple[int, ...], rounds: int) -> str:
    where = " (Intel Xeon)" if "Xeon" in machine else ""
    how = f", {NUMBER[rounds]} interleaved rounds of the levels a run" if rounds > 1 else ""
    each = f" ({NUMBER[rounds]} rounds each)" if rounds > 1 else ""
    return (f"The tiny {model} model on vLLM's CPU build{where}, closed loops of 1-32 clients (prompts and "
            f"outputs uniform on 64-128 tokens{how}): fitted on one server instance's loops of 1, 2 and 4 "
            f"clients{each}, predicting 8, 16 and 32 on {NUMBER[len(runs)]} instances.")


def main() -> None:
    for name, (model, runs) in CASES.items():
        folder = CORPUS / name
        shutil.rmtree(folder, ignore_errors=True)
        facts = json.loads((A.DATA / model / f"run{runs[0]}" / "run.json").read_text())
        machines = {X.machine_of(model, run) for run in runs}
        if len(machines) != 1:
            raise SystemExit(f"{name}: runs {runs} come from {sorted(machines)}: one machine per case")
        fit_runs, points = [], {lv: [] for lv in HELD_LEVELS}
        counts = {}
        for instance, run in enumerate(runs):
            for level in (*FIT_LEVELS, *HELD_LEVELS):
                if instance and level in FIT_LEVELS:
                    continue
                kind = "fit" if level in FIT_LEVELS else f"c{level}"
                for i, (live, lines, cpu) in enumerate(level_runs(model, run, level)):
                    counts[level] = len(live.records)
                    stem = f"i{instance}c{level}" + (f"r{i + 1}" if i else "")
                    path = save_run(folder / kind / stem, live, iterations=[lines], cpu=cpu)
                    rel = path.relative_to(folder).as_posix()
                    if level in FIT_LEVELS:
                        fit_runs.append(rel)
                    else:
                        points[level].append({"file": rel, "instance": instance})
        machine, rounds = machines.pop(), X.rounds_of(model, runs[0])
        write_case(folder, {
            "format": FORMAT, "kind": "live", "name": name,
            "description": description(model, machine, runs, rounds),
            "mechanisms": ["closed loop", "batch growth past the fit range", "chunked prefill",
                           *(["MoE experts"] if model == "moe" else [])],
            "source": {"converted_from": f"experiments/cpu-extrapolation/data/{model}/run<k> (collect.py)",
                       "client_ids": "rebuilt from the closed loop (to_corpus.py)",
                       "machine": facts["cpu"], "server": {"args": facts["server_args"],
                                                           "kv_cache_gib": facts["kv_cache_gib"],
                                                           "version": "0.32.0+cpu"},
                       **({"runs": list(runs), "rounds": rounds} if rounds > 1 else {})},
            "fit": {"runs": fit_runs, "engine": {**X.ENGINE, "num_gpu_blocks": X.BLOCKS[model]},
                    "speculative_method": None,
                    "roofline": {"hardware": X.HARDWARE[machine], "model": X.SHAPES[model],
                                 "combine": "max"}},
            "points": [{"name": f"c{lv}", "scenario": scenario(model, lv, counts[lv]), "replay": "closed",
                        "runs": points[lv]} for lv in HELD_LEVELS],
        })
        print(folder, sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) // 1024, "KiB")


if __name__ == "__main__":
    main()
