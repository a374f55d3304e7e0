"""`Server` on a paged model: equal to `generate` token for token, prefix hits, preemption, failures, compiles."""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvattn import generation, models, serving
from kvattn.generation import SamplingParams
from kvattn.paging import NULL_PAGE
from kvattn.serving import runner as serving_programs
from tests.helpers import FIXTURES, default_compile_env, expected

ROOT = Path(__file__).parents[2]


@functools.cache
def fixture_run(family: str):
    """Greedy generation on a tiny checkpoint: contiguous `generate`, and a Server on a tight paged pool."""
    want = expected(family)
    prompts, lengths = want["prompts"], want["lengths"]
    reference = models.from_pretrained(FIXTURES / family, max_len=48, batch_size=len(lengths))
    generated = np.asarray(generation.generate(reference, prompts, 12, lengths=lengths).tokens)
    model = models.from_pretrained(FIXTURES / family, max_len=48, batch_size=3, num_pages=10, page_size=4)
    server = serving.Server(model, chunk=8)
    requests = [prompts[row, :length] for row, length in enumerate(lengths)] * 2  # the repeats hit the cache
    for prompt in requests:
        server.submit(prompt, SamplingParams(max_tokens=12))
    completions = server.run()
    server.manager.check()
    return generated, completions, server


@pytest.mark.parametrize("family", ["llama", "mistral", "phi3"])  # phi3: longrope, chunks across its switch
def test_server_equals_generate_token_for_token(family):
    generated, completions, server = fixture_run(family)
    for completion in completions:
        np.testing.assert_array_equal(completion.tokens, generated[completion.request % len(generated)])
    if server.config.window is None:  # a window frees pages: nothing to share, and no shortage here
        assert sum(c.cached_tokens for c in completions) > 0, "the repeated prompts must hit the prefix cache"
        assert sum(c.preemptions for c in completions) > 0, "the pool is tight enough to preempt"


def check_prefix_hit_is_bit_identical() -> None:
    """A hit runs the very programs a cold run would on the positions it computes: the same bits.

    A roomy pool, so nothing is preempted: a preempted request recomputes its
    generated tokens as prompt chunks, other programs than the steps that
    first computed them, so only its tokens are promised
    (`test_server_equals_generate_token_for_token`).
    """
    want = expected("llama")
    model = models.from_pretrained(FIXTURES / "llama", max_len=48, batch_size=3, num_pages=40, page_size=4)
    server = serving.Server(model, chunk=8)
    prompts = [want["prompts"][row, :length] for row, length in enumerate(want["lengths"])]
    runs = []
    for _ in range(2):  # the second run hits the pages the first registered
        for prompt in prompts:
            server.submit(prompt, SamplingParams(max_tokens=12))
        runs.append(server.run())
    server.manager.check()
    cold, hits = runs
    assert any(hit.cached_tokens > 0 for hit in hits)
    assert not any(c.preemptions for c in cold + hits)
    for before, after in zip(cold, hits, strict=True):
        assert after.tokens == before.tokens
        assert after.logprobs == before.logprobs  # exact


def test_a_prefix_hit_is_bit_identical_to_a_cold_run():
    """Bit for bit as XLA compiles by default, so in a process of its own.

    The suite compiles with LLVM unoptimised (conftest.py); there a hit's last
    logprob differed from the cold run's in the sixth digit.
    """
    script = "from tests.serving.test_server import check_prefix_hit_is_bit_identical as c; c()"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=default_compile_env(),
                          cwd=ROOT, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_stop_token_or_a_single_new_token_ends_a_request_at_its_prefill():
    generated, _, server = fixture_run("llama")
    prompt = np.asarray(expected("llama")["prompts"][0, :5])
    server.submit(prompt, SamplingParams(max_tokens=1))
    server.submit(prompt, SamplingParams(max_tokens=8, stop_token_ids=(int(generated[0, 0]),)))
    for completion in server.run():
        assert completion.tokens == [int(generated[0, 0])]
    server.manager.check()


