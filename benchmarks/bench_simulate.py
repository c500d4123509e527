"""Simulator speed and memory (run by hand: ``python benchmarks/bench_simulate.py``).

Workloads (``--workload``, default all three):

- ``reference``: 10,000 requests of 1000 input / 200 output tokens, Poisson 5 req/s,
  max_num_seqs 256, max_num_batched_tokens 8192, block 16, 16,384 blocks.
- ``spec``: the same with EAGLE3 speculative decoding (k=3, mean acceptance length 2.4).
- ``long-prompt``: 2,000 requests of 16,000 input / 200 output tokens at 1 req/s with a
  2048-token budget, so every prompt is chunked over eight steps.

Each run happens in a fresh child process, so its peak resident memory is its own. Printed
per workload: wall seconds of the ``simulate`` call and of the whole child process (start,
imports, scenario, simulation), simulated seconds per wall second, engine steps per second,
peak RSS. ``--peer`` also times NVIDIA Dynamo's compiled mocker on the same
workload (when importable: ``pip install --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1``)
interleaved with simcap, and prints the ratio, and it adds the arm the speed target speaks
of: the whole ``simcap simulate FILE`` process as a user runs it (``python -m simcap`` on the
real interpreter, bytecode compiled, the scenario as a YAML file, the tables written to a
pipe), interleaved with the peer's whole process (a Python process that imports the mocker
and replays the same workload, nothing else). The target compares those two whole processes: simcap's at
most 0.7x the peer's. ``--reference`` does the same for simcap's
step-by-step reference path. ``--eagle3`` times the ``spec`` workload (EAGLE3) against the
``reference`` one (no speculation), interleaved, and prints their ratio. Machines are shared
and noisy: compare medians of runs measured side by side, never a lone figure. simcap's
bytecode (``__pycache__``) is compiled first, as a user's install has it (pip compiles an
installed package; an editable one writes it on first import unless PYTHONDONTWRITEBYTECODE
is set): without it every process compiles simcap again, some 0.1-0.15 s.
``--interpreted`` adds the fast path with the engine's modules run as source
(``SIMCAP_INTERPRETED=1``) beside the compiled ones, and prints their ratio.
``--num-requests 1000000`` is the million-request run: on the reference workload, 254 MiB peak
RSS (whole process, 44.3M engine steps, 18.3 s with the compiled engine; 2-core x86-64 machine,
Python 3.11.7, numpy 2.4).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

# This checkout's simcap (and so its compiled modules, where it was installed in place), in this
# process and in the child processes it times: not whichever tree an editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BASE = {
    "engine": {
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "block_size": 16,
        "num_gpu_blocks": 16384,
        "max_model_len": 4096,
    },
    "step_time": {"base": 0.004, "per_prefill_token": 1.0e-5, "per_decode_token": 5.0e-5},
    "workload": {
        "arrival": {"process": "poisson", "rate": 5.0},
        "num_requests": 10000,
        "input_len": 1000,
        "output_len": 200,
    },
    "seed": 0,
}

WORKLOADS = {
    "reference": {},
    "spec": {
        "speculative": {"method": "eagle3", "num_speculative_tokens": 3, "acceptance_length": 2.4},
        "step_time": {**BASE["step_time"], "draft_per_pass": 0.0005, "draft_per_request": 1.0e-5},
    },
    "long-prompt": {
        "engine": {**BASE["engine"], "max_num_batched_tokens": 2048, "max_model_len": 32768},
        "workload": {**BASE["workload"], "arrival": {"process": "poisson", "rate": 1.0},
                     "num_requests": 2000, "input_len": 16000},
    },
}


def scenario_data(name: str, num_requests: int | None) -> dict:
    data = {**BASE, **WORKLOADS[name], "name": f"bench-{name}"}
    if num_requests is not None:
        data["workload"] = {**data["workload"], "num_requests": num_requests}
    return data


def run_simcap(data: dict, fast: bool) -> dict:
    from simcap.config.scenario import parse_scenario
    from simcap.fleet.run import simulate

    scenario = parse_scenario(data)
    t0 = time.perf_counter()
    result = simulate(scenario, fast=fast)
    wall = time.perf_counter() - t0
    return {"wall": wall, "sim_s": result.summary.duration_s, "steps": len(result.steps),
            "completed": result.summary.completed}


def peer_call(data: dict) -> tuple[list, dict]:
    """Arguments of the peer's ``run_mocker_synthetic_trace_replay`` for the workload."""
    engine = data["engine"]
    config = {"engine": {"backend": "vllm", **{k: engine[k] for k in (
        "block_size", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks")}}}
    wl = data["workload"]
    return ([wl["input_len"], wl["output_len"], wl["num_requests"]],
            {"extra_engine_args": config, "request_rate": wl["arrival"]["rate"]})


def run_peer(data: dict) -> dict:
    from dynamo._core import run_mocker_synthetic_trace_replay

    args, kwargs = peer_call(data)
    t0 = time.perf_counter()
    run_mocker_synthetic_trace_replay(*args, **kwargs)
    return {"wall": time.perf_counter() - t0}


# The peer's whole process: the interpreter, the mocker's import and the replay, nothing else.
_PEER_PROCESS = ("import json, sys\nfrom dynamo._core import run_mocker_synthetic_trace_replay\n"
                 "args, kwargs = json.loads(sys.argv[1])\n"
                 "run_mocker_synthetic_trace_replay(*args, **kwargs)\n")


def measure_peer_process(name: str, num_requests: int | None) -> dict:
    """Wall seconds of the peer's whole process on the workload (:data:`_PEER_PROCESS`)."""
    cmd = [sys.executable, "-c", _PEER_PROCESS, json.dumps(peer_call(scenario_data(name, num_requests)))]
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return {"process": time.perf_counter() - t0}


def child(which: str, name: str, num_requests: int | None) -> None:
    data = scenario_data(name, num_requests)
    out = run_peer(data) if which == "peer" else run_simcap(data, fast=which != "reference")
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if which != "peer":
        from simcap.runtime import compiled

        out["engine"] = compiled.summary()
    print(json.dumps(out))


def measure(which: str, name: str, num_requests: int | None) -> dict:
    """One run in a fresh child process; ``interpreted``: simcap's fast path with its engine
    modules run as source (``SIMCAP_INTERPRETED=1``), beside the compiled ones."""
    cmd = [sys.executable, __file__, "--child", which, "--workload", name]
    if num_requests is not None:
        cmd += ["--num-requests", str(num_requests)]
    env = {k: v for k, v in os.environ.items() if k != "SIMCAP_INTERPRETED"}
    if which == "interpreted":
        env["SIMCAP_INTERPRETED"] = "1"
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    process = time.perf_counter() - t0
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "process": process}


def measure_cli(tree: Path, scenario_file: Path) -> dict:
    """Wall seconds of the whole ``simcap simulate FILE`` process, output to a pipe."""
    cmd = [sys.executable, "-m", "simcap", "simulate", str(scenario_file)]
    env = dict(os.environ, PYTHONPATH=str(tree))  # this tree's simcap, not an installed one
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr.decode()[-2000:]}")
    return {"process": process}


def write_scenario(name: str, num_requests: int | None, folder: Path) -> Path:
    """The workload as the YAML file a user would pass to ``simcap simulate``."""
    import yaml

    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(scenario_data(name, num_requests), sort_keys=False))
    return path


def compile_bytecode(tree: Path) -> None:
    """Write ``tree``'s simcap bytecode, as an installed package has it (module doc)."""
    compileall.compile_dir(str(tree / "simcap"), quiet=1)


def peer_available() -> bool:
    try:
        import dynamo._core  # noqa: F401
    except ImportError:
        return False
    return True


def _walls(runs: list[dict], key: str = "wall") -> str:
    return ", ".join(f"{r[key]:.3f}" for r in runs)


def compare_eagle3(repeats: int, num_requests: int | None) -> None:
    """The ``spec`` workload (EAGLE3, k=3, acceptance length 2.4) against ``reference``."""
    runs: dict[str, list[dict]] = {"reference": [], "spec": []}
    for _ in range(repeats):
        for name in runs:  # interleaved, so that machine noise hits both alike
            runs[name].append(measure("simcap", name, num_requests))
    wall = {name: statistics.median(r["wall"] for r in rs) for name, rs in runs.items()}
    print("\n== EAGLE3 against no speculation (simulate call, median of interleaved runs)")
    for name, label in [("reference", "no speculation"), ("spec", "EAGLE3")]:
        r = runs[name][0]
        print(f"{label:<16}{wall[name]:.3f} s   steps {r['steps']:,}   all: {_walls(runs[name])}")
    print(f"EAGLE3 / none    {wall['spec'] / wall['reference']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), action="append")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--peer", action="store_true", help="also time the compiled peer, interleaved")
    parser.add_argument("--reference", action="store_true",
                        help="also time simcap's step-by-step reference path, interleaved")
    parser.add_argument("--interpreted", action="store_true",
                        help="also time the fast path with the engine modules run as source "
                             "(SIMCAP_INTERPRETED=1), interleaved")
    parser.add_argument("--eagle3", action="store_true",
                        help="time the EAGLE3 workload against the one without speculation, "
                             "interleaved, and print the ratio")
    parser.add_argument("--child", choices=["simcap", "interpreted", "reference", "peer"],
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = args.workload or list(WORKLOADS)
    if args.child:
        child(args.child, names[0], args.num_requests)
        return

    import tempfile

    import simcap

    tree = Path(simcap.__file__).parents[1]
    compile_bytecode(tree)
    print(f"simcap {simcap.__version__}, Python {platform.python_version()}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    if args.eagle3:
        compare_eagle3(args.repeats, args.num_requests)
        return
    for name in names:
        arms = ["simcap"]
        if args.peer and name != "spec":
            if peer_available():
                arms.append("peer")
            else:
                print("compiled peer: not installed; skipped")
        if args.reference:
            arms.append("reference")
        if args.interpreted:
            arms.append("interpreted")
        if "peer" in arms:  # the whole simcap simulate process, against the peer's
            arms += ["cli", "peer-process"]
        runs: dict[str, list[dict]] = {arm: [] for arm in arms}
        with tempfile.TemporaryDirectory(prefix="simcap-bench-") as folder:
            scenario_file = write_scenario(name, args.num_requests, Path(folder))
            for _ in range(args.repeats):
                for arm in arms:  # interleaved, so that machine noise hits every arm alike
                    if arm == "cli":
                        runs[arm].append(measure_cli(tree, scenario_file))
                    elif arm == "peer-process":
                        runs[arm].append(measure_peer_process(name, args.num_requests))
                    else:
                        runs[arm].append(measure(arm, name, args.num_requests))
        sim = runs["simcap"]
        wall = statistics.median(r["wall"] for r in sim)
        sim_s, steps = sim[0]["sim_s"], sim[0]["steps"]
        num = scenario_data(name, args.num_requests)["workload"]["num_requests"]
        print(f"\n== {name}: {num:,} requests, {sim[0]['completed']:,} completed; {sim[0]['engine']}")
        print(f"wall s (median)   {wall:.3f}   all: {_walls(sim)}")
        process = statistics.median(r["process"] for r in sim)
        print(f"whole process s   {process:.3f}   all: {_walls(sim, 'process')}")
        print(f"simulated s       {sim_s:,.1f}   sim s / wall s {sim_s / wall:,.0f}")
        print(f"engine steps      {steps:,}   steps/s {steps / wall:,.0f}")
        print(f"peak RSS MiB      {max(r['peak_rss_mib'] for r in sim):,.0f}")
        if "peer" in runs:
            pw = statistics.median(r["wall"] for r in runs["peer"])
            peer_rss = max(r["peak_rss_mib"] for r in runs["peer"])
            print(f"compiled peer     {pw:.3f} s (median; all: {_walls(runs['peer'])}); "
                  f"peak RSS {peer_rss:,.0f} MiB")
            print(f"simcap / peer     {wall / pw:.2f}")
            pp = statistics.median(r["process"] for r in runs["peer"])
            print(f"whole process     peer {pp:.3f} s (median); simcap / peer {process / pp:.2f}")
            cli = statistics.median(r["process"] for r in runs["cli"])
            peer = statistics.median(r["process"] for r in runs["peer-process"])
            print(f"simcap simulate   {cli:.3f} s whole process (median; all: {_walls(runs['cli'], 'process')})")
            print(f"peer's process    {peer:.3f} s (median; all: {_walls(runs['peer-process'], 'process')})")
            print(f"simulate / peer   {cli / peer:.2f} (whole processes; target <= 0.7)")
        if "reference" in runs:
            ref = statistics.median(r["wall"] for r in runs["reference"])
            print(f"reference path    {ref:.3f} s (median); fast path is {ref / wall:.1f}x faster")
        if "interpreted" in runs:
            interp = statistics.median(r["wall"] for r in runs["interpreted"])
            print(f"interpreted       {interp:.3f} s (median; all: {_walls(runs['interpreted'])}; "
                  f"{runs['interpreted'][0]['engine']}); compiled / interpreted {wall / interp:.2f}")


if __name__ == "__main__":
    main()
