"""Speculative decoding: the tokens of plain greedy decoding, the distribution of plain sampling, in fewer calls.

Greedy runs are held to transformers' greedy continuations on the committed
fixtures (which `generate` equals token for token, see
test_hf_equivalence.py), with ragged prompts and a stop token inside the
batch. Sampled runs are held to the exact distribution of plain sampling by
a chi-square test over thousands of sequences decoded in one call, and the
same test refuses a wrong acceptance rule. Every compiled program serves
several tests (module-scope fixtures), to keep the file fast.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx
from hypothesis import given, settings, strategies as st

from kvattn import generation, models
from kvattn.errors import CacheOverflowError
from kvattn.generation import speculation, speculative
from kvattn.generation.sampling import RowSampling, sample_rows
from kvattn.models.model_config import ModelConfig
from kvattn.rotary import RoPE
from tests.helpers import FIXTURES, expected

NEW = 32  # the fixtures' greedy continuations are 32 tokens long


def stop_token(want) -> int:
    """A token the middle sequence first produces midway and another sequence never: a stop inside the batch."""
    greedy = want["greedy"]
    return int(next(token for index, token in enumerate(greedy[1]) if index >= 6 and token not in greedy[1, :index]
                    and (token not in greedy[0] or token not in greedy[2])))


def with_stop(greedy, stop):
    """What generate returns for `greedy` continuations cut at `stop`: tokens, counts, and who stopped."""
    tokens, counts, stopped = np.zeros_like(greedy), [], []
    for row, sequence in enumerate(greedy):
        hits = np.flatnonzero(sequence == stop)
        count = int(hits[0]) + 1 if hits.size else len(sequence)
        tokens[row, :count] = sequence[:count]
        counts.append(count)
        stopped.append(bool(hits.size))
    return tokens, np.array(counts), np.array(stopped)


# Each family is decoded by one drafter, a compiled program each (the suite's time is short).
DRAFTERS = {
    "gpt2": lambda family: generation.PromptLookup(num_tokens=3),
    # longrope, with the long factors (its prompts pass the switch).
    "phi3": lambda family: generation.PromptLookup(num_tokens=2, max_ngram=1),
    "qwen3": lambda family: generation.PromptLookup(num_tokens=4, max_ngram=2),
    # The target in bfloat16: most drafts kept, at half the bytes, so rounds pay.
    "llama": lambda family: generation.DraftModel(load(family, dtype=jnp.bfloat16), num_tokens=4),
    # Sliding-window rings (of 8, far shorter than the 64 slots) beside full layers, with room to roll
    # refused drafts back (the layer's tests hold a ring's roll-back to the float64 reference).
    "gemma3_text": lambda family: generation.PromptLookup(num_tokens=4, max_ngram=2),
}
# What a family's target needs beyond `load`'s defaults: its rings' spare slots, one fewer than its drafts.
TARGETS = {"gemma3_text": {"spare_slots": 3}}


def load(family, **options):
    return models.from_pretrained(FIXTURES / family, **{"max_len": 64, "batch_size": 3, **options})


@pytest.fixture(scope="module", params=sorted(DRAFTERS))
def decoded(request):
    """Each family's fixture prompts decoded greedily with a stop token: (family, model, drafter, want, result)."""
    family = request.param
    want = expected(family)
    model, drafter = load(family, **TARGETS.get(family, {})), DRAFTERS[family](family)
    result = generation.speculate(model, want["prompts"], NEW, lengths=want["lengths"], speculative=drafter,
                              stop_tokens=(stop_token(want),))
    return family, model, drafter, want, result


def test_greedy_output_is_plain_greedy_decoding_token_for_token(decoded):
    family, model, _, want, result = decoded
    tokens, counts, stopped = with_stop(want["greedy"], stop_token(want))
    np.testing.assert_array_equal(np.asarray(result.tokens), tokens, err_msg=family)
    np.testing.assert_array_equal(np.asarray(result.counts), counts)
    assert stopped.any() and not stopped.all()  # the stop ends one sequence inside the batch, not all
    # The caches hold what generate leaves: the prompt and every token up to, not including, a stop token.
    np.testing.assert_array_equal(np.asarray(model.pos), want["lengths"] + counts - stopped)
    assert int(result.rounds) > 0


