"""Start-up and whole-process time of the ``simcap`` command (run by hand:
``python benchmarks/bench_startup.py [--before REV]``).

Cases, each a fresh process as a user runs it (``python -m simcap ...`` in the tree measured):

- ``import``: ``python -c "import simcap"``;
- ``help``: ``simcap --help``;
- ``chat``: ``simcap simulate examples/chat.yaml`` (1,000 requests);
- ``reference``: ``simcap simulate`` of ``bench_simulate.py``'s reference workload (10,000
  requests of 1000 input / 200 output tokens, Poisson 5 req/s), table output.

Arms, run interleaved (each round runs every arm of a case, in rotating order, so that machine
noise hits them alike): ``pass`` (``python -c pass``: the interpreter's own start), ``simcap``
(this tree) and, with ``--before REV``, that commit's files extracted into a temporary folder.
Printed per case and arm: median wall seconds, median CPU seconds (user + system of the child,
less noisy than wall on a shared machine), and the median total of ``-X importtime`` (the sum of
the top-level imports' cumulative times, including those made lazily while the command runs).
Then the reference case stage by stage (``--stages``: only that), each arm's median of fresh
processes: the interpreter's start, importing ``simcap.cli``, parsing the command line,
loading the scenario, importing the simulator, simulating, rendering the tables, and the
interpreter's exit (a tree that predates ``simcap.cli._load_scenario``, the earlier name of
``load_command_scenario``, counts parsing to simulating as one stage).

Measured with ``--before`` the commit preceding the lazy imports (9 rounds; shared 2-core x86-64
machine, Python 3.11.7, numpy 2.4, scipy 1.17, typer 0.29, rich help formatting; load average
5.9 from other jobs, so wall seconds run about twice the CPU seconds; compare ratios and CPU):

    case       arm      wall s   cpu s  imports ms   wall / pass wall / before
    import     pass      0.102   0.041          62
    import     simcap    0.116   0.048          66           1.1          0.06
    import     before    1.954   0.822        1693          19.2
    help       pass      0.086   0.041          76
    help       simcap    0.490   0.210         345           5.7          0.21
    help       before    2.349   1.112        2027          27.3
    chat       pass      0.092   0.037          65
    chat       simcap    1.279   0.557         737          13.9          0.51
    chat       before    2.506   1.075        1541          27.3
    reference  pass      0.092   0.041          67
    reference  simcap    2.633   1.062         793          28.6          0.69
    reference  before    3.844   1.588        1599          41.8

Help formatting: ``simcap --help`` takes 0.18-0.21 CPU s (0.16-0.22 s wall when the machine is
quiet), down from 1.1. Half of it is typer's rich help (``typer.rich_utils`` loads rich's
markdown, syntax and traceback modules): with ``TYPER_USE_RICH=0`` (click's plain help, which
cuts the command list's descriptions short) it takes 0.09 CPU s (11 interleaved rounds).
What is left of a simulation's start-up: ``simulate`` of one request takes 0.38 CPU s with
``--json`` and 0.40 with tables, against 0.04 for ``python -c pass``; by ``-X importtime``,
numpy about 0.11 s, typer and the pydantic it loads to convert parameters about 0.08 s, and
simcap's own modules about 0.14 s (mostly building the scenario's pydantic models). The
reference workload's whole process takes 0.67x the CPU time of the earlier commit.

Then, with ``--before d766f70`` (9 rounds, load average 3.7-5 from other jobs: compare CPU
seconds and the exit stage, not wall seconds): ``help`` 0.212 CPU s (before 0.243), ``chat``
0.546 (0.609), ``reference`` 1.134 (1.176); of the reference case's stages, the interpreter's
exit 30 ms (before 241: its shutdown ran full collections over every object numpy, pydantic,
typer and rich had made; the command now freezes them at exit). By instruction count
(cachegrind, one run each): ``simcap --help`` 716M (before 805M: typer no longer compiles
every parameter's string annotation, twice per run), ``python -c "import simcap.config.scenario"``
834M (1,189M: no numpy, validators built on first use), the reference case 5,940M (6,087M).
Whole ``simcap simulate`` of the reference workload, 11 interleaved rounds against the
compiled peer's whole process (``bench_simulate.py --peer``): 2.19 s wall, 1.20 CPU s (before
2.48, 1.36; peer 2.26, 1.12).

Then, against ``--before b5291c6`` (load average about 2 from other jobs: instruction counts
are the stable figure). The command collects garbage rarely while it starts and freezes what
start-up loaded once the scenario is loaded (``simcap.runtime.startup``): a ``simcap simulate`` of
the reference workload runs 11 collections taking 1.7 ms, before 103 taking 29.9 ms. The
step log and the stretch gaps take each stretch's floats into arrays as it comes
(``array.fromlist``) instead of converting lists of them later. By cachegrind, two runs
each: the whole ``simcap simulate`` process of the reference workload 4,861M and 4,859M
instructions with tables (before 4,957M and 4,968M), 4,744M and 4,757M with ``--json``
(4,825M, 4,819M); ``simulate()`` in a script, 4,682M (4,758M). Wall medians of 21
interleaved whole processes (tables to a pipe): 1.183 s (before 1.269 s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_simulate import compile_bytecode, write_scenario  # noqa: E402  (defined once)

CASES = ("import", "help", "chat", "reference")

# One ``simcap simulate FILE`` run (tables to a pipe) timed stage by stage in its own process:
# the command's own functions are wrapped to note when each stage ends (a tree without
# ``simcap.cli.load_command_scenario`` (or its earlier name ``_load_scenario``) counts parsing,
# loading and simulating as one stage). It prints
# the stages' seconds and the wall-clock times its work began and ended, from which the parent
# reads the interpreter's start (before the first line) and shutdown (after the last).
_STAGES_CHILD = r"""
import json, sys, time
start = time.time()
t0 = time.perf_counter()
ends = {}
import simcap.cli as cli
from simcap.metrics import report
ends["import simcap.cli (typer)"] = time.perf_counter()
load = getattr(cli, "load_command_scenario", None) or getattr(cli, "_load_scenario", None)
load_name = "load_command_scenario" if hasattr(cli, "load_command_scenario") else "_load_scenario"
console, render = report.wide_console, report.render_summary