@pytest.mark.parametrize(("fails", "fails_at", "options"), [
    ("_decode_program", 3, {}),
    ("_prefill_program", 1, {}),  # the three prompts' chunks, in one call
    ("_mixed_program", 1, {"step_tokens": 7}),
    ("read", 6, {"async_scheduling": True}),  # a decode call dispatched ahead of the one being read
])
def test_a_failed_device_call_loses_no_request(monkeypatch, fails, fails_at, options):
    """A program consumes the pools, then fails (or its outputs fail to read): every request is recomputed and
    ends as if nothing failed."""
    generated, _, server = fixture_run("llama")
    for name, value in options.items():
        monkeypatch.setattr(server, name, value)
    want = expected("llama")
    where = server.runner if fails == "read" else serving_programs
    run, calls = getattr(where, fails), []

    def failing(*args, **kwargs):
        calls.append(1)
        result = run(*args, **kwargs)
        if len(calls) == fails_at:
            raise RuntimeError("device lost")
        return result

    monkeypatch.setattr(where, fails, failing)
    for row, length in enumerate(want["lengths"]):
        server.submit(want["prompts"][row, :length], SamplingParams(max_tokens=12))
    with pytest.raises(RuntimeError, match="device lost"):
        server.run()
    assert server.manager.num_live == 0 and len(server.scheduler.queue) == len(want["lengths"])
    completions = server.run()
    assert all(c.preemptions >= 1 for c in completions)
    for completion in completions:
        np.testing.assert_array_equal(completion.tokens, generated[completion.request - completions[0].request])
    server.manager.check()


def test_donated_pools_are_taken_without_a_copy_and_by_default_the_model_is_left_alone():
    """`donate_pools` hands the model's pools over (no second copy; the model's caches are gone after a step);
    without it the model's pools stay as they were. Both serve the same tokens."""
    import jax
    from flax import nnx

    want = expected("llama")
    prompt = want["prompts"][0, : want["lengths"][0]]
    tokens = {}
    for donate in (False, True):
        model = models.from_pretrained(FIXTURES / "llama", max_len=48, batch_size=3, num_pages=10, page_size=4)
        pools = jax.tree.leaves(nnx.state(model, nnx.Cache))
        server = serving.Server(model, chunk=8, donate_pools=donate)
        taken = jax.tree.leaves(server.runner._pools)
        assert all((a is b) == donate for a, b in zip(pools, taken, strict=True))
        server.submit(prompt, SamplingParams(max_tokens=6))
        [completion] = server.run()
        tokens[donate] = completion.tokens
        if donate:
            assert all(array.is_deleted() for array in pools)
        else:
            assert not any(array.is_deleted() for array in pools)
            assert all(not np.asarray(array).any() for array in pools)  # still the zeros the model was built with
    np.testing.assert_array_equal(tokens[True], tokens[False])


def test_serving_compiles_once_over_many_admissions():
    """`warm_up` compiles every program: a decode call and a mixed one per bucket of rows (1, 2, 3 here), and the
    prefill chunk."""
    _, _, server = fixture_run("llama")
    server.warm_up()
    programs = (serving_programs._prefill_program, serving_programs._decode_program, serving_programs._mixed_program)
    before = tuple(program._cache_size() for program in programs)
    rng = np.random.default_rng(0)
    for _ in range(8):
        server.submit(rng.integers(0, 64, rng.integers(1, 20)),
                      SamplingParams(max_tokens=int(rng.integers(1, 6))))
    assert len(server.run()) == 8
    server.manager.check()
    assert tuple(program._cache_size() for program in programs) == before


