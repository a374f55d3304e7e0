"""Smoke tests of `python -m benchmarks`: each quick suite runs end to end and writes its files."""

import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

import benchmarks
from benchmarks.__main__ import main
from benchmarks.bench_config import QUICK_SIZES, BenchConfig, contender_names, generation_contenders
from benchmarks.options import VARIANTS
from benchmarks.summary import generation_means
from benchmarks.timing import median_ms, time_calls


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """The quick benchmark, run once through the CLI: its output directory and results."""
    out_dir = tmp_path_factory.mktemp("bench")
    assert main(["--quick", "--out-dir", str(out_dir)]) == 0
    return out_dir, json.loads((out_dir / "results.json").read_text())


def test_writes_json_and_plots(quick_run):
    out_dir, _ = quick_run
    for name in ("results.json", "results.md", "per_token_time.png", "bandwidth_share.png"):
        assert (out_dir / name).stat().st_size > 0
    assert (out_dir / "per_token_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_results_have_every_figure(quick_run):
    _, results = quick_run
    config = results["config"]
    assert config["max_len"] == QUICK_SIZES["max_len"]
    sections = {"config", "machine", "versions", "source", "method", "memory", "measurements", "generation", "targets"}
    assert sections <= set(results)
    assert {"jax", "flax"} <= set(results["versions"])
    names = contender_names(tuple(config["layouts"]))
    measured = {(r["batch_size"], r["filled"], r["contender"]) for r in results["measurements"]}
    expected = {(b, t, n) for b in config["batch_sizes"] for t in config["filled"] for n in names}
    assert measured == expected
    for row in results["measurements"] + results["generation"]:
        assert math.isfinite(row["ms_per_token"]) and row["ms_per_token"] > 0
    for row in results["measurements"]:
        assert len(row["samples_ms_per_token"]) == config["repeats"]
        assert row["bytes_per_s"] > 0 and row["calibration_share"] > 0
    assert all(math.isfinite(t["value"]) for t in results["targets"])
    names = [t["name"] for t in results["targets"]]
    assert any(name.startswith("calibration time at T=") for name in names)  # the bandwidth-bound reference


def test_decode_is_timed_safe_and_donated_side_by_side(quick_run):
    out_dir, results = quick_run
    config = results["config"]
    smallest = min(config["batch_sizes"])
    pairs = [(f"kvattn_decode/{layout}", f"kvattn_decode_donated/{layout}") for layout in config["layouts"]]
    measured = {(r["batch_size"], r["filled"], r["contender"]) for r in results["measurements"]}
    timed_whole = {w["contender"] for w in results["whole_generation"]}
    markdown = (out_dir / "results.md").read_text()
    for safe, donated in pairs:
        for b in config["batch_sizes"]:
            for t in config["filled"]:
                assert {(b, t, safe), (b, t, donated)} <= measured
        assert {safe, donated} <= timed_whole
        assert f"| `{donated}` |" in markdown
    mean = {g["contender"]: g["ms_per_token"] for g in results["generation"] if g["batch_size"] == smallest}
    ratios = {t["name"]: t for t in results["targets"] if "(safe default)" in t["name"]}
    assert set(ratios) == {f"{safe} (safe default) / {donated} time" for safe, donated in pairs}
    for safe, donated in pairs:
        ratio = ratios[f"{safe} (safe default) / {donated} time"]
        assert ratio["value"] == pytest.approx(mean[safe] / mean[donated])
        assert ratio["threshold"] is None and ratio["met"] is None and ratio["batch_size"] == smallest


def test_contenders_agree_with_recompute(quick_run):
    _, results = quick_run
    diffs = [r["max_abs_diff_vs_recompute"] for r in results["measurements"] if r["contender"] != "calibration"]
    assert max(diffs) < 1e-4


def test_memory_column(quick_run):
    _, results = quick_run
    sizes = QUICK_SIZES
    per_token = 2 * sizes["in_features"] * 4  # keys and values of every head, float32
    for row in results["memory"]:
        assert row["cache_bytes_per_token_per_layer"] == per_token
        assert row["cache_bytes_total"] == row["batch_size"] * sizes["max_len"] * per_token


def test_rejects_unknown_dtype(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        benchmarks.run(dtype="float16", quick=True, out_dir=tmp_path)


def test_int8_cache_run_reports_its_memory_and_stays_close(tmp_path):
    results = benchmarks.run(dtype="int8", quick=True, out_dir=tmp_path, layouts=("heads_major",), batch_sizes=(1,))
    sizes = QUICK_SIZES
    per_token = 2 * sizes["in_features"] * 1 + 2 * sizes["num_heads"] * 4  # int8 keys and values, float32 scales
    assert results["memory"][0]["cache_bytes_per_token_per_layer"] == per_token
    kvattn_rows = [r for r in results["measurements"] if r["contender"].startswith("kvattn")]
    assert kvattn_rows and all(0 < r["max_abs_diff_vs_recompute"] < 0.1 for r in kvattn_rows)


def test_whole_generations_are_timed_at_the_smallest_batch(quick_run):
    _, results = quick_run
    config = results["config"]
    smallest = min(config["batch_sizes"])
    timed = {(w["batch_size"], w["contender"]) for w in results["whole_generation"]}
    assert timed == {(smallest, name) for name in generation_contenders(tuple(config["layouts"]))}
    for row in results["whole_generation"]:
        assert len(row["samples_ms_per_token"]) == config["generation_repeats"]
    for row in results["generation"]:
        whole = (row["batch_size"], row["contender"]) in timed
        assert row["method"] == ("whole generation" if whole else "interpolated")


def test_the_timer_leaves_out_warm_ups_and_preparation_and_divides_by_units():
    calls = []

    def call(state):
        calls.append(state)
        time.sleep(0.004)
        return len(calls)

    timing = time_calls(call, 3, prepare=lambda: "prepared", units=2, warm_ups=2)
    assert calls == ["prepared"] * 5 and timing.last_output == 5
    assert len(timing.ms) == 3 and all(2 <= ms < 1000 for ms in timing.ms)  # 4 ms over 2 units
    assert median_ms(lambda: time.sleep(0.004), 1, warm_ups=0) >= 4


def test_generation_mean_interpolates_unless_a_whole_generation_was_timed():
    config = BenchConfig(
        in_features=8, num_heads=2, max_len=4, batch_sizes=(1,), filled=(2, 4), layouts=("heads_major",),
        dtype="float32", repeats=1, generation_repeats=1,
    )
    names = contender_names(config.layouts)[:-1]
    rows = [{"batch_size": 1, "filled": t, "contender": n, "ms_per_token": float(t)} for t in (2, 4) for n in names]
    whole = [{"batch_size": 1, "contender": "flax_scan", "ms_per_token": 10.0}]
    means = {g["contender"]: g for g in generation_means(config, rows, whole)}
    # Curve 2, 2, 3, 4 over filled lengths 1..4 (constant below T=2, linear between).
    assert means["recompute"]["ms_per_token"] == pytest.approx(2.75)
    assert means["flax_scan"]["ms_per_token"] == 10.0
    assert means["flax_scan"]["interpolated_ms_per_token"] == pytest.approx(2.75)


def test_import_kvattn_loads_no_bench_dependencies():
    # A fresh interpreter: the other tests have long since imported the benchmarks and their extra here.
    script = (
        "import sys, kvattn, kvattn.cli, kvattn.demo\n"
        "loaded = lambda roots: sorted(m for m in sys.modules if m.split('.')[0] in roots)\n"
        "print(loaded({'matplotlib', 'tqdm', 'benchmarks'}))\n"
        "import benchmarks\n"
        "print(loaded({'matplotlib', 'tqdm'}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == ["[]", "[]"]


def test_the_benchmarks_live_at_the_repository_root_not_in_the_package():
    assert importlib.util.find_spec("kvattn.bench") is None
    assert Path(benchmarks.__file__).parent.parent == Path(__file__).parents[2]


def test_a_missing_extra_fails_before_measuring_and_names_the_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm` raise ImportError
    out_dir = tmp_path / "out"
    assert main(["--quick", "--out-dir", str(out_dir)]) == 2
    assert "need the bench extra, which provides tqdm: pip install 'kvattn[bench]'" in capsys.readouterr().err
    assert not out_dir.exists()


@pytest.fixture(scope="module")
def options_run(tmp_path_factory):
    """`python -m benchmarks --options --quick`, run once: its output directory and results."""
    out_dir = tmp_path_factory.mktemp("options")
    assert main(["--options", "--quick", "--batch-sizes", "1", "--out-dir", str(out_dir)]) == 0
    return out_dir, json.loads((out_dir / "options.json").read_text())


def test_options_time_every_variant_against_the_plain_layer(options_run):
    out_dir, results = options_run
    assert sorted(p.name for p in out_dir.iterdir()) == ["options.json", "options.md"]  # never run's files
    config = results["config"]
    assert config["max_len"] == QUICK_SIZES["max_len"] and config["repeats"] == QUICK_SIZES["repeats"]
    assert {"config", "machine", "versions", "source", "method", "variants", "measurements"} <= set(results)
    assert list(results["variants"]) == list(VARIANTS)
    measured = {(r["batch_size"], r["filled"], r["variant"]) for r in results["measurements"]}
    assert measured == {(b, t, v) for b in config["batch_sizes"] for t in config["filled"] for v in VARIANTS}
    assert len(results["measurements"]) == len(measured)
    for row in results["measurements"]:
        assert math.isfinite(row["ms_per_token"]) and row["ms_per_token"] > 0
        assert math.isfinite(row["ratio_to_plain"]) and row["ratio_to_plain"] > 0
        assert len(row["samples_ms_per_token"]) == config["repeats"] and row["bytes_per_s"] > 0
        plain = next(
            r for r in results["measurements"]
            if (r["batch_size"], r["filled"], r["variant"]) == (row["batch_size"], row["filled"], "plain")
        )
        assert row["ratio_to_plain"] == pytest.approx(row["ms_per_token"] / plain["ms_per_token"])
        # Each variant's decode reproduces its own uncached forward (bfloat16 compute: to its precision).
        assert row["max_abs_diff_vs_recompute"] < (0.1 if row["variant"].startswith("bf16") else 1e-4)
    steps = {(r["batch_size"], r["filled"], r["variant"]): r["bytes_per_step"] for r in results["measurements"]}
    for b in config["batch_sizes"]:
        for t in config["filled"]:
            assert steps[b, t, "bf16_params"] < steps[b, t, "plain"] == steps[b, t, "rope"]  # half the weight bytes
    markdown = (out_dir / "options.md").read_text()
    for name, spelled in results["variants"].items():
        assert f"| `{name}` | `{spelled}` |" in markdown
    assert "(1.00×)" in markdown


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--generation-repeats", "1"], "does not apply"), (["--layouts", "slots_major", "heads_major"], "one layout")],
)
def test_options_refuse_settings_they_cannot_use(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as refused:
        main(["--options", "--quick", "--out-dir", str(tmp_path), *extra])
    assert refused.value.code == 2 and message in capsys.readouterr().err


def test_model_bench_times_every_contender_and_reports_transformers_unavailable(tmp_path, capsys):
    # This interpreter has no torch: the transformers rows say so instead of failing the run.
    out_dir = tmp_path / "model"
    argv = ["--model", "--quick", "--batch-sizes", "1", "2", "--out-dir", str(out_dir),
            "--torch-python", sys.executable, "--torch-compile", "--dtypes", "float32", "int4"]
    assert main(argv) == 0
    capsys.readouterr()
    results = json.loads((out_dir / "model.json").read_text())
    assert (out_dir / "model.md").stat().st_size > 0 and (out_dir / "checkpoint" / "model.safetensors").exists()
    # int4 weights: kvattn against its own float32 tokens and the limit; no transformers contender to ask.
    four = {(r["batch_size"], r["contender"]): r for r in results["rows"] if r["dtype"] == "int4"}
    assert set(four) == {(b, c) for b in (1, 2) for c in ("limit", "kvattn.generation.generate")} | {
        (1, "kvattn.generation.stream")}
    assert all(0 <= four[b, "kvattn.generation.generate"]["agrees_with_kvattn"] <= 1 for b in (1, 2))
    rows = {(r["batch_size"], r["contender"]): r for r in results["rows"] if r["dtype"] == "float32"}
    transformers = ("transformers_dynamic", "transformers_static", "transformers_static_compiled")
    contenders = ("limit", "kvattn.generation.generate", "plain_cache", *transformers)
    assert set(rows) == {(b, c) for b in (1, 2) for c in contenders} | {(1, "kvattn.generation.stream")}
    streamed = rows[1, "kvattn.generation.stream"]  # one sequence: the same tokens, the first without a step after it
    assert streamed["agrees_with_kvattn"] == 1.0 and 0 < streamed["first_token_ms"]
    assert math.isfinite(streamed["decode_ms_per_token"])
    for batch in (1, 2):
        for name in transformers:
            assert "transformers not installed" in rows[batch, name]["unavailable"]
        ours = rows[batch, "kvattn.generation.generate"]
        assert ours["first_token_ms"] > 0 and ours["whole_ms"] > 0 and math.isfinite(ours["decode_ms_per_token"])
        assert ours["compiles_while_timed"] == 0
        assert rows[batch, "limit"]["decode_ms_per_token"] > 0 and rows[batch, "limit"]["bandwidth_gbs"] > 0
        plain = rows[batch, "plain_cache"]
        assert plain["decode_ms_per_token"] > 0 and plain["compiles_while_timed"] == 0
        assert plain["agrees_with_kvattn"] == 1.0  # the hand-rolled decoder produces the same greedy tokens
    assert {t["name"] for t in results["targets"]} >= {"compilations while timed", "speedup over plain_cache"}
    compiles = [t for t in results["targets"] if t["name"] == "compilations while timed"]
    assert all(t["value"] == 0 and t["met"] for t in compiles)
    unavailable = [t for t in results["targets"] if t["name"] == "speedup over transformers' best"]
    assert unavailable and all(t["value"] is None and t["met"] is None for t in unavailable)


def test_the_model_limit_is_timed_in_every_repeat_beside_the_contenders():
    """A shared host's bandwidth moves by the minute: the calibration runs at the start of each repeat, in turn."""
    from benchmarks.model import _interleaved

    calls = []

    class Calibration:
        speeds = iter([3.0, 1.0, 2.0])

        def bytes_per_second(self):
            calls.append("limit")
            return next(self.speeds)

    def contender(name, seconds):
        def once(count):
            calls.append((name, count))
            return seconds * count, [count]
        return once

    rows, speed = _interleaved({"a": contender("a", 1.0), "b": contender("b", 2.0)}, 5, 3, Calibration())
    assert calls == ["limit", ("a", 1), ("a", 5), ("b", 1), ("b", 5)] * 3
    assert speed == 2.0  # the median of the three repeats
    assert rows["b"]["first_token_ms"] == 2000 and rows["b"]["decode_ms_per_token"] == 2000


def test_model_targets_are_issue_23s_ratios_across_dtypes():
    """int8 rows are judged against float32 ones: transformers' best of each, and kvattn's own float32."""
    from benchmarks.model import _targets

    def row(dtype, batch, contender, decode, first=None):
        return {"dtype": dtype, "batch_size": batch, "contender": contender, "decode_ms_per_token": decode,
                "first_token_ms": first, "compiles_while_timed": 0}

    rows = [row("float32", 8, "kvattn.generation.generate", 30.0, 500.0),
            row("float32", 8, "transformers_static", 45.0, 600.0),
            row("float32", 8, "transformers_dynamic", 48.0, 550.0), row("float32", 8, "plain_cache", 40.0),
            row("int8", 8, "kvattn.generation.generate", 20.0, 400.0), row("int8", 8, "transformers_dynamic", 30.0, 450.0)]
    got = {(t["dtype"], t["name"]): (t["value"], t["met"]) for t in _targets(rows)}
    assert got["float32", "speedup over transformers' best"] == (1.5, True)
    assert got["float32", "first token: transformers' best / kvattn"] == (1.1, True)
    assert got["int8", "speedup over transformers' best float32"] == (2.25, True)
    assert got["int8", "speedup over transformers' best int8"] == (1.5, True)
    assert got["int8", "speedup over kvattn float32"] == (1.5, None)  # reported at B > 1, a goal at B=1
    assert got["int8", "compilations while timed"] == (0, True)


def test_model_targets_against_llama_cpp_are_issue_36s_at_batch_one():
    from benchmarks.model import _targets

    def row(dtype, batch, contender, decode, first):
        return {"dtype": dtype, "batch_size": batch, "contender": contender, "decode_ms_per_token": decode,
                "first_token_ms": first, "compiles_while_timed": 0}

    rows = [row(dtype, batch, name, decode, first)
            for dtype in ("float32", "int8") for batch in (1, 8)
            for name, decode, first in (("kvattn.generation.generate", 10.0, 100.0), ("llama.cpp", 12.0, 150.0))]
    got = {(t["dtype"], t["batch_size"], t["name"]): (t["value"], t["threshold"], t["met"]) for t in _targets(rows)}
    assert got["float32", 1, "speedup over llama.cpp"] == (1.2, 1.1, True)
    assert got["int8", 1, "speedup over llama.cpp"] == (1.2, 1.3, False)
    assert got["int8", 8, "speedup over llama.cpp"] == (1.2, None, None)  # reported
    assert got["float32", 1, "first token: llama.cpp / kvattn"][0] == 1.5
    assert not any(name == "speedup over llama.cpp" for _, _, name in
                   {(t["dtype"], t["batch_size"], t["name"]) for t in _targets(rows[:1])})  # only where it ran


def test_model_options_apply_only_with_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        main(["--quick", "--new-tokens", "4", "--out-dir", str(tmp_path)])
    assert refused.value.code == 2 and "only with --model" in capsys.readouterr().err


def test_paged_bench_measures_every_target(tmp_path, capsys):
    out_dir = tmp_path / "paged"
    assert main(["--paged", "--quick", "--out-dir", str(out_dir)]) == 0
    capsys.readouterr()
    result = json.loads((out_dir / "paged.json").read_text())
    assert (out_dir / "paged.md").stat().st_size > 0
    assert len(result["targets"]) == 7 and all(math.isfinite(t["value"]) for t in result["targets"])
    # Counted, not timed: these hold at any size.
    assert result["memory"]["allocated_over_used"] <= 1 + result["sizes"]["page_size"] / 16
    assert result["forks"]["pages"] == result["forks"]["expected"] < result["forks"]["copied"]
    assert result["prefix_hit"]["cached_tokens"] > 0
    contenders = {(r["contender"], r["filled"]) for r in result["decode"]}
    names = ("contiguous", "paged/slots_major", "paged/heads_major", "calibration")
    for row in result["concurrency"]:  # pages lose at most a page per sequence against the ideal
        assert row["ideal"] * 0.9 <= row["ratio"] <= row["ideal"]
    assert contenders == {(c, t) for c in names for t in result["sizes"]["filled"]}
    with pytest.raises(SystemExit) as refused:
        main(["--paged", "--quick", "--batch-sizes", "2"])
    assert refused.value.code == 2 and "--paged takes" in capsys.readouterr().err


# A stand-in for llama.cpp's server: what `LlamaServer` starts, speaking the part of its API the contender uses.
FAKE_LLAMA_SERVER = r"""#!PYTHON
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
assert args[args.index("--parallel") + 1] == "2" and args[args.index("-t") + 1] == "1", args

class Handler(BaseHTTPRequestHandler):
    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply({"status": "ok"} if self.path == "/health" else {"build_info": "fake-1"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["temperature"] == 0 and body["cache_prompt"] is False and body["ignore_eos"], body
        assert all(isinstance(t, int) for t in body["prompt"]), body
        self.reply({"tokens": [body["prompt"][-1] + i for i in range(body["n_predict"])]})

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_the_llama_cpp_contender_sends_token_ids_greedily_and_returns_the_tokens(tmp_path):
    from benchmarks.llama_cpp_contender import LlamaServer

    server = tmp_path / "llama-server"
    server.write_text(FAKE_LLAMA_SERVER.replace("PYTHON", sys.executable))
    server.chmod(0o755)
    contender = LlamaServer(tmp_path, tmp_path / "model.gguf", [[1, 2, 3], [7, 8, 9]], 4, threads=1)
    try:
        assert contender.version == "fake-1"
        elapsed, tokens = contender.once(3)
        assert elapsed > 0 and tokens == [[3, 4, 5], [9, 10, 11]]
    finally:
        contender.close()
    assert contender.process.poll() is not None
