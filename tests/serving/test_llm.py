"""`kvattn.LLM`, the offline face of the engine: the tokens of `generate`, text equal to the tokenizer's, stops."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import kvattn
from kvattn import generation, models
from kvattn.kernels import native
from kvattn.generation import PromptLookup, SamplingParams
from kvattn.serving.tokenizer import Tokenizer
from tests.helpers import FIXTURES, expected


@functools.cache
def llm(name: str, **options) -> kvattn.LLM:
    """One engine per checkpoint and options for the module: its programs compile once."""
    return kvattn.LLM(FIXTURES / name, max_len=48, max_batch=3, page_size=4, **options)


# Each family's blocks, as the paged engine runs them, are checked against transformers in test_server.py and
# test_speculative.py; here the faces meet: learned positions and int4 weights (gpt2), a sliding window
# (mistral), QK-norm and prompt lookup (qwen3), int8 weights (llama: the int8 dots of `generate`), sliding and
# full layers mixed with prompt lookup (gemma2: every page kept, so a refused draft rolls back), bfloat16 weights
# (phi3), one engine per row, so their programs compile once each.
@pytest.mark.parametrize("family, speculative, weights", [
    ("gpt2", None, "int4"), ("mistral", None, None), ("qwen3", PromptLookup(num_tokens=3, max_ngram=2), None),
    ("llama", None, "int8"), ("gemma2", PromptLookup(num_tokens=3, max_ngram=2), None),
    pytest.param("phi3", None, "bfloat16", marks=pytest.mark.skipif(
        not native.available(native.BF16_DOT), reason="kvattn's bfloat16 dot cannot run here")),
])
def test_greedy_llm_equals_fixed_batch_generate_token_for_token(family, speculative, weights):
    want = expected(family)
    prompts = [list(want["prompts"][row, :length]) for row, length in enumerate(want["lengths"])]
    reference = models.from_pretrained(FIXTURES / family, max_len=48, batch_size=len(prompts), weights=weights)
    generated = np.asarray(generation.generate(reference, want["prompts"], 12, lengths=want["lengths"]).tokens)
    engine = llm(family, speculative=speculative, weights=weights)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [o.outputs[0].token_ids for o in outputs] == generated.tolist()
    assert all(o.outputs[0].text is None for o in outputs)  # no tokenizer.json: ids only
    again = engine.generate(prompts[::-1], SamplingParams(max_tokens=12, ignore_eos=True), progress=False)
    assert [o.outputs[0].token_ids for o in again] == generated.tolist()[::-1], "calls are independent"
    assert engine.engine.idle


def test_a_seed_reproduces_whatever_else_runs():
    engine = llm("chat")
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    [alone] = engine.generate("Hello", params)
    crowd = engine.generate(["The cache", "Hello", "x y z"], [SamplingParams(max_tokens=6, temperature=1.0,
                                                                            ignore_eos=True), params, params])
    assert crowd[1].outputs[0].token_ids == alone.outputs[0].token_ids
    unseeded = engine.generate(["Hello", "Hello"], SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True))
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids, "each request draws its own seed"


def test_end_of_sequence_stops_every_completion_unless_ignored():
    engine = llm("llama")
    eos = engine.eos_token_ids  # generation_config.json's
    assert eos and all(isinstance(i, int) for i in eos)
    # A stop id is the end-of-sequence as far as the engine knows: force it by naming the first greedy token.
    prompt = list(expected("llama")["prompts"][0, :5])
    [plain] = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
    first = plain.outputs[0].token_ids[0]
    [stopped] = engine.generate([prompt], SamplingParams(max_tokens=6, stop_token_ids=first))
    assert stopped.outputs[0].token_ids == [first] and stopped.outputs[0].finish_reason == "stop"


@pytest.fixture(scope="module", params=["chat", "sentencepiece"])
def text_llm(request):
    return llm(request.param), Tokenizer.from_directory(FIXTURES / request.param)


def test_text_is_what_the_tokenizer_decodes_streamed_or_not(text_llm):
    engine, tokenizer = text_llm
    prompts = ["The cache holds", "have w121 but at", "Hello"]
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=3)
    outputs = engine.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert output.prompt == prompt and output.prompt_token_ids == tokenizer.encode(prompt)
        # The text the new ids add to the prompt's, as the tokenizer decodes the whole.
        assert tokenizer.decode(output.prompt_token_ids) + completion.text == \
            tokenizer.decode(output.prompt_token_ids + completion.token_ids)
        assert "".join(engine.stream(prompt, params)) == completion.text, "a seed reproduces, streamed too"


def test_stop_strings_cut_the_text_and_end_the_completion(text_llm):
    engine, _ = text_llm
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    [whole] = engine.generate("The cache holds", params)
    text = whole.outputs[0].text
    cut = next((i for i in range(2, len(text)) if text[i].strip()), None)
    if cut is None:
        pytest.skip("the greedy text has no printable character to stop at")
    stop = text[cut : cut + 2]
    [stopped] = engine.generate("The cache holds", SamplingParams(max_tokens=12, ignore_eos=True, stop=stop))
    completion = stopped.outputs[0]
    assert completion.text == text[: text.index(stop)] and completion.finish_reason == "stop"
    assert len(completion.token_ids) <= len(whole.outputs[0].token_ids)
    assert "".join(engine.stream("The cache holds", SamplingParams(max_tokens=12, ignore_eos=True, stop=stop))) \
        == completion.text
    kept = SamplingParams(max_tokens=12, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    assert engine.generate("The cache holds", kept)[0].outputs[0].text == completion.text + stop


def test_many_prompts_each_equal_their_single_run_and_n_choices_with_logprobs():
    engine = llm("chat")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 300, int(rng.integers(1, 12))).tolist() for _ in range(1000)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    batch = engine.generate(prompts, params, progress=False)
    assert [o.prompt_token_ids for o in batch] == prompts and all(len(o.outputs[0].token_ids) == 3 for o in batch)
    for row in range(0, 1000, 40):
        [single] = engine.generate([prompts[row]], params)
        assert single.outputs[0].token_ids == batch[row].outputs[0].token_ids
    [choices] = engine.generate("Hello", SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=1, logprobs=2))
    assert [c.index for c in choices.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in choices.outputs}) > 1
    for completion in choices.outputs:
        assert [t.id for t in completion.logprobs] == completion.token_ids
        assert all(len(t.top) == 2 and t.logprob <= 0 for t in completion.logprobs)


def test_chat_renders_the_template_and_stops_at_end_of_sequence():
    engine = llm("chat")
    conversation = [{"role": "user", "content": "hi"}]
    [output] = engine.chat(conversation, SamplingParams(max_tokens=16))
    tokenizer = engine.tokenizer
    assert output.prompt_token_ids == tokenizer.encode(tokenizer.render_chat(conversation), add_special_tokens=False)
    completion = output.outputs[0]
    ended = completion.token_ids[-1] in engine.eos_token_ids
    assert completion.finish_reason == ("stop" if ended else "length")
    assert not any(i in engine.eos_token_ids for i in completion.token_ids[:-1])
    assert len(engine.chat([conversation, conversation], SamplingParams(max_tokens=2))) == 2


def test_bad_calls_are_refused_before_anything_runs():
    engine = llm("chat")
    with pytest.raises(ValueError, match="prompt 1 .* can never fit: a sequence holds at most max_len=48"):
        engine.generate(["Hello", "x" * 200], SamplingParams(max_tokens=4))
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.generate("Hello", {"max_tokens": 4})
    with pytest.raises(TypeError, match="a prompt must be a string or a list of token ids"):
        engine.generate([1.5])
    with pytest.raises(ValueError, match="n must be 1"):
        engine.stream("Hello", SamplingParams(n=2))
    with pytest.raises(ValueError, match="top_k must be at most the vocabulary"):
        engine.generate("Hello", SamplingParams(top_k=10**6))
    assert engine.engine.idle and engine.engine.stats.waiting == 0
    with pytest.raises(ValueError, match="past the model's trained context of 512 tokens"):
        kvattn.LLM(FIXTURES / "chat", max_len=600)
    with pytest.raises(FileNotFoundError, match="config.json"):
        kvattn.LLM(FIXTURES)


SMALL_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                 "b": {"type": "boolean"}}, "required": ["a", "b"],
                "additionalProperties": False}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_structured_outputs_compose_with_speculation_token_for_token(temperature):
    """A draft outside the grammar is never offered; each drafted position is masked as if the drafts before it
    were kept: the tokens equal plain decoding's, greedy or sampled with a seed."""
    import json

    import jsonschema

    from kvattn.generation import StructuredOutputs

    prompts = ["The cache holds", "Hello", "{\"a\": 1, \"b\": true}"]  # the last one's prompt drafts its output
    params = [SamplingParams(max_tokens=24, temperature=temperature, seed=i, repetition_penalty=1.2,
                             structured_outputs=StructuredOutputs(json=SMALL_SCHEMA)) for i in range(len(prompts))]
    plain = llm("chat").generate(prompts, params, progress=False)
    speculative = llm("chat", speculative=PromptLookup(num_tokens=3, max_ngram=2))
    drafted = speculative.engine.stats.drafted_tokens
    drafting = speculative.generate(prompts, params, progress=False)
    assert speculative.engine.stats.drafted_tokens > drafted, "no round drafted: the test would prove nothing"
    for one, other in zip(plain, drafting):
        assert one.outputs[0].token_ids == other.outputs[0].token_ids
        jsonschema.validate(json.loads(one.outputs[0].text), SMALL_SCHEMA)


def test_min_tokens_holds_back_stop_ids_and_stop_strings():
    engine = llm("chat")
    [free] = engine.generate("Hello", SamplingParams(max_tokens=8, ignore_eos=True))
    first = free.outputs[0]
    [held] = engine.generate("Hello", SamplingParams(max_tokens=8, ignore_eos=True, min_tokens=4,
                                                     stop_token_ids=[first.token_ids[0]], stop=first.text[:1] or "x"))
    assert len(held.outputs[0].token_ids) >= 4 and first.token_ids[0] not in held.outputs[0].token_ids[:4]