def test_a_chunk_beside_running_requests_shares_their_decode_call(monkeypatch):
    """With a budget of a whole chunk beside the rows: while one request decodes, another's two prompt chunks
    each ride in its decode call (one device call a step, `Runner.mixed`); both streams equal `generate`'s."""
    generated, _, server = fixture_run("llama")
    monkeypatch.setattr(server, "step_tokens", server.config.cache.batch_size + server.chunk)
    want = expected("llama")
    calls = []
    for name in ("prefill", "decode", "mixed", "verify"):
        method = getattr(server.runner, name)
        monkeypatch.setattr(server.runner, name, lambda *a, name=name, method=method: calls.append(name) or method(*a))
    salt = b"no hits on what earlier tests left in the prefix cache"
    first = server.submit(want["prompts"][0, : want["lengths"][0]], SamplingParams(max_tokens=12), salt=salt)
    server.step()
    assert calls == ["prefill", "decode"]  # nothing else running: its chunk alone, then its first decode step
    assert want["lengths"][1] > server.chunk  # two chunks
    server.submit(want["prompts"][1, : want["lengths"][1]], SamplingParams(max_tokens=12), salt=salt)
    for _ in range(2):
        calls.clear()
        server.step()
        assert calls == ["mixed"]
    completions = server.run()
    assert [c.request for c in completions] == [first, first + 1]
    for row, completion in enumerate(completions):
        np.testing.assert_array_equal(completion.tokens, generated[row])
    server.manager.check()


def test_step_tokens_bound_every_decoding_step_to_one_call_of_that_many_tokens(monkeypatch):
    """`step_tokens=5` on three sequences: while anything decodes, a step is one call, its decode bucket's rows
    plus a chunk of the rest (4, 3 or 2 tokens); alone, a prompt still gets whole chunks. Greedy as `generate`."""
    generated, _, server = fixture_run("llama")
    want = expected("llama")
    model = models.from_pretrained(FIXTURES / "llama", max_len=48, batch_size=3, num_pages=10, page_size=4)
    with pytest.raises(ValueError, match="step_tokens must exceed the batch size 3"):
        serving.Server(model, chunk=8, step_tokens=3)
    with pytest.raises(ValueError, match="not offered together"):
        serving.Server(model, chunk=8, step_tokens=5, speculative=generation.PromptLookup(num_tokens=3))
    calls = []  # each call, with the shape of the chunk it carries
    for name, chunk in (("prefill", 0), ("decode", None), ("mixed", 2)):
        method = getattr(server.runner, name)
        monkeypatch.setattr(server.runner, name, lambda *a, name=name, method=method, chunk=chunk: calls.append(
            (name, *(() if chunk is None else np.shape(a[chunk])))) or method(*a))
    monkeypatch.setattr(server, "step_tokens", 5)
    salt = b"no hits on what earlier tests left in the prefix cache"
    first = server.submit(want["prompts"][0, : want["lengths"][0]], SamplingParams(max_tokens=12), salt=salt)
    done = server.step()
    assert calls == [("prefill", 1, server.chunk), ("decode",)]  # nothing decoding: a whole chunk
    for row in (1, 2):
        server.submit(want["prompts"][row, : want["lengths"][row]], SamplingParams(max_tokens=12), salt=salt)
    mixed = 0
    while not server.idle:
        calls.clear()
        decoding = len(server.scheduler.decoding())
        done += server.step()
        if decoding:
            assert len(calls) == 1, calls
            if calls[0][0] == "mixed":
                mixed += 1
                assert calls[0][1:] == (1, 5 - min(1 << (decoding - 1).bit_length(), 3))
    assert mixed >= 4  # prompts of 9 and 3 tokens, in pieces of at most 3
    server.manager.check()
    assert [c.request for c in done] == [first, first + 1, first + 2]
    for row, completion in enumerate(done):
        np.testing.assert_array_equal(completion.tokens, generated[row])


def test_server_refuses_what_can_never_fit():
    _, _, server = fixture_run("llama")
    with pytest.raises(ValueError, match="can never fit"):
        server.submit([1] * 40, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="token ids"):
        server.submit([], SamplingParams(max_tokens=3))


def test_a_windowed_server_counts_the_pages_a_whole_chunk_needs():
    """With a window, prefill writes a chunk at once beside the window: that many pages, not one token's worth."""
    model = models.from_pretrained(FIXTURES / "mistral", max_len=48, batch_size=2, num_pages=10, page_size=4)
    server = serving.Server(model, chunk=32)  # window 8: a 32-token chunk spans up to 11 pages, the pool has 9
    with pytest.raises(ValueError, match="can never fit"):
        server.submit(list(range(1, 41)), SamplingParams(max_tokens=1))
    server.submit(list(range(1, 9)), SamplingParams(max_tokens=1))  # an 8-token chunk fits


