"""kvattn.serving.text against transformers, on the fixtures tools/make_serve_fixture.py made.

`chat` has a byte-level BPE tokenizer, `sentencepiece` a Llama-2-style one
(`▁` for a space, byte-fallback pieces). Each fixture's expected.json holds
what transformers' tokenizer and model made of it (rendered chats and their
ids, encode/decode round trips, a greedy continuation), so this suite needs
neither torch nor transformers. The detokenizer, the stop strings and the
text stream are checked as properties over random ids and texts, against
the tokenizers library's own `decode`.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil

import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from kvattn import generation, models
from kvattn.serving import tokenizer as tokenizer_module
from kvattn.serving.text import StopStrings, TextDelta, TextStream
from kvattn.serving.tokenizer import Tokenizer
from tests.helpers import FIXTURES

CHAT = FIXTURES / "chat"
EXPECTED = json.loads((CHAT / "expected.json").read_text(encoding="utf-8"))
TOKENIZER = Tokenizer.from_directory(CHAT)
SENTENCEPIECE = FIXTURES / "sentencepiece"
SENTENCEPIECE_EXPECTED = json.loads((SENTENCEPIECE / "expected.json").read_text(encoding="utf-8"))
SENTENCEPIECE_TOKENIZER = Tokenizer.from_directory(SENTENCEPIECE)
BOTH = {"chat": (CHAT, TOKENIZER, EXPECTED),
        "sentencepiece": (SENTENCEPIECE, SENTENCEPIECE_TOKENIZER, SENTENCEPIECE_EXPECTED)}
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


def cases(key):
    """(tokenizer, case) for each of both fixtures' expected `key` entries, with readable ids."""
    return [pytest.param(tokenizer, case, id=f"{name}-{index}") for name, (_, tokenizer, expected) in BOTH.items()
            for index, case in enumerate(expected[key])]


# Against transformers


