"""``simcap live`` input errors (no server needed)."""

from __future__ import annotations

import subprocess
import sys

import yaml

SCENARIO = {
    "engine": dict(block_size=32, num_gpu_blocks=1000, max_model_len=2048),
    "workload": dict(arrival={"process": "closed", "concurrency": 1}, num_requests=2, input_len=16, output_len=4),
}


def _run(*args):
    return subprocess.run([sys.executable, "-m", "simcap", "live", *args], capture_output=True, text=True, timeout=60)


def test_unreachable_server_is_one_line_naming_the_url(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    url = "http://127.0.0.1:9"  # discard port: nothing listens
    for cmd in (["run"], ["validate", "--repeats", "1"]):
        proc = _run(*cmd, "--base-url", url, "--model", "tiny", str(path), "--no-progress" if cmd == ["run"] else "--no-warmup")
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and url in lines[0], proc.stderr


def test_bad_scenario_and_endpoint(tmp_path):
    proc = _run("run", "--base-url", "http://127.0.0.1:9", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    proc = _run("run", "--base-url", "http://127.0.0.1:9", "--endpoint", "grpc", str(path))
    assert proc.returncode == 2 and "--endpoint" in proc.stderr
    proc = _run("run", "--base-url", "http://127.0.0.1:9", str(path), "--set", "workload.num_requests=-1")
    assert proc.returncode == 2 and "workload.num_requests" in proc.stderr


def test_api_key_env_unset_plot_suffix_and_calibrate_unreachable(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from simcap.cli.live import live_app

    def run(*args):
        result = CliRunner().invoke(live_app, list(args))
        return result.exit_code, result.stderr.strip().splitlines()

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    monkeypatch.delenv("SIMCAP_NO_SUCH_KEY", raising=False)
    code, err = run("run", "--base-url", "http://127.0.0.1:9", "--api-key-env", "SIMCAP_NO_SUCH_KEY", str(path))
    assert code == 2 and err == ["error: --api-key-env: environment variable SIMCAP_NO_SUCH_KEY is not set"]
    code, err = run("validate", "--base-url", "http://127.0.0.1:9", "--plot", str(tmp_path / "f.txt"), str(path))
    assert code == 2 and len(err) == 1 and "--plot" in err[0]
    url = "http://127.0.0.1:9"
    common = ("calibrate", "--base-url", url, "--out", str(tmp_path / "p.yaml"), "--max-num-seqs", "8",
              "--max-num-batched-tokens", "512")
    code, err = run(*common)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and url in err[0]
    code, err = run(*common, "--log", str(tmp_path / "missing.log"))
    assert code == 2 and len(err) == 1 and "missing.log" in err[0]
    assert not (tmp_path / "p.yaml").exists()


def test_validate_replay_choice_is_checked_before_anything_is_sent(tmp_path):
    from typer.testing import CliRunner

    from simcap.cli.live import live_app

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    open_loop = tmp_path / "open.yaml"
    open_loop.write_text(yaml.safe_dump({**SCENARIO, "workload": {**SCENARIO["workload"],
                                                                  "arrival": {"process": "poisson", "rate": 1.0}}}))
    url = "http://127.0.0.1:9"  # nothing listens: these fail before any request
    for scenario, replay, expected in (
        (path, "fixed", "error: --replay: must be one of closed, times, sessions (got 'fixed')"),
        (open_loop, "closed", "error: replay: closed needs a closed-loop workload (workload.arrival.process: closed)"),
    ):
        result = CliRunner().invoke(live_app, ["validate", "--base-url", url, "--replay", replay, str(scenario)])
        assert result.exit_code == 2 and result.stderr.strip().splitlines() == [expected]
