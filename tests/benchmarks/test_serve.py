"""The serve benchmark's pure parts: arrival schedules, workloads, stream reading, summaries, targets and the report.

No server runs here: the outcomes are written by hand, their figures worked out in the comments.
"""

import dataclasses
import json
import math

import numpy as np
import pytest

from benchmarks import serve_checkpoint, serve_generate
from benchmarks.report import write
from benchmarks.serve import (
    LoadConfig,
    Outcome,
    Pool,
    arrivals,
    cached_share,
    make_workload,
    mark_agreement,
    parse_metrics,
    percentile,
    plot_serve,
    request_body,
    serve_markdown,
    server_command,
    summarize,
    targets,
    text_window,
)
from tests.helpers import FIXTURES

WORDS = [f"w{i}" for i in range(1000)]


def encode(text):
    """A word-level toy tokenizer: one id per space-separated word."""
    return [int(word[1:]) for word in text.split()]


def decode(ids):
    return " ".join(WORDS[i] for i in ids)


STREAM = list(range(1000)) * 3


def test_arrivals_all_at_once_at_inf():
    assert arrivals(5, math.inf, np.random.default_rng(0)).tolist() == [0.0] * 5


def test_arrivals_are_a_seeded_poisson_process():
    times = arrivals(20000, 4.0, np.random.default_rng(1))
    assert times[0] == 0.0
    assert np.all(np.diff(times) >= 0)
    # Exponential gaps of mean 1/rate: over 20000 the mean is within 2% (its standard error is 0.7%).
    assert np.mean(np.diff(times)) == pytest.approx(0.25, rel=0.02)
    assert np.array_equal(times, arrivals(20000, 4.0, np.random.default_rng(1)))


def test_arrivals_reject_a_rate_that_is_not_positive():
    with pytest.raises(ValueError, match="positive"):
        arrivals(3, 0.0, np.random.default_rng(0))


def test_text_window_has_the_length_asked():
    text, count = text_window(STREAM, 7, encode, decode, np.random.default_rng(0))
    assert count == 7 and len(encode(text)) == 7


def test_text_window_cuts_back_what_encodes_longer():
    def splitting(text):
        """Encodes the words from w500 on as two tokens each, so a window can encode longer than it was."""
        return [i for i in encode(text) for _ in range(1 + (i >= 500))]

    for seed in range(20):
        text, count = text_window(STREAM, 8, splitting, decode, np.random.default_rng(seed))
        assert count in (7, 8) and len(splitting(text)) == count


def test_the_prompts_text_is_kept_in_the_cache_as_first_read(tmp_path, monkeypatch):
    """The repository's text the prompts are cut from is read once per cache, so later edits leave the workload."""
    monkeypatch.setattr(serve_checkpoint, "corpus", lambda: ["first", "text"])
    assert serve_checkpoint.kept_corpus(tmp_path / "cache") == "first\ntext"
    monkeypatch.setattr(serve_checkpoint, "corpus", lambda: ["edited"])
    assert serve_checkpoint.kept_corpus(tmp_path / "cache") == "first\ntext"
    assert serve_checkpoint.kept_corpus(tmp_path / "other") == "edited"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["corpus.txt"]


def test_workload_lengths_and_system_share():
    requests = make_workload(STREAM, encode, decode, num_requests=40, prompt_tokens=(3, 9), output_tokens=(2, 5),
                             system_share=0.5, rng=np.random.default_rng(2))
    assert [r.index for r in requests] == list(range(40))
    assert sum(r.system for r in requests) == 20
    assert all(3 <= r.user_tokens <= 9 and len(encode(r.user)) == r.user_tokens for r in requests)
    assert all(2 <= r.max_tokens <= 5 for r in requests)
    assert {r.max_tokens for r in requests} == {2, 3, 4, 5}  # both ends of the range are drawn
    again = make_workload(STREAM, encode, decode, num_requests=40, prompt_tokens=(3, 9), output_tokens=(2, 5),
                          system_share=0.5, rng=np.random.default_rng(2))
    assert again == requests