@pytest.mark.parametrize(("tokenizer", "case"), cases("chats"))
def test_render_chat_equals_transformers(tokenizer, case):
    rendered = tokenizer.render_chat(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert rendered == case["text"]
    # transformers tokenizes a rendered chat without adding special tokens: the template holds them.
    assert tokenizer.encode(rendered, add_special_tokens=False) == case["ids"]


@pytest.mark.parametrize(("tokenizer", "case"), cases("texts"))
def test_encode_and_decode_equal_transformers(tokenizer, case):
    assert tokenizer.encode(case["text"]) == case["ids"]
    assert tokenizer.encode(case["text"], add_special_tokens=False) == case["ids_without_special"]
    assert tokenizer.decode(case["ids"]) == case["decoded"]
    with_special = tokenizer.decode(np.asarray(case["ids"], np.int32), skip_special_tokens=False)
    assert with_special == case["decoded_with_special"]


def test_special_tokens_and_end_of_sequence_ids():
    specials = EXPECTED["special_tokens"]
    assert TOKENIZER.vocab_size == EXPECTED["vocab_size"] == 384
    assert (TOKENIZER.bos_token, TOKENIZER.eos_token) == ("<|bos|>", "<|eos|>")  # the EOS is an AddedToken dict
    # generation_config.json's list wins over tokenizer_config.json's eos_token.
    assert TOKENIZER.eos_token_ids == {specials["<|eos|>"], specials["<|end|>"]}
    assert TOKENIZER.has_chat_template
    sentencepiece = SENTENCEPIECE_TOKENIZER
    assert sentencepiece.vocab_size == SENTENCEPIECE_EXPECTED["vocab_size"] == 512
    assert (sentencepiece.bos_token, sentencepiece.eos_token) == ("<s>", "</s>")
    assert sentencepiece.eos_token_ids == {SENTENCEPIECE_EXPECTED["special_tokens"]["</s>"]}
    assert sentencepiece.encode("have")[0] == SENTENCEPIECE_EXPECTED["special_tokens"]["<s>"]


def test_end_of_sequence_ids_fall_back_to_the_eos_token(directory):
    (directory / "generation_config.json").unlink()
    assert Tokenizer.from_directory(directory).eos_token_ids == {EXPECTED["special_tokens"]["<|eos|>"]}
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert Tokenizer.from_directory(directory).eos_token_ids == {5}
    edit_config(directory, eos_token="<|nowhere|>")
    (directory / "generation_config.json").unlink()
    with pytest.raises(ValueError, match=r"eos_token '<\|nowhere\|>' is not in the vocabulary"):
        Tokenizer.from_directory(directory)


@pytest.mark.parametrize("name", BOTH)
def test_greedy_generation_from_a_rendered_chat_equals_transformers(name):
    directory, tokenizer, expected = BOTH[name]
    want = expected["greedy"]
    prompt = tokenizer.encode(tokenizer.render_chat(expected["chats"][want["chat"]]["messages"]),
                              add_special_tokens=False)
    assert prompt == want["prompt"]
    model = models.from_pretrained(directory, max_len=64)
    result = generation.generate(model, np.asarray([prompt], np.int32), len(want["new_tokens"]))
    new_tokens = np.asarray(result.tokens)[0].tolist()
    assert new_tokens == want["new_tokens"]
    # The random model's tokens split characters: streamed, they still give transformers' text.
    stream = TextStream(tokenizer)
    assert "".join([stream.push(token).text for token in result.tokens[0]] + [stream.finish().text]) == want["text"]
    # After the prompt, the first word keeps its leading space: the text is what the tokens add to the prompt's.
    stream = TextStream(tokenizer, prompt=prompt)
    streamed = "".join([stream.push(token).text for token in new_tokens] + [stream.finish().text])
    assert tokenizer.decode(prompt) + streamed == tokenizer.decode(prompt + new_tokens)


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


def first_stop(text: str, stops, include: bool = False) -> int | None:
    """Where the output ends: the start of the stop string that completes first (on a tie, the longest), or with
    `include` its end."""
    for end in range(1, len(text) + 1):
        starts = [end - len(stop) for stop in stops if text[max(0, end - len(stop)) : end] == stop]
        if starts:
            return end if include else min(starts)
    return None


@settings(max_examples=50)
@given(pieces=st.lists(PIECES, max_size=8), stops=STOPS, include=st.booleans())
def test_stop_strings_cut_the_text_before_the_first_stop_wherever_tokens_split_it(pieces, stops, include):
    """Cut before the stop string, or just after it with `include` (vLLM's `include_stop_str_in_output`)."""
    text = "".join(pieces)
    matcher = StopStrings(stops, include=include)
    emitted, matched = [], False
    for piece in pieces:
        out, matched = matcher.push(piece)
        emitted.append(out)
        if matched:
            break
    if not matched:
        emitted.append(matcher.flush())
    cut = first_stop(text, stops, include)
    assert "".join(emitted) == (text if cut is None else text[:cut])
    assert matched == (cut is not None) == matcher.matched
    if not include:
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


# Text streams: both tokenizers, against the tokenizers library's decode

RAW = {name: tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
       for name, (directory, _, _) in BOTH.items()}


def piece_ids(name: str, pieces) -> list[int]:
    ids = [RAW[name].token_to_id(piece) for piece in pieces]
    assert None not in ids, (pieces, ids)
    return ids


def id_sequences(name: str):
    """Ids as a model might make them and as it might not: encoded text, special tokens, lone bytes, any id."""
    _, tokenizer, expected = BOTH[name]
    byte_ids = [i for i in (RAW[name].token_to_id(f"<0x{byte:02X}>") for byte in range(256)) if i is not None]
    single = st.integers(0, expected["vocab_size"] - 1) | st.sampled_from(sorted(expected["special_tokens"].values()))
    if byte_ids:
        single |= st.sampled_from(byte_ids)
    encoded = UNICODE_TEXT.map(lambda text: tokenizer.encode(text, add_special_tokens=False))
    return st.lists(single.map(lambda token: [token]) | encoded, max_size=6).map(lambda parts: list(itertools.chain(*parts)))


def stream_all(stream: TextStream, ids) -> list[TextDelta]:
    return [stream.push(token) for token in ids] + [stream.finish()]


def text_after(tokenizer, prompt, ids, skip_special_tokens=True) -> str:
    """What `ids` add to the text of `prompt`: decode(prompt + ids) past where it first differs from decode(prompt)."""
    before = tokenizer.decode(prompt, skip_special_tokens=skip_special_tokens)
    whole = tokenizer.decode(list(prompt) + list(ids), skip_special_tokens=skip_special_tokens)
    return whole[len(os.path.commonprefix([before, whole])):]


@pytest.mark.parametrize("name", BOTH)
@settings(max_examples=60)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_streamed_text_adds_up_to_decode_after_any_prompt(name, data, skip_special_tokens):
    tokenizer = BOTH[name][1]
    prompt = data.draw(st.just([]) | UNICODE_TEXT.map(tokenizer.encode) | id_sequences(name), label="prompt")
    ids = data.draw(id_sequences(name), label="ids")
    deltas = stream_all(TextStream(tokenizer, prompt=prompt, skip_special_tokens=skip_special_tokens), ids)
    streamed = "".join(delta.text for delta in deltas)
    if prompt:
        assert streamed == text_after(tokenizer, prompt, ids, skip_special_tokens)
    else:
        assert streamed == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any(delta.stopped for delta in deltas)
    if "\ufffd" not in tokenizer.decode(list(prompt) + ids, skip_special_tokens=skip_special_tokens):
        assert not any("\ufffd" in delta.text for delta in deltas)  # never half a character


def test_sentencepiece_words_keep_their_spaces_streamed_and_whole():
    ids = piece_ids("sentencepiece", ["▁have", "▁w", "121", "▁but"])
    tokenizer = SENTENCEPIECE_TOKENIZER
    assert tokenizer.encode("have w121 but", add_special_tokens=False) == ids
    assert tokenizer.decode(ids) == "have w121 but"
    assert [delta.text for delta in stream_all(TextStream(tokenizer), ids)] == ["have", " w", "121", " but", ""]
    # Decoded one token at a time, as `kvattn generate` printed them, every space is lost: a SentencePiece decoder
    # strips the space before a text's first word.
    assert "".join(tokenizer.decode([token]) for token in ids) == "havew121but"
    after_prompt = TextStream(tokenizer, prompt=tokenizer.encode("We"))
    assert [delta.text for delta in stream_all(after_prompt, ids)] == [" have", " w", "121", " but", ""]


def test_a_run_of_byte_pieces_shows_when_it_ends_since_a_later_byte_can_void_it():
    tokenizer = SENTENCEPIECE_TOKENIZER
    comma, continuation, but = piece_ids("sentencepiece", ["<0x2C>", "<0xA6>", "▁but"])
    # A run that is not UTF-8 decodes as one U+FFFD per byte, the comma's included: it cannot be shown early.
    assert tokenizer.decode([comma, continuation, but]) == "\ufffd\ufffd but"
    assert [delta.text for delta in stream_all(TextStream(tokenizer), [comma, continuation, but])] == \
        ["", "", "\ufffd\ufffd but", ""]
    ids = tokenizer.encode("日 but", add_special_tokens=False)
    assert ids[1:4] == piece_ids("sentencepiece", ["<0xE6>", "<0x97>", "<0xA5>"])
    assert [delta.text for delta in stream_all(TextStream(tokenizer), ids)] == ["", "", "", "", "日 but", ""]
    stream = TextStream(tokenizer)
    assert [stream.push(token).text for token in ids[:3]] == ["", "", ""]
    assert stream.finish() == TextDelta("\ufffd\ufffd", False)  # cut short, as decode shows it


def test_a_prompt_ending_in_a_long_byte_run_is_decoded_back_to_its_start():
    tokenizer = SENTENCEPIECE_TOKENIZER
    prompt = tokenizer.encode("so 日本語", add_special_tokens=False)
    assert len(prompt) > 9  # nine byte pieces end it, more than the few ids of context a stream starts from
    voiding = piece_ids("sentencepiece", ["<0x80>", "▁but"])
    want = text_after(tokenizer, prompt, voiding)
    assert want == "\ufffd" * 10 + " but"  # the stray byte voids the whole run, the prompt's characters with it
    assert "".join(delta.text for delta in stream_all(TextStream(tokenizer, prompt=prompt), voiding)) == want


@pytest.mark.parametrize("name", BOTH)
def test_a_stop_string_split_across_tokens_is_cut_and_never_shown(name):
    tokenizer = BOTH[name][1]
    ids = tokenizer.encode("have w121 but at the end", add_special_tokens=False)
    stream = TextStream(tokenizer, stop=["121 but", "never"])
    deltas = [stream.push(token) for token in ids]
    completes = next(k for k in range(len(ids)) if "121 but" in tokenizer.decode(ids[: k + 1]))
    assert "1" not in tokenizer.decode(ids[completes:completes + 1])  # the stop string spans tokens
    assert [delta.stopped for delta in deltas] == [k >= completes for k in range(len(ids))]
    assert "".join(delta.text for delta in deltas) == "have w"
    assert deltas[completes:] == [TextDelta("", True)] * (len(ids) - completes)
    assert stream.stopped and stream.finish() == TextDelta("", True)


@pytest.mark.parametrize("name", BOTH)
@settings(max_examples=40)
@given(data=st.data())
def test_stop_strings_cut_streamed_text_where_they_cut_the_whole_text(name, data):
    tokenizer = BOTH[name][1]
    ids = data.draw(id_sequences(name), label="ids")
    text = tokenizer.decode(ids)
    stops = data.draw(st.lists(st.text(min_size=1, max_size=3), max_size=1), label="stops")
    if text:  # mostly, stop strings that occur
        start = data.draw(st.integers(0, len(text) - 1), label="start")
        stops.append(text[start : start + data.draw(st.integers(1, 4), label="length")])
    stream = TextStream(tokenizer, stop=stops)
    deltas = []
    for token in ids:
        deltas.append(stream.push(token))
        if deltas[-1].stopped:
            break
    else:
        deltas.append(stream.finish())
    cut = first_stop(text, stops)
    assert "".join(delta.text for delta in deltas) == (text if cut is None else text[:cut])
    assert deltas[-1].stopped == (cut is not None) == stream.stopped


def test_stop_token_ids_are_never_shown_and_held_text_still_is():
    tokenizer = SENTENCEPIECE_TOKENIZER
    eos = SENTENCEPIECE_EXPECTED["special_tokens"]["</s>"]
    ids = tokenizer.encode("日", add_special_tokens=False) + [eos]
    deltas = stream_all(TextStream(tokenizer, stop_token_ids=[eos], skip_special_tokens=False), ids)
    assert [delta.text for delta in deltas] == ["", "", "", "", "", "日"]
    shown = stream_all(TextStream(tokenizer, skip_special_tokens=False), ids)
    assert "".join(delta.text for delta in shown) == "日</s>" == tokenizer.decode(ids, skip_special_tokens=False)


def test_a_finished_stream_takes_no_more():
    stream = TextStream(TOKENIZER, stop=["x"])
    stream.push(7)
    stream.finish()
    with pytest.raises(ValueError, match="this TextStream is finished; make a new one"):
        stream.push(7)
    with pytest.raises(ValueError, match="finished already"):
        stream.finish()
    with pytest.raises(ValueError, match="token id must be an integer"):
        TextStream(TOKENIZER).push(-1)
    with pytest.raises(ValueError, match="stop strings must be a list of non-empty strings"):
        TextStream(TOKENIZER, stop=[""])


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
    monkeypatch.setattr(tokenizer_module, "MAX_CONFIG_BYTES", 64)
    with pytest.raises(ValueError, match="tokenizer_config.json is larger than 64 bytes"):
        Tokenizer.from_directory(directory)