def test_generate_takes_the_same_option_and_returns_the_same_tokens(decoded):
    _, model, drafter, want, result = decoded
    model.reset()
    if isinstance(drafter, generation.DraftModel):
        drafter.draft.reset()
    again = generation.generate(model, want["prompts"], NEW, lengths=want["lengths"], speculative=drafter,
                            stop_tokens=(stop_token(want),))
    assert isinstance(again, generation.Generated)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(result.tokens))
    np.testing.assert_array_equal(np.asarray(again.counts), np.asarray(result.counts))


def test_rejected_drafts_leave_no_trace_in_any_cache(decoded):
    """Every cache holds zeros past its tokens; the llama target's holds what a prefill of them writes."""
    family, model, drafter, want, _ = decoded
    tokens, counts, stopped = with_stop(want["greedy"], stop_token(want))
    held = want["lengths"] + counts - stopped
    caches = [(model, held)]
    if isinstance(drafter, generation.DraftModel):
        draft_held = np.asarray(drafter.draft.pos)
        assert (draft_held <= held).all() and (draft_held > want["lengths"]).all()
        caches.append((drafter.draft, draft_held))
    fresh = None
    if family == "llama":  # one family suffices for the contents
        sequences = np.zeros((3, int(held.max())), np.int32)
        for row, length in enumerate(want["lengths"]):
            sequences[row, :length] = want["prompts"][row, :length]
            sequences[row, length : held[row]] = tokens[row, : held[row] - length]
        graphdef, params, empty = nnx.split(load(family), nnx.Param, nnx.Cache)

        @jax.jit  # one program rather than many small ones
        def prefill(params, empty, sequences, lengths):
            fresh = nnx.merge(graphdef, params, empty)
            fresh.prefill(sequences, lengths)
            return nnx.state(fresh, nnx.Cache)

        fresh = nnx.merge(graphdef, params, prefill(params, empty, jnp.asarray(sequences), jnp.asarray(held)))
    for holder, pos in caches:
        for index, block in enumerate(holder.blocks):
            for name in ("k_cache", "v_cache"):
                got = np.asarray(getattr(block.attention, name)[...], np.float32)
                inside = np.arange(got.shape[2])[None, None, :, None] < pos[:, None, None, None]  # (B, K, S, H)
                assert not np.where(inside, 0, got).any(), (family, name)
                if fresh is not None and holder is model:
                    reference = np.asarray(getattr(fresh.blocks[index].attention, name)[...])
                    np.testing.assert_allclose(np.where(inside, got, 0), np.where(inside, reference, 0),
                                               rtol=0, atol=1e-5 * np.abs(reference).max())


def test_rounds_adapt_to_how_many_drafts_are_kept(decoded):
    """A draft that always agrees runs rounds of K + 1 tokens; drafts that miss fall back to plain steps."""
    family, _, _, _, result = decoded
    drafted, accepted = np.asarray(result.drafted), np.asarray(result.accepted)
    assert (accepted <= drafted).all()
    if family == "llama":  # a bfloat16 copy of the target agrees mostly, at half the cost of a step
        assert result.acceptance > 0.5 and accepted.sum() > int(result.steps)  # rounds made most tokens
    else:  # copies these random models rarely make
        assert result.acceptance < 0.5 and int(result.steps) > int(result.rounds)