def test_request_bodies_for_chat_and_completions():
    request = make_workload(STREAM, encode, decode, num_requests=1, prompt_tokens=(4, 4), output_tokens=(3, 3),
                            system_share=1.0, rng=np.random.default_rng(0))[0]
    chat = request_body(request, "SYS ", endpoint="chat", model="m")
    assert chat["messages"] == [{"role": "system", "content": "SYS "}, {"role": "user", "content": request.user}]
    assert (chat["max_tokens"], chat["temperature"], chat["stream"], chat["model"]) == (3, 0.0, True, "m")
    completion = request_body(request, "SYS ", endpoint="completions", model="m")
    assert completion["prompt"] == "SYS " + request.user and "messages" not in completion
    # The same text as ids, so servers with different tokenizers decode from the same tokens.
    ids = request_body(request, "w7 ", endpoint="completions-ids", model="m", encode=encode)
    assert ids["prompt"] == [7, *encode(request.user)] and ids["max_tokens"] == 3
    with pytest.raises(ValueError, match="encode"):
        request_body(request, "w7 ", endpoint="completions-ids", model="m")


def test_server_commands_for_kvattn_int8_and_llama_server(tmp_path):
    pool = Pool(num_pages=64, page_size=16, max_batch=8, max_len=512)
    common = dict(port=8123, checkpoint=tmp_path, pool=pool, kvattn="kvattn", transformers="transformers",
                  extra_args={"llama-server": ["--flash-attn", "on"]})
    int8 = server_command("kvattn-int8", **common)
    assert int8[:3] == ["kvattn", "serve", str(tmp_path)] and int8[-2:] == ["--weights", "int8"]
    assert "--no-prefix-caching" not in int8
    ggufs = {"f32": tmp_path / "m-f32.gguf", "q8_0": tmp_path / "m-q8_0.gguf"}
    for name, kind in (("llama-server", "f32"), ("llama-server-q8_0", "q8_0")):
        command = server_command(name, **common, llama_server=tmp_path / "bin", ggufs=ggufs, threads=2)
        flags = dict(zip(command[1:-2:2], command[2:-2:2]))
        assert command[0] == str(tmp_path / "bin" / "llama-server") and flags["-m"] == str(ggufs[kind])
        # As many slots as kvattn's batch, each max_len tokens; the port asked for; the extra arguments last.
        assert (flags["--parallel"], flags["-c"], flags["-t"], flags["--port"]) == ("8", "4096", "2", "8123")
        assert command[-2:] == ["--flash-attn", "on"]
    with pytest.raises(ValueError, match="q8_0 GGUF"):
        server_command("llama-server-q8_0", **common, llama_server=tmp_path, ggufs={"f32": ggufs["f32"]})
    with pytest.raises(ValueError, match="unknown contender"):
        server_command("vllm", **common)


def test_outcome_reads_chat_and_completion_chunks():
    chat = Outcome(0, False, 4, 3)
    chat.read({"id": "a", "choices": [{"delta": {"role": "assistant"}, "index": 0}]}, 0.1)  # no text: not a token
    chat.read({"id": "a", "choices": [{"delta": {"content": "x"}, "index": 0}]}, 0.2)
    chat.read({"id": "a", "choices": [{"delta": {}, "index": 0, "finish_reason": "length"}],
               "usage": {"prompt_tokens": 9, "completion_tokens": 1}}, 0.3)
    assert (chat.ttft_s, chat.chunk_s, chat.text, chat.finishes, chat.ids) == (0.2, [0.2], "x", 1, ["a"])
    assert (chat.prompt_tokens, chat.completion_tokens, chat.finish_reason) == (9, 1, "length")
    completion = Outcome(1, False, 4, 3)
    completion.read({"id": "b", "choices": [{"text": "y", "index": 0}]}, 0.5)
    completion.read({"id": "b", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1}}, 0.6)
    assert (completion.ttft_s, completion.text, completion.finishes) == (0.5, "y", 0)
    failed = Outcome(2, False, 4, 3)
    failed.read({"error": "boom"}, 0.1)
    assert failed.error.startswith("error chunk")