def test_n_choices_share_the_prompt_pages_and_each_samples_its_own_stream():
    _, _, server = fixture_run("llama")
    prompt = list(expected("llama")["prompts"][1, :7])  # one chunk: a full page of 4 and a partial one
    live = []
    first = server.submit(prompt, SamplingParams(max_tokens=3, n=3, temperature=1.0, seed=5),
                          on_token=lambda index, token: live.append(server.manager.num_live))
    completions = server.run()
    # Admitted together, the prompt prefilled once and forked: the choices map the leader's two pages. Then each
    # writes its first token: two take a private copy of the shared partial page, the last writes it in place.
    assert live[:6] == [2, 2, 2, 4, 4, 4]
    assert [c.request for c in completions] == [first, first + 1, first + 2]
    assert len({tuple(c.tokens) for c in completions}) > 1, "three streams of one seed differ"
    server.manager.check()
    again = server.submit(prompt, SamplingParams(max_tokens=3, n=3, temperature=1.0, seed=5))
    assert [c.tokens for c in server.run()] == [c.tokens for c in completions], "a seed reproduces its choices"
    assert again == first + 3


def test_abort_frees_pages_at_once_and_streams_every_token(monkeypatch):
    _, _, server = fixture_run("llama")
    seen = []
    running = server.submit(list(range(1, 12)), SamplingParams(max_tokens=12),
                            on_token=lambda i, token: seen.append((i, token.id)))
    queued = [server.submit([1, 2, 3], SamplingParams(max_tokens=12)) for _ in range(4)]  # three sequences: the last two wait
    server.step()
    server.step()
    assert server.stats.running == 3 and server.stats.waiting == 2 and len(seen) == 2
    aborted = server.abort(running)
    assert aborted.finish_reason == "abort" and aborted.tokens == [t for _, t in seen]
    assert server.abort(queued[-1]).tokens == [] and server.abort(running) is None
    assert server.stats.running == 2 and server.stats.waiting == 1
    server.manager.check()
    done = server.run()
    assert [c.request for c in done] == queued[:3] and all(c.finish_reason == "length" for c in done)
    assert server.manager.num_live == 0
    server.manager.check()


def test_per_request_sampling_and_top_logprobs():
    _, _, server = fixture_run("llama")
    tokens = []
    server.submit([5, 6, 7], SamplingParams(max_tokens=4, logprobs=3), on_token=lambda i, token: tokens.append(token))
    server.submit([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.7, top_k=2, seed=1))
    greedy, _ = server.run()
    assert [t.id for t in tokens] == greedy.tokens
    for token in tokens:
        assert len(token.top) == 3 and token.top[0][0] == token.id and token.top[0][1] == token.logprob
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(max_tokens=2, seed=-1)
    with pytest.raises(ValueError, match="n must be at most"):
        server.submit([1], SamplingParams(max_tokens=2, n=4))
    with pytest.raises(TypeError, match="params must be a kvattn.generation.SamplingParams, got int"):
        server.submit([1], 2)


def test_the_engine_thread_survives_a_failed_step_and_reports_one_that_keeps_failing(monkeypatch):
    """What `kvattn serve` sees: one failure costs no request; `max_failures` in a row end the held ones with errors."""
    import asyncio

    from kvattn.serving.engine import Engine

    generated, _, server = fixture_run("llama")
    want = expected("llama")
    prompts = [want["prompts"][row, :length] for row, length in enumerate(want["lengths"])]
    decode, calls, errors, broken = serving_programs._decode_program, [], [], []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3 or broken:
            raise RuntimeError("device lost")
        return decode(*args, **kwargs)

    monkeypatch.setattr(serving_programs, "_decode_program", failing)
    engine = Engine(server, max_failures=3, on_error=errors.append)

    async def run(new_tokens):
        handles = [await engine.submit(prompt, SamplingParams(max_tokens=new_tokens)) for prompt in prompts]
        outcomes = []
        for handle in handles:
            while (event := await asyncio.wait_for(handle.events.get(), timeout=60))[0] == "token":
                pass
            outcomes.append(event)
        return outcomes

    engine.start()
    try:
        outcomes = asyncio.run(run(12))
        assert [event[0] for event in outcomes] == ["done"] * 3 and len(errors) == 1
        for row, event in enumerate(outcomes):
            np.testing.assert_array_equal(event[2].tokens, generated[row])
        broken.append(True)  # from now on, every decode step fails
        outcomes = asyncio.run(run(12))
        assert [event[0] for event in outcomes] == ["error"] * 3 and "device failed 3 times" in outcomes[0][2]
    finally:
        engine.stop()
    assert server.idle
    server.manager.check()


