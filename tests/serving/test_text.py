"""kvattn.serving.text against transformers, on the chat fixture tools/make_serve_fixture.py made.

tests/fixtures/hf/chat/expected.json holds what transformers' tokenizer and
model made of the fixture (rendered chats and their ids, encode/decode round
trips, a greedy continuation), so this suite needs neither torch nor
transformers. The detokenizer and the stop strings are checked as
properties over random ids and texts.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from kvattn import generation, models
from kvattn.serving import text as text_module
from kvattn.serving.text import StopStrings, Tokenizer
from tests.helpers import FIXTURES

CHAT = FIXTURES / "chat"
EXPECTED = json.loads((CHAT / "expected.json").read_text(encoding="utf-8"))
TOKENIZER = Tokenizer.from_directory(CHAT)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture
def directory(tmp_path):
    """A copy of the fixture's tokenizer files, to edit."""
    for name in TOKENIZER_FILES:
        shutil.copy(CHAT / name, tmp_path / name)
    return tmp_path


def edit_config(directory, **changes):
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


# Against transformers


@pytest.mark.parametrize("case", EXPECTED["chats"], ids=range(len(EXPECTED["chats"])))
def test_render_chat_equals_transformers(case):
    rendered = TOKENIZER.render_chat(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert rendered == case["text"]
    # transformers tokenizes a rendered chat without adding special tokens: the template holds them.
    assert TOKENIZER.encode(rendered, add_special_tokens=False) == case["ids"]


@pytest.mark.parametrize("case", EXPECTED["texts"], ids=range(len(EXPECTED["texts"])))
def test_encode_and_decode_equal_transformers(case):
    assert TOKENIZER.encode(case["text"]) == case["ids"]
    assert TOKENIZER.encode(case["text"], add_special_tokens=False) == case["ids_without_special"]
    assert TOKENIZER.decode(case["ids"]) == case["decoded"]
    assert TOKENIZER.decode(np.asarray(case["ids"], np.int32), skip_special_tokens=False) == case["decoded_with_special"]


def test_special_tokens_and_end_of_sequence_ids():
    specials = EXPECTED["special_tokens"]
    assert TOKENIZER.vocab_size == EXPECTED["vocab_size"] == 384
    assert (TOKENIZER.bos_token, TOKENIZER.eos_token) == ("<|bos|>", "<|eos|>")  # the EOS is an AddedToken dict
    # generation_config.json's list wins over tokenizer_config.json's eos_token.
    assert TOKENIZER.eos_token_ids == {specials["<|eos|>"], specials["<|end|>"]}
    assert TOKENIZER.has_chat_template


def test_end_of_sequence_ids_fall_back_to_the_eos_token(directory):
    (directory / "generation_config.json").unlink()
    assert Tokenizer.from_directory(directory).eos_token_ids == {EXPECTED["special_tokens"]["<|eos|>"]}
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert Tokenizer.from_directory(directory).eos_token_ids == {5}
    edit_config(directory, eos_token="<|nowhere|>")
    (directory / "generation_config.json").unlink()
    with pytest.raises(ValueError, match=r"eos_token '<\|nowhere\|>' is not in the vocabulary"):
        Tokenizer.from_directory(directory)


def test_greedy_generation_from_a_rendered_chat_equals_transformers():
    want = EXPECTED["greedy"]
    prompt = TOKENIZER.encode(TOKENIZER.render_chat(EXPECTED["chats"][want["chat"]]["messages"]),
                              add_special_tokens=False)
    assert prompt == want["prompt"]
    model = models.from_pretrained(CHAT, max_len=64)
    result = generation.generate(model, np.asarray([prompt], np.int32), len(want["new_tokens"]))
    assert np.asarray(result.tokens)[0].tolist() == want["new_tokens"]
    # The random model's tokens split characters: streamed, they still give transformers' text.
    detokenizer = TOKENIZER.detokenizer()
    pieces = [detokenizer.push(token) for token in result.tokens[0]]
    assert "".join(pieces) + detokenizer.flush() == want["text"]


# Detokenizer

# Text that byte-level BPE splits inside characters: accents, CJK, emoji (4 bytes each), joiners.
UNICODE_TEXT = st.text(st.sampled_from("aé ü日本語テキスト😀🎉👩‍💻\n\t<|"), max_size=24) | st.text(max_size=16)


@settings(max_examples=50)
@given(text=UNICODE_TEXT)
def test_detokenizing_encoded_text_streams_it_whole_and_never_half_a_character(text):
    detokenizer = TOKENIZER.detokenizer()
    pieces = [detokenizer.push(token) for token in TOKENIZER.encode(text, add_special_tokens=False)]
    assert "".join(pieces) == text
    assert detokenizer.flush() == ""
    if "\ufffd" not in text:
        assert not any("\ufffd" in piece for piece in pieces)  # a split character would show as U+FFFD


@settings(max_examples=50)
@given(ids=st.lists(st.integers(0, EXPECTED["vocab_size"] - 1), max_size=24), skip_special_tokens=st.booleans())
def test_detokenizer_pieces_add_up_to_decode_for_any_ids(ids, skip_special_tokens):
    detokenizer = TOKENIZER.detokenizer(skip_special_tokens=skip_special_tokens)
    streamed = "".join(detokenizer.push(token) for token in ids) + detokenizer.flush()
    assert streamed == TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)