def _outcome(index, *, chunk_s, end_s, system=False, max_tokens=4, finishes=1, ids=None, error=None,
             completion_tokens=None, done_markers=1):
    chunk_s = list(chunk_s)
    return dataclasses.asdict(Outcome(
        index, system, 10, max_tokens, sent_s=0.0, status=200, error=error, ttft_s=chunk_s[0] if chunk_s else None,
        end_s=end_s, chunk_s=chunk_s, finishes=finishes, done_markers=done_markers,
        ids=[f"id{index}"] if ids is None else ids, completion_tokens=completion_tokens))


def test_percentile_interpolates_linearly():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([], 50) is None


def test_summary_figures():
    outcomes = [
        # TTFT 100 ms, gaps 100 and 200 ms, 3 tokens: TPOT (400 - 100) / 2 = 150 ms.
        _outcome(0, chunk_s=[0.1, 0.2, 0.4], end_s=0.4, system=True, max_tokens=3),
        # usage says 4 tokens over 3 chunks: TTFT 300 ms, TPOT (600 - 300) / 3 = 100 ms; stopped short of 8.
        _outcome(1, chunk_s=[0.3, 0.5, 0.6], end_s=0.6, completion_tokens=4, max_tokens=8),
        _outcome(2, chunk_s=[], end_s=None, finishes=0, error="lost: the stream ended without a finish"),
        _outcome(3, chunk_s=[], end_s=None, finishes=0, error="HTTP 429: busy"),
    ]
    s = summarize(outcomes, wall_s=2.0)
    assert (s["requests"], s["completed"], s["failed"], s["lost"], s["duplicated"]) == (4, 2, 2, 1, 0)
    assert s["errors"] == [("HTTP 429", 1), ("lost", 1)]
    assert (s["output_tokens"], s["output_tokens_per_s"], s["stopped_early"], s["usage_reported"]) == (7, 3.5, 1, 1)
    assert (s["output_tokens_min"], s["output_tokens_max"]) == (3, 4)
    assert s["ttft_ms"]["p50"] == pytest.approx(200) and s["ttft_ms"]["count"] == 2
    assert s["tpot_ms"]["p50"] == pytest.approx(125) and s["tpot_ms"]["p99"] == pytest.approx(149.5)
    assert s["itl_ms"]["count"] == 4 and s["itl_ms"]["p50"] == pytest.approx(150)  # gaps 100, 200, 200, 100
    assert s["ttft_system_p50_ms"] == pytest.approx(100) and s["ttft_no_system_p50_ms"] == pytest.approx(300)


def test_summary_counts_duplicates():
    outcomes = [
        _outcome(0, chunk_s=[0.1, 0.2], end_s=0.2, finishes=2),  # two finishes in one stream
        _outcome(1, chunk_s=[0.1, 0.2], end_s=0.2, done_markers=2),  # two [DONE]
        _outcome(2, chunk_s=[0.1, 0.2], end_s=0.2, ids=["same"]),  # one completion sent to two requests
        _outcome(3, chunk_s=[0.1, 0.2], end_s=0.2, ids=["same"]),
        _outcome(4, chunk_s=[0.1, 0.2], end_s=0.2),
    ]
    s = summarize(outcomes, wall_s=1.0)
    assert s["duplicated"] == 4 and s["completed"] == 4  # two finishes is not one completion


def test_metrics_give_the_share_of_prompt_tokens_cached():
    before = parse_metrics("# HELP x\nkvattn_prompt_tokens_total 100.0\nkvattn_prompt_tokens_cached_total 20.0\n"
                           'kvattn_ttft_seconds_bucket{le="0.1"} 3.0\nkvattn_requests_total{finish_reason="length"} 4.0')
    assert before == {"kvattn_prompt_tokens_total": 100.0, "kvattn_prompt_tokens_cached_total": 20.0,
                      'kvattn_requests_total{finish_reason="length"}': 4.0}
    after = {**before, "kvattn_prompt_tokens_total": 300.0, "kvattn_prompt_tokens_cached_total": 170.0}
    assert cached_share(before, after) == 0.75  # 150 of the 200 admitted since
    assert cached_share(None, after) is None and cached_share(before, before) is None
    assert cached_share({}, {"other_total": 1.0}) is None