def test_a_burst_that_reaches_an_idle_engine_starts_in_one_step_when_it_may_wait_for_it():
    """`burst_gap_s`: the first request waits while others keep arriving, each within the gap of the one before,
    or while the HTTP side holds some on their way (`arriving`), until they fill every sequence; then the first
    step runs them together. Without a gap it runs alone."""
    import asyncio

    from kvattn.serving.engine import Engine

    _, _, server = fixture_run("llama")

    def first_step(gap: float, pauses: list[float], on_the_way: bool = False):
        """The `Stats` after the first step when a request arrives after each pause (on its way meanwhile, if
        `on_the_way`), and the seconds it all took."""
        steps = []
        engine = Engine(server, burst_gap_s=gap, on_step=steps.append)

        async def arrive(i: int, pause: float):
            with engine.arriving() if on_the_way else contextlib.nullcontext():
                await asyncio.sleep(pause)
                return await engine.submit([1, 2, 3 + i], SamplingParams(max_tokens=4))

        async def run():
            handles = [await arrive(0, pauses[0])]
            later = [asyncio.create_task(arrive(i, sum(pauses[1 : i + 1]))) for i in range(1, len(pauses))]
            handles += [await task for task in later]
            for handle in handles:
                while (event := await asyncio.wait_for(handle.events.get(), timeout=60))[0] == "token":
                    pass
                assert event[0] == "done" and len(event[2].tokens) == 4

        engine.start()
        try:
            start = time.monotonic()
            asyncio.run(run())
            took = time.monotonic() - start
        finally:
            engine.stop()
        return steps[0], took

    # 0.3 s: far longer than a step of this model, far shorter than the gap
    together, took = first_step(gap=30.0, pauses=[0, 0.3, 0])
    assert (together.running, together.waiting) == (3, 0)
    assert took < 15, "three requests fill the server's three sequences: the wait ends then, not a gap later"
    two, _ = first_step(gap=1.0, pauses=[0, 0.3, 2.0])  # the third comes a second after the wait ended
    assert (two.running, two.waiting) == (2, 0)
    alone, _ = first_step(gap=0.1, pauses=[0, 0.3, 0])  # the others come after the gap: not waited for
    assert alone.running == 1
    on_the_way, _ = first_step(gap=0.1, pauses=[0, 0.3, 0], on_the_way=True)  # the same, but on their way
    assert on_the_way.running == 3
    assert server.idle
    server.manager.check()


def test_a_run_that_fails_midway_loses_no_request_that_had_finished(monkeypatch):
    """A request finished in an early step of a `run()` whose later device call raises comes out of the next run."""
    _, _, server = fixture_run("llama")
    decode, calls = serving_programs._decode_program, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return decode(*args, **kwargs)

    monkeypatch.setattr(serving_programs, "_decode_program", failing)
    indices = [server.submit([1, 2, 3 + i], SamplingParams(max_tokens=new)) for i, new in enumerate((1, 2, 8))]
    with pytest.raises(RuntimeError, match="device lost"):
        server.run()  # the first two finished before the third decode step failed
    done = server.run()
    assert [c.request for c in done] == indices and [len(c.tokens) for c in done] == [1, 2, 8]
    server.manager.check()