def test_one_program_serves_a_prompt_bucket_whatever_is_accepted(decoded):
    family, model, drafter, want, _ = decoded
    if family != "gpt2":
        pytest.skip("one family suffices")
    compiled = speculative._program._cache_size()
    rng = np.random.default_rng(0)
    for width in (10, 13, 16):  # other prompt widths in the fixture's bucket of 16, other tokens and acceptance
        model.reset()
        prompts = rng.integers(0, 97, (3, width))
        generation.speculate(model, prompts, NEW, speculative=drafter, stop_tokens=(stop_token(want),))
    repeating = np.tile(want["greedy"][:, :6], 2)  # copies for prompt lookup to find
    model.reset()
    generation.speculate(model, repeating, NEW, speculative=drafter, stop_tokens=(stop_token(want),))
    assert speculative._program._cache_size() == compiled


# ------------------------------------------------------------------- the pieces


def test_lookup_copies_what_followed_the_longest_matching_suffix():
    history = jnp.array([
        [5, 1, 2, 3, 4, 9, 2, 3, 7, 8, 1, 2, 3, 0, 0],  # "1 2 3" seen before: 4 9 2 3 follow
        [1, 2, 6, 1, 2, 6, 1, 2, 0, 0, 0, 0, 0, 0, 0],  # "6 1 2" once before, then a loop of 3: 6 1 2 6
        [7, 8, 9, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # no earlier 4: nothing drafted
        [3, 3, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # "3 3 3" before, one 3 after: a loop of one
        [4, 5, 6, 7, 8, 9, 4, 1, 4, 0, 0, 0, 0, 0, 0],  # the latest 4, not the one a long run follows
    ])
    filled = jnp.array([12, 7, 3, 3, 8])
    lookup = jax.jit(speculation.lookup, static_argnames=("num_tokens", "max_ngram"))
    drafts, widths = lookup(history, filled, num_tokens=4, max_ngram=3)
    assert widths.tolist() == [4, 4, 0, 4, 4]
    assert drafts.tolist() == [[4, 9, 2, 3], [6, 1, 2, 6], [0, 0, 0, 0], [3, 3, 3, 3], [1, 4, 1, 4]]
    drafts, widths = lookup(history, filled, num_tokens=2, max_ngram=1)
    # With one-token suffixes: after the latest 3 of the first sequence came 7 8, not 4 9.
    assert drafts.tolist() == [[7, 8], [6, 1], [0, 0], [3, 3], [1, 4]] and widths.tolist() == [2, 2, 0, 2, 2]


def reference_lookup(tokens: np.ndarray, num_tokens: int, max_ngram: int) -> list[int]:
    """Prompt lookup written as its definition: try suffixes longest first, take the latest earlier occurrence."""
    for size in range(min(max_ngram, tokens.size - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], size)  # each with a token after it
        hits = np.flatnonzero((windows == tokens[-size:]).all(axis=1))
        if hits.size:
            start = hits[-1] + size
            return tokens[start + np.arange(num_tokens) % (tokens.size - start)].tolist()
    return []


@settings(max_examples=30)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=16), min_size=1, max_size=3), st.integers(1, 4),
       st.sampled_from([1, 2, 3, 40, 10**9]))
def test_lookup_drafts_what_its_definition_drafts_for_any_max_ngram(rows, num_tokens, max_ngram):
    """Every row of a batch, against `reference_lookup`; a `max_ngram` past the history is as good as its length."""
    history = jnp.asarray(np.stack([np.pad(tokens, (0, 16 - len(tokens))) for tokens in rows]))
    filled = jnp.array([len(tokens) - 1 for tokens in rows])
    drafts, widths = LOOKUP(history, filled, num_tokens=num_tokens, max_ngram=max_ngram)
    for row, tokens in enumerate(rows):
        want = reference_lookup(np.array(tokens), num_tokens, max_ngram)
        assert np.asarray(drafts)[row, : int(widths[row])].tolist() == want
        assert int(widths[row]) in (0, num_tokens) and (int(widths[row]) == 0) == (not want)


LOOKUP = jax.jit(speculation.lookup, static_argnames=("num_tokens", "max_ngram"))