def _results(tmp_rates=(1.0, math.inf)):
    """Three contenders over two rates; kvattn twice as fast as transformers, prefix caching 10x its TTFT."""

    def measured(rate, tokens_per_s, tpot_p99, ttft_system):
        outcomes = [_outcome(0, chunk_s=[ttft_system / 1e3, ttft_system / 1e3 + 0.1], end_s=ttft_system / 1e3 + 0.1,
                             system=True, max_tokens=2)]
        summary = summarize(outcomes, wall_s=1.0)
        summary.update(output_tokens_per_s=tokens_per_s, tpot_ms={"p50": tpot_p99 / 2, "p99": tpot_p99, "count": 1},
                       ttft_system_p50_ms=ttft_system)
        return {"rate": rate, "summary": summary, "requests": outcomes}

    figures = {"kvattn": (40.0, 50.0, 10.0), "kvattn-no-prefix": (30.0, 60.0, 100.0),
               "transformers": (20.0, 100.0, 200.0)}
    contenders = [{"contender": name, "rates": [measured(rate, *figure) for rate in tmp_rates]}
                  for name, figure in figures.items()]
    config = {**dataclasses.asdict(LoadConfig(rates=tmp_rates)), "rates": list(tmp_rates),
              "pool": {**dataclasses.asdict(Pool()), "tokens": Pool().tokens,
                       "transformers_blocks": Pool().transformers_blocks}}
    results = {"config": config, "contenders": contenders}
    mark_agreement(contenders)
    results["targets"] = targets(results)
    return results


def test_targets_against_transformers_and_without_prefix_caching():
    rows = {(t["name"], t["rate"]): t for t in _results()["targets"]}
    throughput = rows[("output tokens/s at saturation, kvattn / transformers", math.inf)]
    assert (throughput["value"], throughput["met"]) == (2.0, True)
    assert rows[("p99 TPOT, kvattn / transformers", 1.0)]["value"] == 0.5
    ttft = "p50 TTFT with the system prompt, no prefix caching / prefix caching"
    assert (rows[(ttft, 1.0)]["value"], rows[(ttft, 1.0)]["met"]) == (10.0, True)
    assert rows[(ttft, math.inf)]["met"] is None  # reported only: queueing dominates at saturation
    assert rows[("lost or duplicated requests, transformers", "all")]["value"] == 0


def test_targets_against_llama_server_where_both_ran():
    results = _results()
    for row in results["contenders"]:  # kvattn at 40 tokens/s against 25, and its p99 TPOT of 50 ms against 40
        if row["contender"] == "transformers":
            copy = json.loads(json.dumps(row))
            for measured in copy["rates"]:
                measured["summary"].update(output_tokens_per_s=25.0, tpot_ms={"p50": 20.0, "p99": 40.0, "count": 1})
            results["contenders"].append({**copy, "contender": "llama-server"})
    rows = {(t["name"], t["rate"]): t for t in targets(results)}
    throughput = rows[("output tokens/s at saturation, kvattn / llama-server", math.inf)]
    assert (throughput["value"], throughput["threshold"], throughput["met"]) == (1.6, 1.5, True)
    tpot = rows[("p99 TPOT, kvattn / llama-server", 1.0)]
    assert (tpot["value"], tpot["met"]) == (1.25, False)
    # The int8 pair did not run: no row, where the transformers pair is always reported.
    assert not any("llama-server-q8_0" in name for name, _ in rows)