def test_prefills_per_step_bounds_the_prefill_chunks_of_a_step_while_requests_decode_oldest_first():
    _, _, server = fixture_run("llama")
    server.prefills_per_step = 1
    try:
        seen = []
        a = server.submit([1, 2, 3], SamplingParams(max_tokens=4), on_token=lambda index, token: seen.append(index))
        done = server.step()  # nothing decoding: its prompt, then its first decode step
        b, c = (server.submit(prompt, SamplingParams(max_tokens=3), on_token=lambda index, token: seen.append(index))
                for prompt in ([4, 5, 6], [7, 8, 9]))
        done += server.step()
        assert set(seen) == {a, b}  # a decodes: one prompt prefilled beside it
        done += server.step()
        assert set(seen) == {a, b, c}
        assert sorted(completion.request for completion in done + server.run()) == [a, b, c]
        seen.clear()
        d, e = (server.submit(prompt, SamplingParams(max_tokens=2), on_token=lambda index, token: seen.append(index))
                for prompt in ([1, 5, 9], [2, 6, 7]))
        server.step()
        assert set(seen) == {d, e}  # nothing decoding: both prompts in the first step, whatever the bound
        server.run()
    finally:
        server.prefills_per_step = server.config.batch_size


def test_prompts_that_arrive_together_are_prefilled_in_one_call_and_start_together(monkeypatch):
    """Three one-choice prompts admitted together: each step's chunks in one call (a bucket of three rows), and
    the two prompts of one chunk get their first tokens from the first call, together; a request of two choices
    is prefilled alone (both sample from its one sequence). Greedy, every stream equals `generate`'s."""
    generated, _, server = fixture_run("llama")
    want = expected("llama")
    calls = []  # each prefill call: its chunks' shape and its sampling rows
    method = server.runner.prefills
    monkeypatch.setattr(server.runner, "prefills", lambda *a: calls.append(
        (np.shape(a[0]), np.shape(a[5].seed))) or method(*a))
    salt = b"no hits on what earlier tests left in the prefix cache"
    rows = range(len(want["lengths"]))
    assert [want["lengths"][row] <= server.chunk for row in rows] == [True, False, True]
    indices = [server.submit(want["prompts"][row, : want["lengths"][row]], SamplingParams(max_tokens=12), salt=salt)
               for row in rows]
    server.step()
    assert calls == [((3, server.chunk), (3,))]  # a row each
    generated_now = {request.index: len(request.generated) for request in server.scheduler.seqs}
    assert generated_now == {indices[0]: 2, indices[1]: 0, indices[2]: 2}  # a first token, then a decode step
    for completion in server.run():
        np.testing.assert_array_equal(completion.tokens, generated[indices.index(completion.request)])
    calls.clear()
    server.submit(want["prompts"][0, : want["lengths"][0]], SamplingParams(max_tokens=3, n=2), salt=salt + b"2")
    server.step()
    assert calls == [((1, server.chunk), (server.config.cache.batch_size,))]  # its choices' rows, padded
    server.run()
    server.manager.check()


# ------------------------------------------------------------- speculative decoding

NEW = 12


@functools.cache
def speculative_run():
    """Greedy prompt lookup on the llama fixture, on the pool of `fixture_run` (its programs are shared).

    Each prompt runs alone and followed by the first 8 tokens of its greedy continuation, whose output is the
    rest of that continuation; one request stops at a token its output holds. The pool preempts.
    """
    want = expected("llama")
    rows = [list(want["prompts"][row, :length]) for row, length in enumerate(want["lengths"])]
    greedy = want["greedy"]
    prompts = rows + [row + greedy[i, :8].tolist() for i, row in enumerate(rows)]
    plain = np.concatenate([greedy[:, :NEW], greedy[:, 8 : 8 + NEW]])
    model = models.from_pretrained(FIXTURES / "llama", max_len=48, batch_size=3, num_pages=10, page_size=4)
    server = serving.Server(model, chunk=8, speculative=generation.PromptLookup(num_tokens=3))
    server.warm_up()
    streamed = {}
    on_token = lambda index, token: streamed.setdefault(index, []).append(token)
    for prompt in prompts:
        server.submit(prompt, SamplingParams(max_tokens=NEW, logprobs=2), on_token=on_token)
    stop = int(plain[1, 9])
    server.submit(rows[1], SamplingParams(max_tokens=NEW, stop_token_ids=(stop,), logprobs=2),
                  on_token=on_token)
    completions = server.run()
    server.manager.check()
    return plain, stop, completions, streamed, server