def test_detokenizer_holds_a_character_until_its_last_byte():
    ids = TOKENIZER.encode("😀!", add_special_tokens=False)
    assert len(ids) > 2  # the emoji's four bytes take several tokens
    detokenizer = TOKENIZER.detokenizer()
    assert [detokenizer.push(token) for token in ids] == [""] * (len(ids) - 2) + ["😀", "!"]
    detokenizer = TOKENIZER.detokenizer()
    assert detokenizer.push(ids[0]) == ""
    assert detokenizer.flush() == "\ufffd"  # a generation that ends mid-character, as decode shows it


def test_detokenizer_context_keeps_a_leading_space_a_sentencepiece_decoder_strips():
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    raw = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    raw.decoder = tokenizers.decoders.Metaspace()
    tokenizer = Tokenizer(raw)
    alone = tokenizer.detokenizer()
    assert alone.push(2) == "world"
    after_prompt = tokenizer.detokenizer(context=[1])
    assert [after_prompt.push(2), after_prompt.push(3), after_prompt.flush()] == [" world", "!", ""]


@pytest.mark.parametrize("bad", [-1, 1 << 32, 2.0, True, "7"])
def test_token_ids_outside_the_tokenizers_range_are_refused(bad):
    with pytest.raises(ValueError, match="token id must be an integer"):
        TOKENIZER.detokenizer().push(bad)
    with pytest.raises(ValueError, match="token id must be an integer"):
        TOKENIZER.decode([1, bad])


# Stop strings

PIECES = st.text("ab<>/\n", max_size=12)
STOPS = st.lists(st.text("ab<>/\n", min_size=1, max_size=4), min_size=1, max_size=3)


