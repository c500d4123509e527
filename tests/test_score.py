"""A published table's way to a prediction, by the command line alone: a CSV table whose columns
are declared (``--column``), rows picked (``--where``), per-GPU throughput, the figures to fit
(``--fit-metrics``), and ``simcap score`` of the fitted profile on the rows it did not see.

The table is made by simulating a known deployment (so the truth is known): a linear step time
on 2 GPUs, closed loops at 1-16 clients, written as a vendor would (per-GPU output throughput,
median TPOT, ISL/OSL columns, its own header names).
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from simcap.calibrate.core import CalibrationError
from simcap.calibrate.readers import TableReading, read_benchmarks
from simcap.config.scenario import parse_scenario
from simcap.fleet.run import simulate

ROOT = Path(__file__).resolve().parents[1]
ENGINE = {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "block_size": 16, "num_gpu_blocks": 8192,
          "max_model_len": 4096}
GPUS = 2
TRUTH = {"base": 0.012, "per_prefill_token": 2.0e-5, "per_decode_token": 4.0e-4}
HEADER = ["Concurrency", "ISL", "OSL", "Output tok/s/GPU", "TPOT (ms)", "Notes"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simcap", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    """The vendor's table: what the true deployment does at 1, 2, 4, 8 and 16 clients."""
    folder = tmp_path_factory.mktemp("table")
    path = folder / "vendor.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(HEADER)
        for c in (1, 2, 4, 8, 16):
            result = simulate(parse_scenario({
                "engine": ENGINE, "step_time": TRUTH, "seed": 0,
                "workload": {"arrival": {"process": "closed", "concurrency": c}, "num_requests": 8 * c,
                             "input_len": 512, "output_len": 128},
            }))
            s = result.summary
            steady = c * s.output_tokens / s.completed / s.e2e_s.mean  # closed loop, Little's law
            writer.writerow([c, 512, 128, f"{steady / GPUS:.3f}", f"{s.tpot_s.p50 * 1e3:.4f}", "bf16"])
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """What the planner knows: the deployment, and a step time to start from (not the truth)."""
    path = tmp_path_factory.mktemp("base") / "base.yaml"
    path.write_text(yaml.safe_dump({"name": "vendor-base", "engine": ENGINE,
                                    "step_time": {"base": 0.005, "per_prefill_token": 1e-5, "per_decode_token": 1e-4}}))
    return path


COLUMNS = ["--column", "Concurrency=concurrency", "--column", "ISL=input_len", "--column", "OSL=output_len",
           "--column", "Output tok/s/GPU=output_throughput_per_gpu", "--column", "TPOT (ms)=median_tpot_ms",
           "--gpus", str(GPUS)]
DECLARED = COLUMNS[1:-2:2]


def test_declared_columns_per_gpu_throughput_and_a_row_filter(table):
    reading = TableReading.parse(DECLARED, ["concurrency<=4"], GPUS)
    points = read_benchmarks(table, engine=ENGINE, speculative=None, table=reading)
    assert [p.label for p in points] == ["c=1", "c=2", "c=4"]
    rows = list(csv.DictReader(table.open()))
    # Per GPU x the deployment's 2 GPUs; the median TPOT's milliseconds in seconds.
    assert points[0].measured["output_throughput"] == pytest.approx(2 * float(rows[0]["Output tok/s/GPU"]))
    assert points[2].measured["tpot_p50"] == pytest.approx(float(rows[2]["TPOT (ms)"]) * 1e-3)
    assert points[0].scenario["workload"]["arrival"] == {"process": "closed", "concurrency": 1}
    assert points[0].source["ignored_keys"] == ["Notes"] and points[0].source["where"] == ["concurrency<=4"]
    gpus = read_benchmarks(table, engine=ENGINE, speculative=None, table=TableReading.parse(DECLARED, gpus=8))
    assert gpus[0].measured["output_throughput"] == pytest.approx(4 * points[0].measured["output_throughput"])
    with pytest.raises(CalibrationError, match="a per-GPU figure needs the GPUs of the deployment: give --gpus N"):
        read_benchmarks(table, engine=ENGINE, speculative=None, table=TableReading.parse(DECLARED))