def test_speculative_server_equals_plain_greedy_decoding_token_for_token():
    plain, stop, completions, streamed, server = speculative_run()
    *whole, stopped = completions
    for completion in whole:
        assert completion.tokens == plain[completion.request].tolist(), completion.request
    first = plain[1].tolist().index(stop)
    assert stopped.tokens == plain[1, : first + 1].tolist() and stopped.finish_reason == "stop"
    stats = server.stats
    # Rounds ran, kept drafts and refused some; every token arrived once, in order, with its log-probability.
    assert 0 < stats.accepted_tokens < stats.drafted_tokens
    assert stats.generated_tokens >= sum(len(c.tokens) for c in completions)
    assert sum(c.preemptions for c in completions) > 0, "the pool is tight enough to preempt"
    for completion in completions:
        tokens = streamed[completion.request]
        assert [t.id for t in tokens] == completion.tokens
        assert [t.logprob for t in tokens] == completion.logprobs
        assert all(t.top[0][0] == t.id for t in tokens)  # greedy: the most likely token
    assert server.manager.num_live == 0


def test_speculative_rounds_give_back_the_pages_of_refused_drafts_and_compile_nothing_new():
    _, _, _, _, server = speculative_run()
    before = serving_programs._verify_program._cache_size()
    server.submit([3, 4, 5, 3, 4, 5, 3, 4], SamplingParams(max_tokens=12))
    held = []
    while not server.idle:
        server.step()
        held.append((server.manager.num_live, int(server.manager.pos.sum())))
    server.manager.check()
    # After each round the sequence holds what it kept, in whole pages: never a refused draft's page.
    assert all(pages == -(-length // 4) for pages, length in held[:-1]) and held[-1] == (0, 0)
    assert serving_programs._verify_program._cache_size() == before


def test_a_seed_reproduces_under_speculative_sampling():
    _, _, _, _, server = speculative_run()
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_k=8, seed=seed) for seed in (1, 2)]
    first = [server.submit([3, 4, 5, 3, 4, 5, 3], p) for p in params]
    runs = [c.tokens for c in server.run()]
    server.submit([9, 9, 9], SamplingParams(max_tokens=6))  # other traffic
    second = [server.submit([3, 4, 5, 3, 4, 5, 3], p) for p in params]
    again = {c.request: c.tokens for c in server.run()}
    assert [again[i] for i in second] == runs and runs[0] != runs[1]
    assert second[0] > first[1]


def test_speculative_server_settings_are_checked():
    model = models.from_pretrained(FIXTURES / "llama", max_len=16, batch_size=1, num_pages=5, page_size=4)
    with pytest.raises(TypeError, match="a DraftModel drafts in kvattn.generation.generate"):
        serving.Server(model, speculative=generation.DraftModel(
            models.from_pretrained(FIXTURES / "llama", max_len=16), num_tokens=2))
    with pytest.raises(TypeError, match="PromptLookup or None, got int"):
        serving.Server(model, speculative=4)
    windowed = models.from_pretrained(FIXTURES / "mistral", max_len=16, batch_size=1, num_pages=5, page_size=4)
    with pytest.raises(ValueError, match=r"sliding window \(8\), a speculative round of num_tokens \+ 1 = 9 "
                                         r"tokens must fit in a chunk of 8"):
        serving.Server(windowed, chunk=8, speculative=generation.PromptLookup(8))