def test_lookup_traces_once_whatever_max_ngram():
    """The suffix lengths are a loop, not an unrolled program: a huge `max_ngram` costs what the history allows."""
    history, filled = jnp.zeros((2, 240), jnp.int32), jnp.array([239, 100])
    jaxpr = str(jax.make_jaxpr(lambda h, f: speculation.lookup(h, f, 4, 3))(history, filled)).splitlines()
    longer = str(jax.make_jaxpr(lambda h, f: speculation.lookup(h, f, 4, 200))(history, filled)).splitlines()
    assert len(longer) == len(jaxpr)  # the same equations: the bound is a constant of one loop
    drafts, widths = LOOKUP(history, filled, num_tokens=4, max_ngram=10**9)
    assert widths.tolist() == [4, 4] and drafts.tolist() == [[0] * 4] * 2


def test_verify_rows_without_drafts_samples_as_sample_rows():
    logits = jnp.asarray(np.random.default_rng(5).standard_normal((6, 3, VOCAB)).astype(np.float32))
    settings = RowSampling.of([(generation.Sampling(t, top_k=k), s, 1, 4, top) for t, k, s, top in
                               [(0.0, None, 0, 0), (1.0, None, 1, 5), (0.7, 3, 2, 0), (1.3, None, 3, 20)]], 6)
    kept, tokens, logprobs, top_ids, _ = speculation.verify_rows(logits, jnp.ones((6, 2), jnp.int32),
                                                                 jnp.zeros(6, jnp.int32), settings)
    want = sample_rows(logits[:, 0], settings)
    assert kept.tolist() == [0] * 6 and tokens[:, 0].tolist() == want[0].tolist()
    np.testing.assert_allclose(logprobs[:, 0], want[1], rtol=1e-6)
    assert top_ids[:, 0].tolist() == want[2].tolist() and np.all(np.asarray(tokens[:, 1:]) == 0)


def test_greedy_verify_keeps_the_drafts_up_to_the_first_disagreement():
    best = jnp.array([[3, 1, 4, 1, 5], [3, 1, 4, 1, 5], [3, 1, 4, 1, 5]])  # the target's argmax per position
    logits = jax.nn.one_hot(best, 8) * 10.0
    drafts = jnp.array([[3, 1, 0, 1], [3, 1, 4, 1], [2, 1, 4, 1]])
    kept, token, _ = jax.jit(speculation.verify)(logits, drafts, jnp.array([4, 3, 4]), None, None, None, None)
    # Row 0 disagrees at its third draft; row 1 keeps all 3 it drafted; row 2 none.
    assert kept.tolist() == [2, 3, 0] and token.tolist() == [4, 1, 3]


# ------------------------------------------------------------------ sampling

VOCAB, ROWS, SAMPLED = 8, 4096, 3
SAMPLING = generation.Sampling(temperature=1.0, top_k=6)
PROMPT = [1, 2, 3, 1, 2, 3]


def tiny(seed: int, rows: int = ROWS):
    """A one-layer Llama over 8 tokens, `rows` sequences wide, with standard-normal weights from NumPy.

    Built abstractly and filled in, so no initializer compiles a program.
    """
    config = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=8, intermediate_size=16, norm_eps=1e-5, tie_embeddings=False,
                         max_position_embeddings=16, rope=RoPE(theta=10000.0))
    abstract = nnx.eval_shape(lambda: models.CausalLM(config, max_len=16, batch_size=rows, rngs=nnx.Rngs(0)))
    graphdef, params, caches = nnx.split(abstract, nnx.Param, nnx.Cache)
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda w: jnp.asarray(rng.standard_normal(w.shape).astype(w.dtype)), params)
    return nnx.merge(graphdef, params, jax.tree.map(lambda c: jnp.zeros(c.shape, c.dtype), caches))


