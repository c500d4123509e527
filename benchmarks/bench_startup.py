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
"""

from __future__ import annotations

import argparse
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

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_simulate import compile_bytecode, scenario_data  # noqa: E402  (defined once)

CASES = ("import", "help", "chat", "reference")
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
    args = parser.parse_args()
    cases = args.case or list(CASES)

    tmp = Path(tempfile.mkdtemp(prefix="simcap-startup-"))
    reference_yaml = tmp / "reference.yaml"
    reference_yaml.write_text(yaml.safe_dump(scenario_data("reference", None), sort_keys=False))
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
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