def test_a_sliding_window_server_speculates_and_equals_plain_greedy_decoding():
    """Mistral's window of 8 over pages of 4: each round releases the pages behind its first position, a refused
    draft gives back only pages past what was kept, and the tokens are plain greedy decoding's (transformers')."""
    want = expected("mistral")
    rows = [list(want["prompts"][row, :length]) for row, length in enumerate(want["lengths"])]
    greedy = want["greedy"]
    prompts = rows + [row + greedy[i, :8].tolist() for i, row in enumerate(rows)]  # each past the window
    plain = np.concatenate([greedy[:, :NEW], greedy[:, 8 : 8 + NEW]])
    model = models.from_pretrained(FIXTURES / "mistral", max_len=48, batch_size=3, num_pages=10, page_size=4)
    server = serving.Server(model, chunk=8, speculative=generation.PromptLookup(num_tokens=3))
    for prompt in prompts:
        server.submit(prompt, SamplingParams(max_tokens=NEW))
    completions, mapped, deepest = [], 0, 0
    while not server.idle:
        completions += server.step()
        manager = server.manager
        manager.check()
        mapped = max(mapped, *(np.count_nonzero(manager.tables[s] != NULL_PAGE) for s in range(3)))
        deepest = max(deepest, int(manager.pos.max()))
    assert sorted(c.request for c in completions) == list(range(len(prompts)))
    for completion in completions:
        assert completion.tokens == plain[completion.request].tolist(), completion.request
    assert 0 < server.stats.accepted_tokens <= server.stats.drafted_tokens
    # Sequences 27 tokens deep (7 pages) held at most the window's 8 tokens and a round's 4 past them.
    assert deepest >= 27 and mapped <= 4


# ------------------------------------------------------------- overlapped steps


def test_overlapped_steps_give_the_tokens_of_steps_in_turn():
    """`overlap=True` dispatches each decode call before reading the one ahead: the same tokens and
    log-probabilities (greedy, sampled with seeds, a stop token inside), requests arriving mid-run, a tight pool."""
    want = expected("llama")
    prompts = [list(want["prompts"][row, :length]) for row, length in enumerate(want["lengths"])]
    stop = int(want["greedy"][1, 5])
    requests = [(prompts[0], SamplingParams(max_tokens=20)),
                (prompts[1], SamplingParams(max_tokens=12, stop_token_ids=(stop,))),
                (prompts[2], SamplingParams(max_tokens=16, temperature=1.0, seed=3)),
                (prompts[0] + prompts[2], SamplingParams(max_tokens=10, temperature=0.8, top_k=5, seed=4, logprobs=2))]
    results, events = {}, {}
    for overlap in (False, True):
        model = models.from_pretrained(FIXTURES / "llama", max_len=48, batch_size=3, num_pages=10, page_size=4)
        server = serving.Server(model, chunk=8, async_scheduling=overlap)
        runner = server.runner
        for name in ("dispatch_decode", "read"):
            call = getattr(runner, name)
            setattr(runner, name, lambda *args, _call=call, _name=name, _run=events.setdefault(overlap, []):
                    _run.append(_name) or _call(*args))
        streamed = {}
        on_token = lambda index, token: streamed.setdefault(index, []).append(token)
        first = [server.submit(p, params, on_token=on_token) for p, params in requests[:3]]
        done, steps = [], 0
        while not server.idle:
            done += server.step()
            steps += 1
            if steps == 3:  # one more arrives while calls run ahead
                first.append(server.submit(*requests[3][:1], requests[3][1], on_token=on_token))
            server.manager.check()
        ended = {c.request - first[0]: (c.tokens, c.logprobs, c.finish_reason) for c in done}
        results[overlap] = ended, {i - first[0]: [(t.id, t.logprob, t.top) for t in got] for i, got in streamed.items()}
        assert server.manager.num_live == 0
    assert results[True] == results[False]
    assert results[True][0][1][2] == "stop" and results[True][0][1][0][-1] == stop
    # Overlapped, decode calls are dispatched while the one before is ahead, not yet read; in turn, never.
    ahead = {overlap: sum(a == b == "dispatch_decode" for a, b in zip(run, run[1:])) for overlap, run in events.items()}
    assert ahead[False] == 0 and ahead[True] >= 4, ahead  # the pool is tight: most steps preempt or admit