def reference_probabilities(logits):
    """What plain sampling draws from, in float64: softmax of the logits over temperature, within the top k."""
    logits = np.asarray(logits, np.float64) / SAMPLING.temperature
    kth = np.sort(logits, axis=-1)[..., -SAMPLING.top_k][..., None]
    probs = np.where(logits < kth, 0.0, np.exp(logits - logits.max(axis=-1, keepdims=True)))
    return probs / probs.sum(axis=-1, keepdims=True)


def chi_square_p(cells, probabilities) -> float:
    """The p-value of how often each cell was drawn against `probabilities` (cells expected < 5 pooled)."""
    observed = np.bincount(np.asarray(cells).ravel(), minlength=probabilities.size).astype(np.float64)
    wanted = probabilities.ravel() * np.size(cells)
    small = wanted < 5
    observed = np.append(observed[~small], observed[small].sum())
    wanted = np.append(wanted[~small], wanted[small].sum())
    statistic = np.sum((observed - wanted) ** 2 / np.maximum(wanted, 1e-12))
    return float(scipy.stats.chi2.sf(statistic, len(observed) - 1))


# One round's verify over many rows: its first token must follow p, whatever the draft and its q.
P_LOGITS = jnp.asarray(np.random.default_rng(3).standard_normal((1, 3, VOCAB)).astype(np.float32) * 1.5)
Q = jax.nn.softmax(jnp.asarray(np.random.default_rng(4).standard_normal((1, 2, VOCAB)).astype(np.float32)), axis=-1)
ROUND_ROWS = 20000


def first_tokens() -> dict[str, np.ndarray]:
    """The first token each of `ROUND_ROWS` rounds produces (its first draft if kept, else the token drawn).

    For both forms of q: a point mass (prompt lookup, every row drafting the
    same copy) and a distribution the drafts were drawn from (a draft model).
    """

    def rounds(key):
        draw_key, point_key, draft_key = jax.random.split(key, 3)
        logits = jnp.broadcast_to(P_LOGITS, (ROUND_ROWS, *P_LOGITS.shape[1:]))
        widths = jnp.full((ROUND_ROWS,), 2)
        q = jnp.broadcast_to(Q, (ROUND_ROWS, *Q.shape[1:]))
        drawn = jax.random.categorical(draw_key, jnp.log(q), axis=-1).astype(jnp.int32)
        copied = jnp.broadcast_to(jnp.array([[5, 2]]), (ROUND_ROWS, 2))
        out = {}
        for form, drafts, drafted_from, round_key in (("point mass", copied, None, point_key),
                                                       ("draft", drawn, q, draft_key)):
            keys = jax.random.split(round_key, ROUND_ROWS * 3).reshape(ROUND_ROWS, 3)
            settings = (jnp.full((ROUND_ROWS,), value) for value in (SAMPLING.temperature, SAMPLING.top_k, 1.0))
            kept, token, _ = speculation.verify(logits, drafts, widths, *settings, keys, drafted_from)
            out[form] = jnp.where(kept > 0, drafts[:, 0], token)
        # The server's form: every row with its own settings and seed, drafts copied.
        rows = jnp.arange(ROUND_ROWS, dtype=jnp.uint32)
        settings = RowSampling(jnp.full(rows.shape, SAMPLING.temperature), jnp.full(rows.shape, SAMPLING.top_k),
                                      jnp.ones(rows.shape), jnp.zeros(rows.shape), rows, rows * 0, rows * 0 + 3,
                                      jnp.zeros(rows.shape, jnp.int32))
        out["rows"] = speculation.verify_rows(logits, copied, widths, settings)[1][:, 0]
        return out

    # A fresh function, so it is traced afresh (with `_accepts` as it is now); an rbg key compiles faster.
    return jax.jit(lambda key: rounds(key))(jax.random.key(11, impl="rbg"))


def test_a_round_draws_its_first_token_from_the_target_distribution():
    for form, tokens in first_tokens().items():
        assert chi_square_p(tokens, reference_probabilities(P_LOGITS[0, 0])) > 1e-3, form