def test_rate_rows_are_poisson_arrivals(tmp_path):
    path = tmp_path / "rates.json"
    path.write_text(json.dumps([{"request_rate": 2.5, "input_len": 100, "output_len": 20, "mean_ttft_ms": 80},
                                {"rate": 5, "input_len": 100, "output_len": 20, "mean_ttft_ms": 95}]))
    points = read_benchmarks(path, engine=ENGINE, speculative=None)
    assert [p.label for p in points] == ["rate=2.5", "rate=5"]
    assert points[1].scenario["workload"]["arrival"] == {"process": "poisson", "rate": 5.0}
    assert points[0].scenario["workload"]["num_requests"] == 150 and not points[0].steady_state


def test_a_closed_loop_runs_the_requests_each_client_sent(table):
    reading = TableReading.parse(DECLARED, ["concurrency<=4"], GPUS)
    guessed = read_benchmarks(table, engine=ENGINE, speculative=None, table=reading)
    counted = read_benchmarks(table, engine=ENGINE, speculative=None, table=reading,
                              workload={"requests_per_client": 10})
    # Without a count: whole rounds of 20-120 requests, throughput read in the steady state.
    assert [p.scenario["workload"]["num_requests"] for p in guessed] == [60, 60, 60]
    assert all(p.steady_state for p in guessed)
    # With one: the benchmark's own run, 10 x C requests, throughput over the run as measured.
    assert [p.scenario["workload"]["num_requests"] for p in counted] == [10, 20, 40]
    assert not any(p.steady_state for p in counted)
    assert "requests_per_client" not in counted[0].scenario["workload"]


@pytest.mark.parametrize("value", [0, True, 2.5, "10", 1001])
def test_requests_per_client_is_refused_in_one_line(table, value):
    with pytest.raises(CalibrationError, match=r"requests_per_client: requests each client sent, a whole "
                                               r"number in \[1, 1,000\]"):
        read_benchmarks(table, engine=ENGINE, speculative=None, workload={"requests_per_client": value},
                        table=TableReading.parse(DECLARED, gpus=GPUS))


@pytest.mark.parametrize("columns, where, says", [
    (["TPOT=tpot_ms"], [], "--column 'TPOT=tpot_ms': 'tpot_ms' is no metric or shape key"),
    (["no key"], [], "--column 'no key': expected NAME=KEY"),
    ([], ["concurrency ~ 4"], "--where 'concurrency ~ 4': expected NAME OP VALUE"),
])
def test_table_options_are_refused_in_one_line(columns, where, says):
    with pytest.raises(CalibrationError, match=re.escape(says)):
        TableReading.parse(columns, where)


def test_fit_low_rows_score_high_rows_by_the_command_line(table, base, tmp_path):
    """calibrate on the rows at 1-4 clients, fitting throughput and TPOT; score then names
    those rows fitted and the rows at 8 and 16 held out, and predicts them near the truth."""
    profile = tmp_path / "fitted.yaml"
    fit = run("calibrate", table, "--base", base, "--out", profile, *COLUMNS, "--where", "concurrency<=4",
              "--fit-metrics", "output_throughput,tpot_p50", "--bootstrap", "0", "--json")
    assert fit.returncode == 0, fit.stderr
    out = run("score", profile, table, *COLUMNS, "--json", "--plot", tmp_path / "score.png")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    parts = {r["point"]: r["fitted"] for r in data["rows"]}
    assert parts == {"c=1": True, "c=2": True, "c=4": True, "c=8": False, "c=16": False}
    held = [r for r in data["rows"] if not r["fitted"]]
    assert {r["metric"] for r in held} == {"output_throughput", "tpot_p50"}
    print("\nheld out:", [(r["point"], r["metric"], f"{r['rel_error']:+.2%}") for r in held])
    assert data["summary"]["held_out"]["figures"] == 4
    assert data["summary"]["held_out"]["max_abs_rel_error"] < 0.05, held
    assert (tmp_path / "score.png").stat().st_size > 10_000
    # The human table says which part each row is in.
    text = run("score", profile, table, *COLUMNS, "--metrics", "output_throughput")
    assert text.returncode == 0 and "held out" in text.stdout and "fitted" in text.stdout