def timed_load(*args, **kwargs):
    ends["parse the command line (pydantic)"] = time.perf_counter()
    scenario = load(*args, **kwargs)
    ends["load the scenario"] = time.perf_counter()
    import simcap.simulation.simulator  # what the command imports next
    ends["import simcap.simulation.simulator"] = time.perf_counter()
    return scenario

def timed_console(*args, **kwargs):
    ends["simulate"] = time.perf_counter()
    return console(*args, **kwargs)

def timed_render(*args, **kwargs):
    render(*args, **kwargs)
    ends["render the tables (rich)"] = time.perf_counter()

if load is not None:
    setattr(cli, load_name, timed_load)
report.wide_console, report.render_summary = timed_console, timed_render
try:
    cli.app(["simulate", sys.argv[1]], prog_name="simcap")
except SystemExit as exc:
    assert not exc.code, exc.code
sys.stdout.flush()
marks = sorted(ends.items(), key=lambda kv: kv[1])
stages = {name: end - prev for (name, end), prev in zip(marks, [t0] + [e for _, e in marks])}
print(json.dumps({"start": start, "stages": stages, "end": time.time()}), file=sys.stderr)
"""
STAGES = ("interpreter start", "import simcap.cli (typer)", "parse the command line (pydantic)",
          "load the scenario", "import simcap.simulation.simulator", "simulate", "render the tables (rich)",
          "interpreter exit")
_IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+(\d+) \| (\S.*)$")


def case_args(case: str, reference_yaml: Path) -> list[str]:
    """The interpreter arguments of a case (after ``python``)."""
    return {
        "import": ["-c", "import simcap"],
        "help": ["-m", "simcap", "--help"],
        "chat": ["-m", "simcap", "simulate", str(ROOT / "examples" / "chat.yaml")],
        "reference": ["-m", "simcap", "simulate", str(reference_yaml)],
    }[case]


def run_once(args: list[str], tree: Path | None, importtime: bool = False) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds and stderr of ``python ARGS`` run in ``tree`` (its ``simcap``)."""
    env = dict(os.environ, COLUMNS="120")
    cwd = tree or ROOT
    if tree is not None:
        env["PYTHONPATH"] = str(tree)  # ``-c`` imports from PYTHONPATH; ``-m`` from cwd first
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), *args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} (in {cwd}) exited {done.returncode}:\n{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stderr


def stages_once(tree: Path, scenario_file: Path) -> dict[str, float]:
    """Seconds of each stage of one ``simcap simulate FILE`` process (:data:`STAGES`)."""
    env = dict(os.environ, COLUMNS="120", PYTHONPATH=str(tree))
    spawned = time.time()
    done = subprocess.run([sys.executable, "-c", _STAGES_CHILD, str(scenario_file)], cwd=tree,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ended = time.time()
    if done.returncode != 0:
        raise SystemExit(f"stage timing (in {tree}) exited {done.returncode}:\n{done.stderr[-2000:]}")
    child = json.loads(done.stderr.strip().splitlines()[-1])
    return {"interpreter start": child["start"] - spawned, **child["stages"],
            "interpreter exit": ended - child["end"], "whole process": ended - spawned}


def print_stages(arms: dict[str, Path | None], scenario_file: Path, repeats: int) -> None:
    """Median seconds per stage of the reference case, per arm, interleaved."""
    trees = {arm: tree for arm, tree in arms.items() if tree is not None}
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in trees}
    for r in range(repeats):
        order = list(trees)[r % len(trees):] + list(trees)[:r % len(trees)]
        for arm in order:
            runs[arm].append(stages_once(trees[arm], scenario_file))
    print(f"\nstages of the reference case (simcap simulate, tables to a pipe), median ms of "
          f"{repeats} interleaved rounds")
    print(f"{'stage':<36}" + "".join(f"{arm:>10}" for arm in trees))
    for stage in (*STAGES, "whole process"):
        cells = [statistics.median(run[stage] for run in runs[arm]) * 1e3 if stage in runs[arm][0]
                 else None for arm in trees]
        print(f"{stage:<36}" + "".join("         -" if c is None else f"{c:>10.1f}" for c in cells))


def import_total_ms(stderr: str) -> float:
    """Sum of the cumulative times of the top-level imports in ``-X importtime`` output."""
    return sum(int(m.group(1)) for line in stderr.splitlines() if (m := _IMPORT_LINE.match(line))) / 1e3


def checkout(rev: str, into: Path) -> Path:
    """The files of commit ``rev`` under ``into`` (``git archive``: no worktree to clean up)."""
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, action="append", help="default: all")
    parser.add_argument("--repeats", type=int, default=9, help="rounds per case")
    parser.add_argument("--before", metavar="REV", help="also time this commit (extracted to a temporary folder)")
    parser.add_argument("--stages", action="store_true",
                        help="only the reference case's stages (imports, simulate, render, exit)")
    args = parser.parse_args()
    cases = args.case or list(CASES)

    tmp = Path(tempfile.mkdtemp(prefix="simcap-startup-"))
    reference_yaml = write_scenario("reference", None, tmp)
    arms: dict[str, Path | None] = {"pass": None, "simcap": ROOT}
    try:
        if args.before:
            arms["before"] = checkout(args.before, tmp / "before")
        for tree in arms.values():  # as an installed package has it (bench_simulate's doc)
            if tree is not None:
                compile_bytecode(tree)
        print(f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.2f}; {args.repeats} rounds per case"
              + (f"; before = {args.before}" if args.before else ""))
        if args.stages:
            print_stages(arms, reference_yaml, args.repeats)
            return
        print(f"\n{'case':<10} {'arm':<7} {'wall s':>7} {'cpu s':>7} {'imports ms':>11}   "
              f"{'wall / pass':>11} {'wall / before':>13}")
        for case in cases:
            runs: dict[str, dict[str, list[float]]] = {a: {"wall": [], "cpu": [], "imp": []} for a in arms}
            for r in range(args.repeats):
                order = list(arms)[r % len(arms):] + list(arms)[:r % len(arms)]
                for arm in order:
                    pass_arm = arms[arm] is None
                    cmd = ["-c", "pass"] if pass_arm else case_args(case, reference_yaml)
                    wall, cpu, _ = run_once(cmd, arms[arm])
                    runs[arm]["wall"].append(wall)
                    runs[arm]["cpu"].append(cpu)
                    # a run of its own: -X importtime slows the imports it reports
                    runs[arm]["imp"].append(import_total_ms(run_once(cmd, arms[arm], importtime=True)[2]))
            med = {a: {k: statistics.median(v) for k, v in m.items()} for a, m in runs.items()}
            for arm in arms:
                m = med[arm]
                imp = f"{m['imp']:.0f}"
                vs_pass = "" if arm == "pass" else f"{m['wall'] / med['pass']['wall']:.1f}"
                vs_before = f"{m['wall'] / med['before']['wall']:.2f}" if arm == "simcap" and "before" in med else ""
                print(f"{case:<10} {arm:<7} {m['wall']:>7.3f} {m['cpu']:>7.3f} {imp:>11}   "
                      f"{vs_pass:>11} {vs_before:>13}")
        if "reference" in cases:
            print_stages(arms, reference_yaml, args.repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