def test_the_chi_square_test_refuses_a_wrong_acceptance_rule(monkeypatch):
    """Keeping every draft gives q's distribution, not p's: the same test must see it, for both forms of q."""
    monkeypatch.setattr(speculation, "_accepts", lambda p, q, uniform: jnp.ones(uniform.shape, jnp.bool_))
    for form, tokens in first_tokens().items():
        assert chi_square_p(tokens, reference_probabilities(P_LOGITS[0, 0])) < 1e-9, form


@pytest.fixture(scope="module")
def tiny_target():
    return tiny(0)


def test_sampled_generation_has_the_distribution_of_plain_sampling(tiny_target):
    """Thousands of sequences decoded with a draft model in one call, against the exact law of plain sampling.

    The law of the 8**3 continuations comes from full forwards of every
    two-token prefix; the tokens after the first are drawn through rounds
    that keep some drafts and refuse others.
    """
    prefixes = np.array([[a, b] for a in range(VOCAB) for b in range(VOCAB)])
    tokens = np.concatenate([np.tile(PROMPT, (len(prefixes), 1)), prefixes], axis=1)
    graphdef, params, rest = nnx.split(tiny_target, nnx.Param, ...)
    forward = jax.jit(lambda params, tokens: nnx.merge(graphdef, params, rest)(tokens))  # one program, not many ops
    probs = reference_probabilities(forward(params, jnp.asarray(tokens))[:, len(PROMPT) - 1 :])
    first = probs[0, 0]
    second = probs[:, 1].reshape(VOCAB, VOCAB, VOCAB)[:, 0]  # depends on the first token only
    third = probs[:, 2].reshape(VOCAB, VOCAB, VOCAB)
    exact = first[:, None, None] * second[:, :, None] * third

    # The key is arbitrary: p over keys 8-44 was spread evenly over (0, 1) (lowest 0.003); key 7 drew 8e-5 once
    # the float32 dots ran natively (other summation order, other samples), 0.14 on XLA's.
    result = generation.speculate(tiny_target, np.tile(PROMPT, (ROWS, 1)), SAMPLED, rng=jax.random.key(8, impl="rbg"),
                              speculative=generation.DraftModel(tiny(1), num_tokens=2), temperature=SAMPLING.temperature,
                              top_k=SAMPLING.top_k)
    assert np.asarray(result.counts).tolist() == [SAMPLED] * ROWS
    # Rounds ran and refused some drafts: the acceptance rule and the residual were reached.
    assert int(result.rounds) > 0 and 0 < result.acceptance < 1
    cells = np.ravel_multi_index(np.asarray(result.tokens).T, (VOCAB,) * SAMPLED)
    assert chi_square_p(cells, exact) > 1e-3


# ------------------------------------------------------------------ refusals


@pytest.fixture(scope="module")
def llama():
    return load("llama")


@pytest.mark.parametrize("options, error, message", [
    ({"num_tokens": 0}, ValueError, "num_tokens must be a positive int, got 0"),
    ({"num_tokens": 2.0}, ValueError, "num_tokens must be a positive int, got 2.0"),
    ({"num_tokens": True}, ValueError, "num_tokens must be a positive int, got True"),
    ({"num_tokens": 2, "max_ngram": 0}, ValueError, "max_ngram must be a positive int, got 0"),
    ({"num_tokens": 2**31 - 1}, ValueError, "num_tokens must be at most 64 drafts per round, got 2147483647"),
])
def test_prompt_lookup_settings_are_checked(options, error, message):
    with pytest.raises(error, match=message):
        generation.PromptLookup(**options)


def test_draft_model_settings_are_checked(llama):
    with pytest.raises(TypeError, match="draft must be a kvattn.models.CausalLM, got str"):
        generation.DraftModel("llama", num_tokens=2)
    with pytest.raises(ValueError, match="num_tokens must be a positive int, got -1"):
        generation.DraftModel(llama, num_tokens=-1)