@pytest.mark.parametrize("extra, says", [
    (["--fit-metrics", "tpot_mode"], "--fit-metrics 'tpot_mode': not a metric"),
    (["--fit-metrics", "ttft_mean"], "--fit-metrics: ttft_mean not measured in these rows"),
    (["--where", "concurrency>64"], "no row meets concurrency>64"),
    (["--where", "gpu==1"], "--where 'gpu==1'"),
    (["--requests-per-client", "0"], "--requests-per-client: requests each client sent, a whole number in [1, 1,000]"),
])
def test_calibrate_table_options_refused_in_one_line(table, base, tmp_path, extra, says):
    out = run("calibrate", table, "--base", base, "--out", tmp_path / "p.yaml", *COLUMNS, *extra)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], out.stderr


def test_score_refuses_what_it_cannot_read(table, base, tmp_path):
    undeclared = run("score", base, table)
    assert undeclared.returncode == 2 and "declare a column with --column NAME=concurrency" in undeclared.stderr
    unknown_row = run("score", base, table, *COLUMNS, "--rows", "c=3")
    assert unknown_row.returncode == 2 and "--rows: no benchmark row labelled 'c=3'" in unknown_row.stderr


TABLES = ROOT / "examples" / "tables"
VENDOR_COLUMNS = ["--column", "Concurrency=concurrency", "--column", "ISL=input_len", "--column", "OSL=output_len",
                  "--column", "Output tok/s=output_throughput", "--column", "Median TTFT (ms)=median_ttft_ms",
                  "--column", "Mean TPOT (ms)=mean_tpot_ms"]