def test_targets_against_generate_in_fixed_batches():
    """kvattn serves 40 tokens/s at saturation; `generate` made 45 on the same requests: 0.89x, over 0.8."""
    results = _results()
    results["generate"] = {"kvattn": {"output_tokens": 90, "seconds": 2.0, "output_tokens_per_s": 45.0},
                           "kvattn-int8": {"unavailable": "exit code 1: no"}}
    rows = {t["name"]: t for t in targets(results)}
    reference = rows["output tokens/s at saturation, kvattn / generate in batches of 32"]
    assert (reference["value"], reference["threshold"], reference["met"]) == (40.0 / 45.0, 0.8, True)
    assert rows["output tokens/s at saturation, kvattn-int8 / generate in batches of 32"]["value"] is None
    markdown = serve_markdown({**results, "targets": targets(results)})
    assert "90 output tokens in 2.0 s, 45.0 tok/s" in markdown and "unavailable: exit code 1: no" in markdown


def test_generate_batches_pad_the_last_batch_and_make_its_longest_output():
    requests = [{"prompt": [1, 2, 3], "max_tokens": 4}, {"prompt": [4], "max_tokens": 9},
                {"prompt": [5, 6], "max_tokens": 2}]
    (prompts, lengths, new, real), (last, last_lengths, last_new, last_real) = serve_generate.batches(requests, 2)
    assert prompts.tolist() == [[1, 2, 3], [4, 0, 0]] and lengths.tolist() == [3, 1] and (new, real) == (9, 2)
    assert last.tolist() == [[5, 6], [5, 6]] and last_lengths.tolist() == [2, 2] and (last_new, last_real) == (2, 1)


def test_generate_reference_times_the_fixture(tmp_path, capsys):
    requests = tmp_path / "requests.json"
    requests.write_text(json.dumps([{"prompt": [5, 17, 3], "max_tokens": 3}, {"prompt": [8, 2], "max_tokens": 2},
                                    {"prompt": [9], "max_tokens": 1}]))
    assert serve_generate.main(["--checkpoint", str(FIXTURES / "llama"), "--requests", str(requests), "--batch", "2",
                                "--max-len", "16"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["output_tokens"] == 6 and figures["batches"] == 2 and figures["seconds"] > 0


def test_targets_not_measured_without_transformers():
    results = _results()
    results["contenders"] = [row for row in results["contenders"] if row["contender"] != "transformers"]
    rows = targets(results)
    assert rows[0]["value"] is None and rows[0]["met"] is None


def test_agreement_with_the_first_contender():
    def row(name, texts):
        outcomes = [_outcome(i, chunk_s=[0.1], end_s=0.1) for i in range(len(texts))]
        for outcome, text in zip(outcomes, texts):
            outcome["text"] = text
        return {"contender": name, "rates": [{"rate": 1.0, "summary": {}, "requests": outcomes}]}

    rows = [{"contender": "down", "unavailable": "no"}, row("a", ["x", "y", "z"]), row("b", ["x", "y", "q"])]
    rows[2]["rates"][0]["requests"][1]["error"] = "HTTP 500: oops"  # not compared
    mark_agreement(rows)
    assert rows[1]["rates"][0]["summary"]["same_text"] == {"as": "a", "count": 3, "of": 3}
    assert rows[2]["rates"][0]["summary"]["same_text"] == {"as": "a", "count": 1, "of": 2}


def test_report_writes_markdown_json_and_plot(tmp_path):
    results = _results()
    results["contenders"].append({"contender": "broken", "unavailable": "exited with code 1 before it was ready"})
    markdown = serve_markdown(results)
    assert "| inf | kvattn | 1/0/0 |" in markdown and "`broken` unavailable" in markdown
    assert markdown.splitlines()[4].endswith("| — |") and markdown.splitlines()[5].endswith("| 1/1 |")
    assert "### Targets" in markdown
    write(tmp_path, "serve", json.loads(json.dumps(results, default=str)), markdown)
    plot_serve(results, tmp_path / "serve.png")
    assert (tmp_path / "serve.md").read_text() == markdown
    assert (tmp_path / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