def first_stop(text: str, stops) -> int | None:
    """Where the output ends: the start of the stop string that completes first (on a tie, the longest)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(stop) for stop in stops if text[max(0, end - len(stop)) : end] == stop]
        if starts:
            return min(starts)
    return None


@settings(max_examples=50)
@given(pieces=st.lists(PIECES, max_size=8), stops=STOPS)
def test_stop_strings_cut_the_text_before_the_first_stop_wherever_tokens_split_it(pieces, stops):
    text = "".join(pieces)
    matcher = StopStrings(stops)
    emitted, matched = [], False
    for piece in pieces:
        out, matched = matcher.push(piece)
        emitted.append(out)
        if matched:
            break
    if not matched:
        emitted.append(matcher.flush())
    cut = first_stop(text, stops)
    assert "".join(emitted) == (text if cut is None else text[:cut])
    assert matched == (cut is not None) == matcher.matched
    assert not any(stop in "".join(emitted) for stop in stops)  # not whole, nor split across pieces


def test_stop_strings_hold_back_only_what_could_start_one():
    matcher = StopStrings(["</s>", "###"])
    assert matcher.push("Hello <") == ("Hello ", False)
    assert matcher.push("b>") == ("<b>", False)  # "<b" cannot start "</s>": released
    assert matcher.push(" #") == (" ", False)
    assert matcher.push("#") == ("", False)
    assert matcher.push("#tail") == ("", True)
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""
    unfinished = StopStrings(["</s>"])
    assert unfinished.push("end </") == ("end ", False)
    assert unfinished.flush() == "</"


@pytest.mark.parametrize("bad", [[""], "stop", ["ok", 3]])
def test_stop_strings_must_be_non_empty_strings(bad):
    with pytest.raises(ValueError, match="stop strings must be a list of non-empty strings"):
        StopStrings(bad)


# Chat templates: errors, the sandbox, overrides


def test_an_unknown_role_is_refused_by_the_template():
    with pytest.raises(ValueError, match="Unknown role: tool"):
        TOKENIZER.render_chat([{"role": "tool", "content": "42"}])


@pytest.mark.parametrize("messages", [
    [],
    {"role": "user", "content": "hi"},
    ["hi"],
    [{"role": "user"}],
    [{"role": "user", "content": ["parts"]}],
    [{"role": 1, "content": "hi"}],
    [{"role": "user", "content": "hi", "extra": object()}],
])
def test_messages_of_the_wrong_shape_are_refused(messages):
    with pytest.raises(ValueError, match="messages"):
        TOKENIZER.render_chat(messages)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.append({'role': 'injected'}) }}",
    "{% set ns = namespace(_x=1) %}{{ ns }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}",
])
def test_the_sandbox_refuses_unsafe_templates(template):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="the chat template refused the messages"):
        Tokenizer.from_directory(CHAT, chat_template=template).render_chat(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_a_template_that_does_not_compile_is_refused_at_load():
    with pytest.raises(ValueError, match="does not compile"):
        Tokenizer.from_directory(CHAT, chat_template="{% for message in messages %}")


def test_template_globals_and_filters_are_transformers():
    template = ("{{ messages | tojson }}|{{ bos_token }}|{{ strftime_now('%Y') | length }}"
                "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.content }}{% endfor %}"
                "{% if tools is not none or documents is not none %}tools{% endif %}")
    tokenizer = Tokenizer(tokenizers.Tokenizer.from_file(str(CHAT / "tokenizer.json")), chat_template=template)
    messages = [{"role": "user", "content": "<b>&é", "name": None}, {"role": "assistant", "content": "x"}]
    # No HTML escaping, non-ASCII kept, None-valued keys dropped; an unset bos_token renders as nothing; tools and
    # documents are None (not undefined, which `is not none` would take for a value).
    plain = [{"role": "user", "content": "<b>&é"}, {"role": "assistant", "content": "x"}]
    assert tokenizer.render_chat(messages) == json.dumps(plain, ensure_ascii=False) + "||4x"


def test_chat_template_argument_and_file_override_the_config(directory):
    messages = [{"role": "user", "content": "hi"}]
    override = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert Tokenizer.from_directory(directory, chat_template=override).render_chat(messages) == "user: hi\n"
    (directory / "chat_template.jinja").write_text("from the file: {{ messages[0].content }}")
    assert Tokenizer.from_directory(directory).render_chat(messages) == "from the file: hi"
    assert Tokenizer.from_directory(directory, chat_template=override).render_chat(messages) == "user: hi\n"


def test_named_templates_use_the_default(directory):
    edit_config(directory, chat_template=[{"name": "tool_use", "template": "tools"},
                                          {"name": "default", "template": "default"}])
    assert Tokenizer.from_directory(directory).render_chat([{"role": "user", "content": "hi"}]) == "default"
    edit_config(directory, chat_template=[{"name": "tool_use", "template": "tools"}])
    with pytest.raises(ValueError, match=r"named \['tool_use'\] but none named 'default'"):
        Tokenizer.from_directory(directory)
    Tokenizer.from_directory(directory, chat_template="given")  # an override needs no usable config template


def test_no_chat_template_says_to_pass_one(directory):
    edit_config(directory, chat_template=None)
    tokenizer = Tokenizer.from_directory(directory)
    assert not tokenizer.has_chat_template
    with pytest.raises(ValueError, match="has no chat_template; pass --chat-template"):
        tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert tokenizer.encode("hi")[0] == EXPECTED["special_tokens"]["<|bos|>"]  # completions still work


# Reading a checkpoint directory


def test_a_directory_without_tokenizer_json_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} has no tokenizer.json"):
        Tokenizer.from_directory(tmp_path)


@pytest.mark.parametrize(("name", "content", "message"), [
    ("tokenizer_config.json", "{not json", "tokenizer_config.json is not valid JSON"),
    ("tokenizer_config.json", "[1, 2]", "tokenizer_config.json must hold a JSON object, got list"),
    ("tokenizer_config.json", '{"bos_token": 7}', "bos_token must be a string"),
    ("tokenizer_config.json", '{"chat_template": 7}', "chat_template must be a string"),
    ("generation_config.json", '{"eos_token_id": "2"}', "eos_token_id must be a non-negative int"),
    ("generation_config.json", '{"eos_token_id": [1, -5]}', "eos_token_id must be a non-negative int"),
    ("tokenizer.json", '{"model": 3}', "tokenizer.json is not a tokenizer the tokenizers library can load"),
    ("tokenizer.json", b"\xff\xfe", "tokenizer.json is not UTF-8 text"),
])
def test_malformed_files_are_named(directory, name, content, message):
    path = directory / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_directory(directory)


def test_oversized_files_are_refused_before_parsing(directory, monkeypatch):
    monkeypatch.setattr(text_module, "MAX_CONFIG_BYTES", 64)
    with pytest.raises(ValueError, match="tokenizer_config.json is larger than 64 bytes"):
        Tokenizer.from_directory(directory)