@pytest.mark.parametrize("table, extra", [
    ("guidellm-chat.json", []), ("guidellm-0.3-chat.json", []), ("vllm-bench-chat.json", []),
    ("vendor-style.csv", VENDOR_COLUMNS),
])
def test_tables_measured_by_real_clients_read_as_the_clients_meant(table, extra):
    """The shipped tables, measured by GuideLLM and vllm bench serve against simcap serve of
    examples/chat.yaml, scored with that deployment's profile: TPOT (the engine's own pace, which
    no client overhead touches) agrees within 2% on every row, so each reader maps its tool's
    fields right (GuideLLM's inter-token latency is per request, after the first token; its
    time_per_output_token_ms, which includes the first token, is read as nothing)."""
    out = run("score", TABLES / "chat-profile.yaml", TABLES / table, *extra, "--metrics", "tpot_mean", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    rows = data["rows"]
    assert len(rows) == {"vllm-bench-chat.json": 1, "guidellm-0.3-chat.json": 2}.get(table, 4)
    assert all(not r["fitted"] for r in rows)
    assert all(abs(r["rel_error"]) < 0.02 for r in rows), rows


def test_a_guidellm_report_is_a_table_of_its_runs():
    points = read_benchmarks(TABLES / "guidellm-chat.json", engine={}, speculative=None)
    assert [p.label for p in points] == ["c=1", "c=2", "c=4", "c=8"]
    workload = points[3].scenario["workload"]
    assert workload["arrival"] == {"process": "closed", "concurrency": 8}
    assert (workload["input_len"], workload["output_len"], workload["num_requests"]) == (149, 32, 24)
    assert set(points[0].measured) >= {"ttft_mean", "ttft_p50", "tpot_mean", "e2e_p99", "output_throughput"}
    assert points[0].source["format"] == "guidellm"


def test_the_readme_journey(tmp_path):
    """The top README's path: fit the GuideLLM sweep's rows at 1-2 clients from a flat start,
    score the sweep (1-2 fitted, 4 and 8 held out) and the 16-client run it lacks."""
    profile = tmp_path / "fitted.yaml"
    fit = run("calibrate", TABLES / "guidellm-chat.json", "--base", TABLES / "start.yaml", "--where",
              "concurrency<=2", "--fit-metrics", "tpot_mean,e2e_mean", "--out", profile)
    assert fit.returncode == 0, fit.stderr
    sweep = json.loads(run("score", profile, TABLES / "guidellm-chat.json", "--json").stdout)
    assert {r["point"]: r["fitted"] for r in sweep["rows"]} == {"c=1": True, "c=2": True, "c=4": False, "c=8": False}
    beyond = json.loads(run("score", profile, TABLES / "guidellm-chat-c16.json", "--json").stdout)
    assert {r["point"] for r in beyond["rows"]} == {"c=16"} and not any(r["fitted"] for r in beyond["rows"])
    held = {r["metric"]: r["rel_error"] for r in sweep["rows"] if not r["fitted"] and r["point"] == "c=4"}
    assert abs(held["tpot_mean"]) < 0.05 and abs(held["e2e_mean"]) < 0.10, held


PUBLIC = ROOT / "calibration" / "data" / "public" / "dstack-deepseek-r1"
PUBLIC_COLS = ("--column", "random_input_len=input_len", "--column", "random_output_len=output_len",
               "--column", "completed=num_prompts", "--where", "backend==vllm", "--where", "dataset_name==random",
               "--where", "output_len==800")
ROOFLINE_TERMS = "base,efficiency.weights,efficiency.experts,efficiency.compute,efficiency.kv_read"


def test_the_readme_journey_on_a_public_table(tmp_path):
    """The top README's path on dstack's published DeepSeek-R1 sweep, by the command line: the
    H200 vLLM rows fitted at 4-16 clients in both forms, scored at 32-128; the roofline profile
    moved to the MI300X by ``--set step_time.hardware=mi300x`` and scored on that GPU's rows.
    Every cell of the README's two tables is what these commands print."""
    table = PUBLIC / "online_results.csv"
    assert table.read_bytes().startswith(b"\xef\xbb\xbf")  # kept verbatim: its byte-order mark too
    h200 = (*PUBLIC_COLS, "--where", "GPU==h200")
    fit_rows = (*h200, "--where", "concurrency<=16", "--fit-metrics", "tpot_mean,output_throughput")
    linear, roofline = tmp_path / "r1-h200.yaml", tmp_path / "r1-h200-roofline.yaml"
    fit = run("calibrate", table, "--base", PUBLIC / "start.yaml", *fit_rows, "--out", linear)
    assert fit.returncode == 0, fit.stderr
    assert "concurrency (not read: 'max_concurrency' is concurrency)" in " ".join(fit.stdout.split())
    fit = run("calibrate", table, "--base", PUBLIC / "start-roofline.yaml", *fit_rows, "--form", ROOFLINE_TERMS,
              "--out", roofline)
    assert fit.returncode == 0, fit.stderr

    def scored(profile, *args):
        out = run("score", profile, table, *args, "--json")
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        return data, {(r["point"], r["metric"]): r for r in data["rows"]}

    _, lin = scored(linear, *h200)
    _, roof = scored(roofline, *h200)
    moved_data, moved = scored(roofline, *PUBLIC_COLS, "--where", "GPU==mi300x", "--set", "step_time.hardware=mi300x")
    readme = (ROOT / "README.md").read_text()
    for c in (4, 8, 16, 32, 64, 128):
        p = f"c={c}"
        assert lin[(p, "tpot_mean")]["fitted"] == roof[(p, "tpot_mean")]["fitted"] == (c <= 16)
        t, o = lin[(p, "tpot_mean")], lin[(p, "output_throughput")]
        rt, ro = roof[(p, "tpot_mean")], roof[(p, "output_throughput")]
        line = (f"| {c} ({'fitted' if c <= 16 else 'held out'}) | {t['measured'] * 1e3:.1f} ms | "
                f"{t['rel_error'] * 100:+.1f}% | {rt['rel_error'] * 100:+.1f}% | {o['measured']:.0f} | "
                f"{o['rel_error'] * 100:+.1f}% | {ro['rel_error'] * 100:+.1f}% |")
        assert line in readme, line
    for c in (4, 16, 32, 64, 128):
        t, o = moved[(f"c={c}", "tpot_mean")], moved[(f"c={c}", "output_throughput")]
        assert not t["fitted"]  # other rows of the same file: held out
        line = (f"| {c} | {t['measured'] * 1e3:.1f} ms | {t['rel_error'] * 100:+.1f}% | {o['measured']:.0f} | "
                f"{o['rel_error'] * 100:+.1f}% |")
        assert line in readme, line
    assert moved_data["notes"][0].startswith("the profile as changed by --set step_time.hardware=mi300x")
    # Datasheet plus one point: the MI300X's 4-client row refits the fixed cost alone.
    transferred = tmp_path / "r1-mi300x.yaml"
    mi300x = (*PUBLIC_COLS, "--where", "GPU==mi300x")
    fit = run("calibrate", table, "--base", roofline, "--set", "step_time.hardware=mi300x", *mi300x,
              "--where", "concurrency==4", "--fit-metrics", "tpot_mean", "--form", "base", "--out", transferred)
    assert fit.returncode == 0, fit.stderr
    assumptions = yaml.safe_load(transferred.read_text())["provenance"]["assumptions"]
    assert any("changed by --set step_time.hardware=mi300x" in a for a in assumptions), assumptions
    _, one_point = scored(transferred, *mi300x)
    for c in (8, 16, 32, 64, 128):
        t, o = one_point[(f"c={c}", "tpot_mean")], one_point[(f"c={c}", "output_throughput")]
        line = (f"| {c} | {t['measured'] * 1e3:.1f} ms | {t['rel_error'] * 100:+.1f}% | {o['measured']:.0f} | "
                f"{o['rel_error'] * 100:+.1f}% |")
        assert line in readme, line
    assert one_point[("c=4", "tpot_mean")]["fitted"]
    # A load the table lacks: 256 clients, the roofline profile given on the command line.
    sim = run("simulate", PUBLIC / "predict.yaml", "--set", f"profile={roofline}", "--json")
    assert sim.returncode == 0, sim.stderr
    d = json.loads(sim.stdout)
    line = (f"It predicts {d['throughput']['output_tokens_per_s']:,.0f} output tok/s, a mean TPOT of "
            f"{d['tpot_s']['mean'] * 1e3:.1f} ms and a mean TTFT of {d['ttft_s']['mean']:.1f} s, with the\n"
            f"KV pool {'full' if d['kv_cache_usage']['max'] >= 1.0 else 'not full'} and {d['preemptions']} preemptions")
    assert line in readme, line


def test_roofline_on_a_table_says_how(tmp_path):
    """``--form roofline`` meets a table, with or without table options: one line saying the
    way that works (--base with a roofline step_time, --form naming its free terms)."""
    for extra in ((), ("--where", "GPU==h200")):
        out = run("calibrate", PUBLIC / "online_results.csv", *extra, "--form", "roofline", "--hardware", "h200-sxm",
                  "--model", "deepseek-r1", "--out", tmp_path / "x.yaml")
        assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
        assert "a table is fitted in the roofline form through --base" in out.stderr, out.stderr


def test_calibrate_set_needs_a_base_profile_or_scenario(tmp_path):
    table = PUBLIC / "online_results.csv"
    out = run("calibrate", table, *PUBLIC_COLS, "--set", "step_time.hardware=mi300x", "--out", tmp_path / "x.yaml")
    assert out.returncode == 2 and out.stderr.startswith("error: --set: changes the --base profile or scenario; "
                                                          "give --base"), out.stderr
    recipe = ROOT / "calibration" / "recipes" / "a800-minimax-m3.yaml"
    out = run("calibrate", table, "--base", recipe, "--set", "step_time.base=0.01", "--out", tmp_path / "x.yaml")
    assert out.returncode == 2 and "--set: changes a --base profile or scenario, not a recipe" in out.stderr, out.stderr
    out = run("calibrate", table, *PUBLIC_COLS, "--base", PUBLIC / "start.yaml", "--set", "engine.max_num_seqs=x",
              "--out", tmp_path / "x.yaml")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "max_num_seqs" in out.stderr, out.stderr


def test_score_set_is_checked_as_a_profile_is(tmp_path):
    bad = run("score", PUBLIC / "start.yaml", PUBLIC / "online_results.csv", *PUBLIC_COLS, "--where", "GPU==h200",
              "--set", "engine.max_num_seqs=0")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "engine.max_num_seqs: input should be greater than 0 (got 0)" in bad.stderr, bad.stderr
    bad = run("score", PUBLIC / "start.yaml", PUBLIC / "online_results.csv", "--set", "step_tim.base=1")
    assert bad.returncode == 2 and bad.stderr.startswith("error: profile.step_tim: "), bad.stderr


def test_a_declared_or_aliased_column_beats_a_bare_one(tmp_path):
    """``max_concurrency`` (the load a client set) over ``concurrency`` (what SGLang's
    bench_serving measured); a declared column over both; two of one standing: an error."""
    path = tmp_path / "t.csv"
    path.write_text("\ufeffmax_concurrency,concurrency,input_len,output_len,mean_tpot_ms\n4,3,100,20,10\n")
    def loads(reading: TableReading) -> list:
        return [p.scenario["workload"]["arrival"]["concurrency"]
                for p in read_benchmarks(path, engine=ENGINE, speculative=None, table=reading)]

    assert loads(TableReading()) == [4]
    assert loads(TableReading.parse(["concurrency=concurrency"])) == [3]
    path.write_text("load,clients,input_len,output_len,mean_tpot_ms\n4,5,100,20,10\n")
    with pytest.raises(CalibrationError, match=r"two columns read as 'concurrency' \('load' and 'clients'\); "
                                                r"declare the one to read with --column NAME=concurrency"):
        loads(TableReading.parse(["load=concurrency", "clients=concurrency"]))


def test_a_recipe_reads_a_table_as_the_options_do():
    """A recipe dataset's ``table`` section is ``--column``/``--where`` written down: the public
    cases' recipes read dstack's H200 vLLM rows, the same six the README's journey reads."""
    from simcap.calibrate import Recipe
    from simcap.calibrate.pipeline import benchmark_points

    points = benchmark_points(Recipe.load(ROOT / "calibration" / "recipes" / "dstack-r1-h200.yaml"))
    assert [p.label for p in points] == [f"vllm c={c}" for c in (128, 64, 32, 16, 8, 4)]
    assert points[-1].scenario["workload"]["input_len"] == 3200
    assert points[-1].measured["tpot_mean"] == pytest.approx(0.02573, rel=1e-3)


@pytest.mark.parametrize("section, says", [
    ({"columns": {"ISL": "input_len"}, "wher": []}, "dataset table: unknown key 'wher'; allowed: columns, where, gpus"),
    ("GPU==h200", "dataset table: a mapping; allowed: columns, where, gpus"),
    ({"where": ["GPU ~ h200"]}, "dataset table: --where 'GPU ~ h200': expected NAME OP VALUE"),
    ({"columns": ["ISL=input_len"]}, "dataset table: columns is a mapping NAME: KEY"),
])
def test_a_recipe_table_section_is_refused_in_one_line(tmp_path, section, says):
    recipe = yaml.safe_load((ROOT / "calibration" / "recipes" / "dstack-r1-h200.yaml").read_text())
    recipe["datasets"][0]["file"] = str(PUBLIC / "online_results.csv")
    recipe["datasets"][0]["table"] = section
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = run("calibrate", path, "--out", tmp_path / "p.yaml")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], out.stderr