def cache_bytes(model) -> list[bytes]:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(nnx.state(model, nnx.Cache))]


def refusal(model, match, error=ValueError, **options):
    """`speculate` refuses with `match`, and no cache, the target's or the draft's, has changed."""
    holders = [model] + ([options["speculative"].draft] if isinstance(options.get("speculative"),
                                                                      generation.DraftModel) else [])
    before = [cache_bytes(holder) for holder in holders]
    with pytest.raises(error, match=match):
        generation.speculate(model, expected("llama")["prompts"], 4, **options)
    assert [cache_bytes(holder) for holder in holders] == before


def test_drafts_that_cannot_serve_the_target_are_refused_before_anything_runs(llama):
    llama.reset()
    refusal(llama, "speculative must be a PromptLookup or a DraftModel, got int", TypeError, speculative=4)
    refusal(llama, "must be another CausalLM than the target", speculative=generation.DraftModel(llama, 2))
    other_vocab = tiny(0, rows=3)
    refusal(llama, "share the target's vocabulary: vocab_size 97 expected, got 8",
            speculative=generation.DraftModel(other_vocab, 2))
    refusal(llama, "the target's batch size 3, got batch_size=2",
            speculative=generation.DraftModel(load("llama", batch_size=2), 2))
    behind = load("llama")
    for block in behind.blocks:  # as if it had taken two tokens
        block.attention.pos[...] = jnp.full((3,), 2, jnp.int32)
    refusal(llama, r"hold what the target's hold: pos \[0, 0, 0\] expected, got \[2, 2, 2\]",
            speculative=generation.DraftModel(behind, 2))
    refusal(llama, "cache overflow for sequences", CacheOverflowError,
            speculative=generation.DraftModel(load("llama", max_len=8), 2))
    # generate's own checks, with generate's messages.
    with pytest.raises(ValueError, match=r"prompts must have shape \(3, T\), got \(1, 3\)"):
        generation.generate(llama, [[1, 2, 3]], 4, speculative=generation.PromptLookup(2))


def test_caches_that_cannot_be_rolled_back_are_refused():
    windowed = models.from_pretrained(FIXTURES / "mistral", max_len=64, batch_size=3)  # a ring past its window of 8
    refusal(windowed, "up to 2 drafts .* ring of 8 slots with spare_slots=0 cannot .* build it with spare_slots >= 1",
            speculative=generation.PromptLookup(2))
    paged = load("llama", num_pages=8, page_size=8)
    refusal(paged, "needs contiguous caches; the model is paged", speculative=generation.PromptLookup(2))


def test_acceptance_is_nan_when_nothing_was_drafted():
    zeros = jnp.zeros((2,), jnp.int32)
    result = generation.Speculated(jnp.zeros((2, 1), jnp.int32), zeros, jnp.int32(0), jnp.int32(1), zeros, zeros)
    assert math.isnan(result.acceptance)


def test_the_policy_is_one_arithmetic_on_host_numbers_and_traced_arrays():
    """The engine asks it per request on the host (no device op), the fixed-batch loop in its graph: same answers."""
    policy = generation.Policy()
    traced = jax.jit(lambda e, w, p, c, n: (policy.wants_round(e, w, p, c, n), policy.patience(e, p, c, n)))
    for expected, waited, patience, cost, length in [(0.2, 3, 16, 0.0, 0), (1.5, 0, 16, 0.0, 0), (0.5, 16, 16, 0.0, 0),
                                                     (1.2, 0, 32, 0.3, 2), (0.9, 70, 64, 0.1, 1)]:
        wants, longer = policy.wants_round(expected, waited, patience, cost, length), policy.patience(
            expected, patience, cost, length)
        assert isinstance(wants, bool) and isinstance(longer, int)
        assert (wants, longer) == tuple(x.item() for x in traced(expected, waited, patience, cost, length))
    assert policy.patience(0.0, 48) == 64 and policy.patience(2.0, 48) == 16