def test_a_table_in_seconds_per_gpu_reads_as_the_harness_meant():
    """InferenceMAX's rows (latencies in seconds, throughput per GPU) through the public case's
    recipe: 2 x H100 vLLM rows at 4-64 clients in three shapes, TPOT in seconds, throughput times
    the 2 GPUs, each shape's lengths as the recipe declares them."""
    from simcap.calibrate import Recipe
    from simcap.calibrate.pipeline import benchmark_points

    points = {p.label: p for p in benchmark_points(Recipe.load(ROOT / "calibration" / "recipes"
                                                               / "inferencemax-gptoss-h100.yaml"))}
    assert sorted(points) == sorted(f"vllm tp2{shape} c={c}" for shape in ("", " 1k8k", " 8k1k")
                                    for c in (4, 8, 16, 32, 64))
    long_out = points["vllm tp2 1k8k c=4"].scenario["workload"]["output_len"]
    assert (long_out["low"], long_out["high"]) == (6553, 8192)
    row = json.loads((ROOT / "calibration" / "data" / "public" / "inferencemax-gpt-oss-120b"
                      / "agg_gptoss_1k1k.json").read_text())
    (c4,) = [r for r in row if r["hw"] == "h100" and r["framework"] == "vllm" and r["tp"] == 2 and r["conc"] == 4]
    assert points["vllm tp2 c=4"].measured["tpot_mean"] == pytest.approx(c4["mean_tpot"])
    assert points["vllm tp2 c=4"].measured["output_throughput"] == pytest.approx(2 * c4["output_tput_per_gpu"])
