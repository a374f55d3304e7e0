"""`kvattn serve` as a user runs it: a real process on loopback, driven by the `openai` client and raw HTTP.

One server for the module (started once: the first request would otherwise
carry the compilation), on the tiny chat checkpoint whose greedy
continuation transformers recorded. It decodes speculatively (prompt
lookup), so every exact-output test below also holds speculative rounds to
transformers' tokens; `tests/serving/test_server.py` covers the engine
without them. Tests run in file order; the last one stops the server with
SIGTERM under load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from kvattn.serving.openai import protocol
from tests.helpers import FIXTURES

CHECKPOINT = FIXTURES / "chat"
EXPECTED = json.loads((CHECKPOINT / "expected.json").read_text())
GREEDY = EXPECTED["greedy"]
MESSAGES = EXPECTED["chats"][GREEDY["chat"]]["messages"]
KEY = "sk-test"
MAX_LEN, BATCH, PAGE, MAX_WAITING = 192, 4, 8, 64
GREEDY_ARGS = dict(temperature=0, max_tokens=len(GREEDY["new_tokens"]), extra_body={"return_token_ids": True})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The checkpoint's template, behind a branch that never ends for one message, and one in the Hermes style for a
# conversation with tools, tool calls or tool results: the same text for every other.
RUNAWAY = "__loop__"
TOOLS_TEMPLATE = (
    "{{ bos_token }}<|system|>Tools:{% for t in tools or [] %} {{ t.function.name }}{% endfor %}<|end|>"
    "{% for m in messages %}<|{{ 'user' if m.role == 'tool' else m.role }}|>"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEMPLATE = (f"{{% if messages[-1].content == '{RUNAWAY}' %}}{{% for i in range(100000) %}}{{% for j in range(100000) %}}"
            "{% endfor %}{% endfor %}{% endif %}"
            "{% set ns = namespace(tools=tools is not none and tools | length > 0) %}"
            "{% for m in messages %}{% if m.role == 'tool' or m.tool_calls is defined %}{% set ns.tools = true %}"
            "{% endif %}{% endfor %}"
            f"{{% if ns.tools %}}{TOOLS_TEMPLATE}{{% else %}}"
            + json.loads((CHECKPOINT / "tokenizer_config.json").read_text())["chat_template"] + "{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    directory = tmp_path_factory.mktemp("serve")
    log = (directory / "stderr.txt").open("w+")
    (directory / "template.jinja").write_text(TEMPLATE)
    command = [str(Path(sys.executable).parent / "kvattn"), "serve", str(CHECKPOINT), "--port", str(port),
               "--chat-template", str(directory / "template.jinja"),
               "--max-len", str(MAX_LEN), "--max-batch", str(BATCH), "--page-size", str(PAGE), "--num-pages", "64",
               "--max-waiting", str(MAX_WAITING), "--api-key", KEY, "--shutdown-timeout", "1", "--speculative", "ngram:3"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=30).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    else:
        process.kill()
        process.wait()
        log.seek(0)
        pytest.fail(f"kvattn serve did not start: {log.read()[-2000:]}")
    yield process, url
    if process.poll() is None:
        process.kill()
        process.wait()
    log.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key=KEY, max_retries=0, timeout=60)


def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server[1]}/v1", api_key=KEY, max_retries=0, timeout=60)


def metrics(server) -> dict[str, float]:
    """The server's Prometheus samples by name (labels included)."""
    return _samples(httpx.get(f"{server[1]}/metrics", timeout=10).text)


def _samples(text: str) -> dict[str, float]:
    return {name: float(value) for name, value in re.findall(r"^(kvattn_\S+) (\S+)$", text, re.MULTILINE)}


def _finished(samples: dict[str, float]) -> float:
    """Requests the server has finished, whatever their reason."""
    return sum(value for name, value in samples.items() if name.startswith("kvattn_requests_total{"))


async def _until(http, holds, what: str, timeout: float = 30.0) -> None:
    """Polls the metrics (through the test's own async client) until `holds(samples)`; fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not holds(_samples((await http.get("/metrics")).text)):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        await asyncio.sleep(0.02)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["chat"]
    assert httpx.get(f"{server[1]}/health", timeout=30).json() == {"status": "ok"}
    assert httpx.get(f"{server[1]}/health", params={"deep": "true"}, timeout=30).json() == {"status": "ok"}


def test_chat_streaming_equals_whole_equals_transformers(client):
    whole = client.chat.completions.create(model="chat", messages=MESSAGES, **GREEDY_ARGS)
    assert whole.choices[0].token_ids == GREEDY["new_tokens"]
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(GREEDY["prompt"])
    assert whole.usage.completion_tokens == len(GREEDY["new_tokens"])
    chunks = list(client.chat.completions.create(model="chat", messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY_ARGS))
    streamed = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert streamed == GREEDY["new_tokens"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == len(GREEDY["new_tokens"])


def test_llm_and_serve_are_one_engine(client):
    """The offline face and the HTTP face, on the same settings: the same tokens and text, greedy and seeded."""
    import kvattn
    from kvattn.generation import PromptLookup, SamplingParams

    llm = kvattn.LLM(CHECKPOINT, max_len=MAX_LEN, max_batch=BATCH, page_size=PAGE, num_pages=64,
                     speculative=PromptLookup(3))
    prompts = ["The cache holds", "have w121 but at", "Hello"]
    for settings in (dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=11)):
        offline = llm.generate(prompts, SamplingParams(max_tokens=10, stop=["\n\n"], **settings), progress=False)
        for prompt, output in zip(prompts, offline):
            served = client.completions.create(model="chat", prompt=prompt, max_tokens=10, stop=["\n\n"],
                                               extra_body={"return_token_ids": True}, **settings).choices[0]
            assert served.token_ids == output.outputs[0].token_ids, (prompt, settings)
            assert served.text == output.outputs[0].text and served.finish_reason == output.outputs[0].finish_reason


def test_completions_of_token_ids_and_text(client):
    by_ids = client.completions.create(model="chat", prompt=GREEDY["prompt"], **GREEDY_ARGS)
    assert by_ids.choices[0].token_ids == GREEDY["new_tokens"]
    text = EXPECTED["texts"][0]
    by_text = client.completions.create(model="chat", prompt=text["text"], temperature=0, max_tokens=4)
    assert by_text.usage.prompt_tokens == len(text["ids"])  # encoded with the tokenizer's BOS


def test_n_choices_share_one_prefill(server, client):
    before = metrics(server)
    reply = client.chat.completions.create(model="chat", messages=MESSAGES, n=4, **GREEDY_ARGS)
    after = metrics(server)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert all(c.token_ids == GREEDY["new_tokens"] for c in reply.choices)
    admitted = after["kvattn_prompt_tokens_total"] - before["kvattn_prompt_tokens_total"]
    assert admitted == len(GREEDY["prompt"]), "the prompt is admitted once and forked, not four times"
    assert reply.usage.completion_tokens == 4 * len(GREEDY["new_tokens"])


def test_speculative_rounds_ran(server):
    """The greedy answers above went through verify rounds (this model's output never repeats, so its drafts
    are refused: `test_server.py` holds kept drafts to plain decoding)."""
    samples = metrics(server)
    drafted, kept = samples["kvattn_spec_draft_tokens_total"], samples["kvattn_spec_accepted_tokens_total"]
    assert drafted > 0 and 0 <= kept <= drafted


def test_stop_strings_end_the_text_before_them_across_tokens(client):
    full = client.chat.completions.create(model="chat", messages=MESSAGES, **GREEDY_ARGS).choices[0].message.content
    stop = full[5:9]  # four characters: in this byte-level BPE, more than one token's worth
    cut = full[: full.index(stop)]
    whole = client.chat.completions.create(model="chat", messages=MESSAGES, stop=[stop, "never"], **GREEDY_ARGS)
    assert whole.choices[0].message.content == cut and whole.choices[0].finish_reason == "stop"
    args = {**GREEDY_ARGS, "extra_body": {**GREEDY_ARGS["extra_body"], "include_stop_str_in_output": True}}
    kept = client.chat.completions.create(model="chat", messages=MESSAGES, stop=[stop, "never"], **args)
    assert kept.choices[0].message.content == cut + stop and kept.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="chat", messages=MESSAGES, stop=stop, stream=True, **GREEDY_ARGS) if c.choices]
    assert "".join(pieces) == cut and not any(stop in piece for piece in pieces)


def test_logprobs(client):
    reply = client.completions.create(model="chat", prompt=GREEDY["prompt"], logprobs=3, **GREEDY_ARGS)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(GREEDY["new_tokens"])
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        # Greedy takes the most likely (the legacy dict keeps one entry of tokens that print alike).
        assert 1 <= len(top) <= 3 and chosen >= max(top.values()) - 1e-6
    chat = client.chat.completions.create(model="chat", messages=MESSAGES, logprobs=True, top_logprobs=2,
                                          **GREEDY_ARGS)
    content = chat.choices[0].logprobs.content
    assert len(content) == len(GREEDY["new_tokens"]) and all(len(t.top_logprobs) == 2 for t in content)
    for token in content:
        assert token.logprob == token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob


def test_a_seed_reproduces_a_sample_whatever_else_runs(server, client):
    args = dict(model="chat", messages=MESSAGES, temperature=1.0, max_tokens=12, seed=1234,
                extra_body={"return_token_ids": True})
    alone = client.chat.completions.create(**args).choices[0].token_ids

    async def crowded():
        async with aclient(server) as ac:
            others = [ac.completions.create(model="chat", prompt=[7 + i] * (3 + i), temperature=1.0, max_tokens=10)
                      for i in range(5)]
            results = await asyncio.gather(ac.chat.completions.create(**args), *others)
            return results[0].choices[0].token_ids

    assert asyncio.run(crowded()) == alone
    other_seed = client.chat.completions.create(**{**args, "seed": 99}).choices[0].token_ids
    assert other_seed != alone


def test_64_concurrent_streams_each_get_their_own_greedy_output(server, client):
    prompts = [GREEDY["prompt"][: 8 + 6 * i] for i in range(4)]
    want = [client.completions.create(model="chat", prompt=p, temperature=0, max_tokens=12,
                                      extra_body={"return_token_ids": True}).choices[0].token_ids for p in prompts]

    async def one(ac, i):
        stream = await ac.completions.create(model="chat", prompt=prompts[i % 4], temperature=0, max_tokens=12,
                                             stream=True, extra_body={"return_token_ids": True})
        return [t async for chunk in stream for t in (chunk.choices[0].model_extra.get("token_ids") or [])]

    async def many():
        async with aclient(server) as ac:
            return await asyncio.wait_for(asyncio.gather(*(one(ac, i) for i in range(64))), timeout=120)

    assert asyncio.run(many()) == [want[i % 4] for i in range(64)]


def _idle(server) -> dict:
    """Metrics once nothing runs (the engine frees an aborted request before its next step)."""
    deadline = time.monotonic() + 10
    while True:
        values = metrics(server)
        if values["kvattn_requests_running"] == 0 and values["kvattn_requests_waiting"] == 0 or \
                time.monotonic() > deadline:
            return values
        time.sleep(0.05)


def test_54_clients_that_disconnect_cost_only_their_own_requests(server, client):
    rng = random.Random(0)
    want = client.completions.create(model="chat", prompt=GREEDY["prompt"], **GREEDY_ARGS).choices[0].token_ids
    body = {"model": "chat", "prompt": GREEDY["prompt"], "temperature": 0, "max_tokens": 100, "stream": True}

    async def leaver(http, chunks):
        async with http.stream("POST", "/v1/completions", json={**body, "prompt": GREEDY["prompt"][:chunks + 3]}) \
                as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data:")
                if seen > chunks:
                    return  # closes the connection mid-stream

    async def impatient(http):  # a whole (not streamed) answer, given up on before it comes
        # Only the wait for the answer is short: under load a 0.3 s connect or pool wait could give up
        # before the server ever saw the request, which would test nothing. The answer is 150 forced tokens,
        # 150 engine steps: well past the 0.1 s read however fast a step gets (100 tokens once came back
        # within 0.3 s, and there was nothing to give up on).
        long = {**body, "stream": False, "max_tokens": 150, "min_tokens": 150, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json=long, timeout=httpx.Timeout(30.0, read=0.1))

    async def stayer(ac):
        reply = await ac.completions.create(model="chat", prompt=GREEDY["prompt"], **GREEDY_ARGS)
        return reply.choices[0].token_ids

    async def crowd():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=server[1], headers=headers, timeout=60) as http, aclient(server) as ac:
            tasks = [leaver(http, rng.randrange(0, 20)) for _ in range(50)] + [impatient(http) for _ in range(4)]
            return await asyncio.wait_for(asyncio.gather(*tasks, *(stayer(ac) for _ in range(6))), timeout=120)

    results = asyncio.run(crowd())
    assert results[54:] == [want] * 6
    values = _idle(server)
    assert values["kvattn_requests_running"] == 0 and values["kvattn_requests_waiting"] == 0
    assert values["kvattn_pages_used"] == 0, "an aborted request kept its pages"
    assert values["kvattn_pages_free"] + values["kvattn_pages_cached"] == 63
    assert httpx.get(f"{server[1]}/health", timeout=30).status_code == 200  # runs the manager's check()


MALFORMED = [
    b"{", b"[]", b"null", b'"x"', b"{}", b'{"model": "chat"}', b'{"model": 3, "prompt": "a"}',
    b'{"model": "chat", "prompt": "a", "max_tokens": "4"}', b'{"model": "chat", "prompt": "a", "max_tokens": 0}',
    b'{"model": "chat", "prompt": "a", "max_tokens": 1e400}', b'{"model": "chat", "prompt": "a", "max_tokens": true}',
    b'{"model": "chat", "prompt": "a", "temperature": -1}', b'{"model": "chat", "prompt": "a", "temperature": NaN}',
    b'{"model": "chat", "prompt": "a", "top_p": 0}', b'{"model": "chat", "prompt": "a", "top_k": 100000}',
    b'{"model": "chat", "prompt": [1, -1]}', b'{"model": "chat", "prompt": [1, 384]}', b'{"model": "chat", "prompt": []}',
    b'{"model": "chat", "prompt": [1.5]}', b'{"model": "chat", "prompt": ["a", [1]]}',
    b'{"model": "chat", "prompt": [[1], []]}', b'{"model": "chat", "prompt": [[1], [384]]}',
    b'{"model": "chat", "prompt": "a", "n": 2, "best_of": 1}',
    b'{"model": "chat", "prompt": "a", "best_of": 2, "stream": true}',
    b'{"model": "chat", "prompt": "a", "echo": true, "logprobs": 1}',
    b'{"model": "chat", "prompt": ["a", "b", "c"], "best_of": 100}',
    b'{"model": "chat", "prompt": "a", "n": 0}', b'{"model": "chat", "prompt": "a", "n": 5}',
    b'{"model": "chat", "prompt": "a", "stop": [""]}', b'{"model": "chat", "prompt": "a", "seed": -3}',
    b'{"model": "chat", "prompt": "a", "logprobs": 99}', b'{"model": "chat", "prompt": "a", "max_tokens": 100000}',
    b'{"model": "chat", "prompt": "a", "stream": "yes"}', b'{"model": "chat", "prompt": "a", "echo": 1}',
    b'{"model": "chat", "prompt": "a", "presence_penalty": 3}', b'{"model": "chat", "prompt": "a", "logit_bias": {"x": 5}}',
    b'{"model": "chat", "prompt": "a", "logit_bias": {"1": 500}}', b'{"model": "chat", "prompt": "a", "logit_bias": {"384": 1}}',
    b'{"model": "chat", "prompt": "a", "min_tokens": -1}', b'{"model": "chat", "prompt": "a", "max_tokens": 2, "min_tokens": 3}',
    b'{"model": "chat", "prompt": "a", "min_p": 2}', b'{"model": "chat", "prompt": "a", "repetition_penalty": 0}',
    b'{"model": "chat", "prompt": "a", "response_format": {"type": "json_schema"}}',
    b'{"model": "chat", "prompt": "a", "response_format": {"type": "xml"}}',
    b'{"model": "chat", "prompt": "a", "structured_outputs": {}}',
    b'{"model": "chat", "prompt": "a", "structured_outputs": {"regex": "(a"}}',
    b'{"model": "chat", "prompt": "a", "structured_outputs": {"json": {"type": "strin"}}}',
    b'{"model": "chat", "prompt": "a", "structured_outputs": {"choice": []}}',
    b'{"model": "chat", "prompt": "a", "structured_outputs": {"regex": "a", "choice": ["a"]}}',
    b'{"model": "chat", "prompt": "a", "guided_regex": "a", "response_format": {"type": "json_object"}}',
    b'{"model": "chat", "prompt": "a", "guided_grammar": "x y z"}',
    b'{"model": "chat", "prompt": "a", "guided_json": "{not json"}',
    b'{"model": "other", "prompt": "a"}', b'{"model": "chat", "prompt": "a", "stream_options": {"include_usage": true}}',
    b'{"model": "chat", "prompt": "a", "stop_token_ids": [999]}', b'{"model": "chat", "prompt": "a", "allowed_token_ids": []}',
    b'{"model": "chat", "prompt": "a", "allowed_token_ids": [999]}',
    b'{"model": "chat", "prompt": "a", "truncate_prompt_tokens": -2}',
    b'{"model": "chat", "prompt": "a", "truncate_prompt_tokens": -1, "max_tokens": 100000}', b'\xff\xfe', b'{"model": "chat", "prompt": "\\ud800"}',
]
CHAT_MALFORMED = [
    b'{"model": "chat"}', b'{"model": "chat", "messages": []}', b'{"model": "chat", "messages": [{"role": "user"}]}',
    b'{"model": "chat", "messages": [{"role": "robot", "content": "x"}]}',
    b'{"model": "chat", "messages": [{"role": "user", "content": 5}]}',
    b'{"model": "chat", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
    b'{"model": "chat", "messages": "hi"}',
    b'{"model": "chat", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}',
    b'{"model": "chat", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}',
    b'{"model": "chat", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
    b'{"model": "chat", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
    b'"function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}',
    b'{"model": "chat", "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": true, '
    b'"continue_final_message": true}',
    b'{"model": "chat", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}}',
]


def _mutations(rng: random.Random, count: int):
    """Random bodies: valid ones with a field replaced, dropped, or bytes cut or flipped."""
    values = [None, -1, 0, 2**70, 1e308, -1e308, "", "x" * 300, [], {}, [None], True, 0.5, "\u0000", [[1]]]
    fields = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "logprobs",
              "stream", "messages", "stop_token_ids", "ignore_eos", "user", "return_token_ids", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "min_p", "response_format",
              "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "echo",
              "best_of", "tools", "tool_choice", "chat_template_kwargs", "parallel_tool_calls", "top_logprobs",
              "add_generation_prompt", "continue_final_message", "allowed_token_ids", "truncate_prompt_tokens",
              "return_tokens_as_token_ids"]
    for _ in range(count):
        chat = rng.random() < 0.5
        body = ({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} if chat
                else {"model": "chat", "prompt": "hi", "max_tokens": 2})
        body[rng.choice(fields)] = rng.choice(values)
        data = json.dumps(body).encode()
        if rng.random() < 0.3:
            cut = rng.randrange(len(data))
            data = data[:cut] + bytes([rng.randrange(256)]) + data[cut + 1:]
        yield ("/v1/chat/completions" if chat else "/v1/completions"), data


def test_malformed_requests_get_4xx_never_5xx(server, client):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    cases = [("/v1/completions", body) for body in MALFORMED] + [("/v1/chat/completions", b) for b in CHAT_MALFORMED]
    cases += list(_mutations(random.Random(0), 300))
    statuses = []
    with httpx.Client(base_url=server[1], timeout=60) as http:
        for path, body in cases:
            response = http.post(path, content=body, headers=headers)
            statuses.append(response.status_code)
            assert response.status_code < 500, (body, response.text)
            if response.status_code >= 400:
                assert set(response.json()["error"]) >= {"message", "type"}
        for method, path, want in [("GET", "/v1/completions", 405), ("POST", "/v2/x", 404), ("GET", "/nothing", 404)]:
            assert http.request(method, path, headers=headers).status_code == want
        assert http.post("/v1/completions", content=b"{}", headers={**headers, "Authorization": "Bearer no"}
                         ).status_code == 401
        big = b'{"model": "chat", "prompt": "' + b"a" * (5 * 2**20) + b'"}'
        for content in (big, iter([big[: 2**20], big[2**20 :]])):  # declared by Content-Length, then chunked
            response = http.post("/v1/completions", content=content, headers=headers)
            assert response.status_code == 413 and "over 4194304 bytes" in response.json()["error"]["message"], \
                response.text
        for body in (b'{"model": "\\ud800", "prompt": "a"}', b'{"model": "chat", "prompt": "\\udfff"}',
                     b'{"model": "chat", "messages": [{"role": "user", "content": "a\\ud800"}]}'):
            path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
            response = http.post(path, content=body, headers=headers)
            assert response.status_code == 400 and "unpaired UTF-16 surrogate" in response.json()["error"]["message"]
    refused = sum(s >= 400 for s in statuses)
    print(f"\nmalformed-request fuzz: {len(cases)} requests, {refused} refused with 4xx, 0 with 5xx")
    known = len(MALFORMED) + len(CHAT_MALFORMED)
    accepted = [body for (_, body), status in zip(cases[:known], statuses[:known], strict=True) if status not in (400, 404)]
    assert accepted == [], "each hand-written case is refused"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="a", max_tokens=1)
    assert client.completions.create(model="chat", prompt="a", max_tokens=2).usage.completion_tokens == 2


def test_a_full_queue_answers_429_with_retry_after(server):
    body = {"model": "chat", "prompt": GREEDY["prompt"], "temperature": 0, "max_tokens": 60, "ignore_eos": True}

    async def flood():
        async with httpx.AsyncClient(base_url=server[1], headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=120) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(BATCH + MAX_WAITING
                                                                                                 + 24)))

    responses = asyncio.run(flood())
    statuses = sorted({r.status_code for r in responses})
    assert statuses == [200, 429]
    assert all(r.headers["retry-after"] == "1" for r in responses if r.status_code == 429)
    assert all(r.json()["usage"]["completion_tokens"] == 60 for r in responses if r.status_code == 200)


def _longest_gap(url: str, during) -> tuple[float, object]:
    """The longest wait between streamed events while `during(http)` runs (streams one after another, so some
    stream is always running), and what `during` returned."""
    body = {"model": "chat", "prompt": GREEDY["prompt"], "temperature": 0, "max_tokens": 120, "stream": True,
            "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            started, done, gaps, last = asyncio.Event(), asyncio.Event(), [], None

            async def streams():
                nonlocal last
                while not done.is_set():
                    async with http.stream("POST", "/v1/completions", json=body) as response:
                        async for line in response.aiter_lines():  # to its end: the gap across a stall counts
                            if not line.startswith("data:"):
                                continue
                            now = time.perf_counter()
                            if last is not None:
                                gaps.append(now - last)
                            last = now
                            started.set()

            task = asyncio.create_task(streams())
            await started.wait()
            result = await during(http)
            done.set()
            await task
            return max(gaps), result

    return asyncio.run(run())


def test_a_huge_prompt_is_tokenized_off_the_event_loop(server):
    """A 3.9 MB prompt (under the body limit) is refused for its length; meanwhile another stream keeps going."""
    prompt = "hello world, " * 300_000  # 3.9 MB: seconds of tokenizing

    async def huge(http):
        return await http.post("/v1/completions", json={"model": "chat", "prompt": prompt, "max_tokens": 1})

    gap, response = _longest_gap(server[1], huge)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert gap < 0.5, f"a stream waited {gap:.2f} s while a prompt was tokenized"


# Request fields of OpenAI's API reference and vLLM's protocol (2026-12): each is honoured or refused.
OPENAI_AND_VLLM_FIELDS = """
model prompt messages best_of echo frequency_penalty logit_bias logprobs max_tokens max_completion_tokens n
presence_penalty seed stop stream stream_options suffix temperature top_p top_logprobs user audio function_call
functions metadata modalities parallel_tool_calls prediction reasoning_effort response_format service_tier store
tool_choice tools web_search_options verbosity prompt_cache_key safety_identifier
use_beam_search top_k min_p repetition_penalty length_penalty stop_token_ids include_stop_str_in_output ignore_eos
min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens allowed_token_ids
prompt_logprobs bad_words add_generation_prompt continue_final_message add_special_tokens documents chat_template
chat_template_kwargs mm_processor_kwargs guided_json guided_regex guided_choice guided_grammar structural_tag
guided_decoding_backend guided_whitespace_pattern structured_outputs priority request_id logits_processors
return_tokens_as_token_ids return_token_ids cache_salt kv_transfer_params vllm_xargs
""".split()


def test_every_openai_and_vllm_field_is_honoured_or_refused_never_ignored(server, client):
    endpoints = (protocol.CompletionRequest, protocol.ChatRequest)
    known = set(protocol.IGNORED).union(*(e.model_fields for e in endpoints), *(e.not_implemented() for e in endpoints))
    unknown = [f for f in OPENAI_AND_VLLM_FIELDS if f not in known]
    assert not unknown, f"neither honoured nor refused: {unknown}"
    headers = {"Authorization": f"Bearer {KEY}"}
    base = {"model": "chat", "prompt": "a", "max_tokens": 2}
    with httpx.Client(base_url=server[1], headers=headers, timeout=60) as http:
        for name, neutral in protocol.CompletionRequest.not_implemented().items():
            response = http.post("/v1/completions", json={**base, name: 12345})
            assert response.status_code == 400 and name in response.json()["error"]["message"], (name, response.text)
            for value in (None, *neutral):
                response = http.post("/v1/completions", json={**base, name: value})
                assert response.status_code == 200, (name, value, response.text)
        nulls = dict.fromkeys(["n", "stream", "echo", "presence_penalty", "frequency_penalty", "logit_bias",
                               "logprobs", "temperature", "top_p", "seed", "stop", "stream_options", "suffix",
                               "best_of", "user"])
        reply = http.post("/v1/completions", json={**base, **nulls})
        assert reply.status_code == 200 and len(reply.json()["choices"]) == 1, reply.text
        chat = http.post("/v1/chat/completions", json={"model": "chat", "messages": MESSAGES, "max_tokens": 2,
                                                       "logprobs": None, "top_logprobs": None, "n": None})
        assert chat.status_code == 200, chat.text
    table = Path(__file__).parents[2] / "docs" / "guide" / "serve.md"
    shown = table.read_text().split("<!-- fields -->\n")[1].split("\n<!-- /fields -->")[0]
    assert shown == protocol.field_table(), "docs/guide/serve.md's field table is stale: paste protocol.field_table()"


def test_tokenize_and_detokenize_as_vllm_shapes_them(server, client):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server[1], headers=headers, timeout=60) as http:
        text = "hello wörld"
        tokens = http.post("/tokenize", json={"model": "chat", "prompt": text, "return_token_strs": True}).json()
        assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) and tokens["max_model_len"] == MAX_LEN
        used = client.completions.create(model="chat", prompt=text, max_tokens=1).usage.prompt_tokens
        assert used == tokens["count"]
        plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": plain}).json() == {"prompt": text}
        chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
        assert chat["count"] == client.chat.completions.create(model="chat", messages=MESSAGES,
                                                               max_tokens=1).usage.prompt_tokens
        for path, body, status in [("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400),
                                   ("/tokenize", {"model": "other", "prompt": "a"}, 404),
                                   ("/detokenize", {"tokens": [10**6]}, 400), ("/detokenize", {"tokens": [-1]}, 400)]:
            assert http.post(path, json=body).status_code == status, (path, body)


def test_a_runaway_chat_template_fails_its_request_alone(server):
    """A template that would loop for ever on one conversation: that request gets a 400 after the template's
    time bound, while streams go on and the next chat renders as before."""
    async def runaway(http):
        return await http.post("/v1/chat/completions", json={"model": "chat", "max_tokens": 1,
                                                              "messages": [{"role": "user", "content": RUNAWAY}]})

    gap, response = _longest_gap(server[1], runaway)
    assert response.status_code == 400 and "the chat template ran past" in response.json()["error"]["message"]
    assert gap < 0.5, f"a stream waited {gap:.2f} s while a template ran away"


def test_liveness_answers_at_once_under_load(server):
    """`/health` never queues behind generation, nor fails for a full queue: a busy server is alive."""
    body = {"model": "chat", "prompt": GREEDY["prompt"], "temperature": 0, "max_tokens": 60, "ignore_eos": True}

    async def flood_and_probe():
        async with httpx.AsyncClient(base_url=server[1], headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=120) as http:
            tasks = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(BATCH + MAX_WAITING)]
            await _until(http, lambda m: m["kvattn_requests_waiting"] >= MAX_WAITING // 2, "half the queue full")
            times = []
            for _ in range(5):
                start = time.perf_counter()
                assert (await http.get("/health")).json() == {"status": "ok"}
                times.append(time.perf_counter() - start)
            await asyncio.gather(*tasks)
            return times

    times = asyncio.run(flood_and_probe())
    assert max(times) < 0.5, f"/health took {max(times):.2f} s under load"


def test_a_client_that_leaves_a_whole_answer_stops_its_generation(server):
    """Non-streamed answers given up on after 0.5 s are aborted even while they produce tokens (queued ones always
    were), and the metrics see the freed pages at once, with no later request to step the engine."""
    count, new_tokens = 16, 150  # four rounds of the batch: some request is mid-answer whenever its client is checked
    body = {"model": "chat", "prompt": GREEDY["prompt"], "temperature": 0, "max_tokens": new_tokens, "ignore_eos": True}
    finished, generated = 'kvattn_requests_total{finish_reason="length"}', "kvattn_generation_tokens_total"
    before = metrics(server)

    async def impatient(http):
        with contextlib.suppress(httpx.ReadTimeout):  # the first few may finish within the 0.5 s
            await http.post("/v1/completions", json=body, timeout=httpx.Timeout(30.0, read=0.5))

    async def leave():
        async with httpx.AsyncClient(base_url=server[1], headers={"Authorization": f"Bearer {KEY}"}) as http:
            await asyncio.gather(*(impatient(http) for _ in range(count)))

    asyncio.run(leave())
    left = time.monotonic()
    values = _idle(server)
    assert time.monotonic() - left < 3, "the aborted requests ran on"
    assert values["kvattn_requests_running"] == 0 and values["kvattn_pages_used"] == 0
    done = values.get(finished, 0) - before.get(finished, 0)
    tokens = values[generated] - before[generated]
    print(f"\n{count} whole answers left after 0.5 s: {done:.0f} finished, {tokens:.0f} of {count * new_tokens} tokens")
    assert tokens > done * new_tokens, "no request was aborted while it produced tokens"
    assert tokens < count * new_tokens


def test_logprob_text_offsets_stay_inside_the_text_when_special_tokens_come(client):
    """A special token adds its string to `tokens` but nothing to the text: offsets never run past the text."""
    reply = client.completions.create(model="chat", prompt=GREEDY["prompt"], temperature=1.5, seed=3, n=2,
                                      max_tokens=120, logprobs=0, extra_body={"ignore_eos": True})
    shown = client.completions.create(model="chat", prompt=GREEDY["prompt"], temperature=1.5, seed=3, n=2,
                                      max_tokens=120, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert [c.text for c in shown.choices] != [c.text for c in reply.choices]  # the same tokens, specials shown
    assert any("<|" in c.text for c in shown.choices) and not any("<|" in c.text for c in reply.choices)
    specials = 0
    for choice in reply.choices:
        offsets, tokens = choice.logprobs.text_offset, choice.logprobs.tokens
        assert offsets == sorted(offsets) and all(0 <= o <= len(choice.text) for o in offsets)
        specials += sum(not choice.text.startswith(token, offset) for token, offset in zip(tokens, offsets))
    assert specials, "no special token was sampled: the test checks nothing"


def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema whose documents are short: bounded strings, integers and arrays, closed objects."""
    kinds = ["string", "integer", "boolean", "enum", "array"] + (["object"] if depth < 1 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 4)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", 3, None, True, "ü"], rng.randint(1, 3))}
    if kind == "array":
        return {"type": "array", "items": _random_schema(rng, depth + 1), "maxItems": rng.randint(0, 2)}
    names = rng.sample(["id", "name", "ok", "tags", "x"], rng.randint(1, 3))
    return {"type": "object", "properties": {n: _random_schema(rng, depth + 1) for n in names},
            "required": names, "additionalProperties": False}


def test_structured_outputs_match_their_schemas_and_patterns(server):
    """Random schemas and seeds, sampled at temperature 1 with speculation on: every output parses and validates."""
    import jsonschema

    rng = random.Random(7)
    schemas = [{"type": "object", "properties": {"answer": _random_schema(rng)}, "required": ["answer"],
                "additionalProperties": False} for _ in range(12)] + [_random_schema(rng) for _ in range(4)]
    regex, choice = r"[a-c]{2,4}-\d", ["yes", "no", "maybe so"]
    grammar = 'start: "(" item ("," item)* ")"\nitem: /[0-9]/ | "x"'

    async def run():
        async with aclient(server) as api:
            def ask(index, **fields):
                return api.completions.create(model="chat", prompt="Answer: ", max_tokens=150, temperature=1.0,
                                              seed=index, **fields)
            return await asyncio.gather(
                *(ask(i, extra_body={"response_format": {"type": "json_schema", "json_schema": {
                    "name": f"s{i}", "schema": schema}}}) for i, schema in enumerate(schemas)),
                ask(90, extra_body={"response_format": {"type": "json_object"}}),
                ask(91, extra_body={"structured_outputs": {"regex": regex}}),
                ask(92, extra_body={"guided_choice": choice}),
                ask(93, extra_body={"structured_outputs": {"grammar": grammar}}),
                ask(94, extra_body={"guided_json": schemas[0]}))

    replies = asyncio.run(run())
    for schema, reply in zip(schemas, replies, strict=False):
        text = reply.choices[0].text
        assert reply.choices[0].finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    any_object = replies[len(schemas)].choices[0]  # unbounded: a random model may run out of tokens inside it
    assert isinstance(json.loads(any_object.text), dict) if any_object.finish_reason == "stop" else \
        any_object.text.startswith("{")
    assert re.fullmatch(regex, replies[-4].choices[0].text)
    assert replies[-3].choices[0].text in choice
    assert re.fullmatch(r"\([0-9x](,[0-9x])*\)", replies[-2].choices[0].text)
    jsonschema.validate(json.loads(replies[-1].choices[0].text), schemas[0])


def test_chat_structured_outputs_through_the_openai_client(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 3}},
              "required": ["city", "rank"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model="chat", messages=MESSAGES, max_tokens=100, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    import jsonschema

    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    streamed = client.chat.completions.create(
        model="chat", messages=MESSAGES, max_tokens=100, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == reply.choices[0].message.content


def test_penalties_biases_and_min_tokens_change_the_output_as_asked(client):
    plain = GREEDY["new_tokens"]
    forced = client.completions.create(model="chat", prompt=GREEDY["prompt"], max_tokens=6, temperature=0,
                                       logit_bias={"77": 100}, extra_body={"return_token_ids": True})
    assert forced.choices[0].token_ids == [77] * 6
    banned = {str(t): -100 for t in set(plain[:4])}
    avoided = client.completions.create(model="chat", prompt=GREEDY["prompt"], max_tokens=8, temperature=0,
                                        logit_bias=banned, extra_body={"return_token_ids": True})
    assert not set(avoided.choices[0].token_ids) & set(plain[:4])
    stop_at_first = dict(stop_token_ids=[plain[0]], return_token_ids=True, ignore_eos=True)
    short = client.completions.create(model="chat", prompt=GREEDY["prompt"], max_tokens=12, temperature=0,
                                      extra_body=stop_at_first)
    assert short.choices[0].token_ids == plain[:1]
    held = client.completions.create(model="chat", prompt=GREEDY["prompt"], max_tokens=12, temperature=0,
                                     extra_body={**stop_at_first, "min_tokens": 5})
    assert len(held.choices[0].token_ids) >= 5 and plain[0] not in held.choices[0].token_ids[:5]
    # Three tokens favoured so that greedy decoding repeats them; each penalty makes it repeat them less.
    def repeats(**fields) -> tuple[list[int], int]:
        reply = client.completions.create(model="chat", prompt=GREEDY["prompt"], max_tokens=12, temperature=0,
                                          logit_bias={"77": 8, "78": 8, "79": 8}, **fields)
        tokens = reply.choices[0].model_extra["token_ids"]
        return tokens, max(tokens.count(t) for t in tokens)

    favoured, most = repeats(extra_body={"return_token_ids": True})
    assert most >= 4, favoured
    for fields in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 3.0}):
        tokens, count = repeats(**{k: v for k, v in fields.items() if k != "repetition_penalty"},
                                extra_body={"return_token_ids": True, **{k: v for k, v in fields.items()
                                                                         if k == "repetition_penalty"}})
        assert tokens != favoured and count < most, (fields, tokens, favoured)



WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_tool_calls_named_required_and_auto_with_a_tool_result_sent_back(client):
    import jsonschema

    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
    ask = dict(model="chat", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER, TIME],
               max_tokens=80, temperature=0)
    named = client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_weather"])
    chunks = list(client.chat.completions.create(
        **ask, stream=True, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert deltas[0].function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"
    for parallel in (True, False):
        required = client.chat.completions.create(**dict(ask, temperature=1.0), tool_choice="required",
                                                  parallel_tool_calls=parallel, seed=5)
        calls = required.choices[0].message.tool_calls
        assert calls and (parallel or len(calls) == 1) and required.choices[0].finish_reason == "tool_calls"
        for made in calls:
            jsonschema.validate(json.loads(made.function.arguments), schemas[made.function.name])
    # auto: the model's own text, parsed for Hermes <tool_call> blocks (here its text is made one by a regex)
    hermes = r'Checking\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
    auto = dict(ask, tool_choice="auto", extra_body={"structured_outputs": {"regex": hermes}})
    made = client.chat.completions.create(**auto)
    assert made.choices[0].message.content == "Checking. " and made.choices[0].finish_reason == "tool_calls"
    [call] = made.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    chunks = list(client.chat.completions.create(**auto, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Checking. "
    [streamed] = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert streamed.function.arguments == call.function.arguments
    plain = client.chat.completions.create(**dict(ask, tool_choice="none"))
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")
    back = ask["messages"] + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                              {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 3}'}]
    answer = client.chat.completions.create(**dict(ask, messages=back, max_tokens=4))
    assert answer.choices[0].message.content is not None and answer.usage.prompt_tokens > named.usage.prompt_tokens


def test_chat_template_options(client):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The cache"}]
    continued = client.chat.completions.create(model="chat", messages=messages, max_tokens=4, temperature=0,
                                               extra_body={"add_generation_prompt": False,
                                                           "continue_final_message": True, "return_token_ids": True})
    assert continued.usage.prompt_tokens < client.chat.completions.create(
        model="chat", messages=messages, max_tokens=1).usage.prompt_tokens  # no end of turn, no new header
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        client.chat.completions.create(model="chat", messages=messages, max_tokens=1,
                                       extra_body={"continue_final_message": True})
    with pytest.raises(openai.BadRequestError, match="cannot set messages"):
        client.chat.completions.create(model="chat", messages=messages, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"messages": []}})
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model="chat", messages=messages, max_tokens=1, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


def test_batched_prompts_equal_single_ones_with_echo_and_best_of(client):
    texts = ["The cache", "Hello there", "a"]
    greedy = dict(model="chat", max_tokens=5, temperature=0, extra_body={"return_token_ids": True})
    batch = client.completions.create(prompt=texts, **greedy)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    singles = [client.completions.create(prompt=text, **greedy) for text in texts]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    ids = [GREEDY["prompt"], GREEDY["prompt"][:5]]
    sampled = client.completions.create(model="chat", prompt=ids, n=2, max_tokens=4, temperature=1.0, seed=3)
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3]
    alone = client.completions.create(model="chat", prompt=ids[1], n=2, max_tokens=4, temperature=1.0, seed=3)
    assert [c.text for c in sampled.choices[2:]] == [c.text for c in alone.choices]
    echoed = client.completions.create(prompt=texts[:2], echo=True, **greedy)
    assert [c.text for c in echoed.choices] == [t + c.text for t, c in zip(texts[:2], batch.choices[:2])]
    streamed = client.completions.create(prompt=texts[0], echo=True, stream=True, **greedy)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text
    # best_of: of the 4 completions n=4 makes with this seed, the 2 of highest total log-probability
    four = client.completions.create(model="chat", prompt=texts[1], n=4, max_tokens=6, temperature=1.0, seed=9, logprobs=0)
    ranked = sorted(four.choices, key=lambda c: -sum(c.logprobs.token_logprobs))[:2]
    best = client.completions.create(model="chat", prompt=texts[1], n=2, best_of=4, max_tokens=6, temperature=1.0, seed=9)
    assert [c.text for c in best.choices] == [c.text for c in sorted(ranked, key=lambda c: c.index)]
    assert best.usage.completion_tokens == four.usage.completion_tokens



def test_allowed_token_ids_truncation_and_token_ids_as_names(client):
    allowed = [40, 41, 42, 43]
    sampled = client.completions.create(model="chat", prompt="a", max_tokens=12, temperature=1.0, seed=4,
                                        extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    assert set(sampled.choices[0].token_ids) <= set(allowed)
    prompt = GREEDY["prompt"]
    cut = client.completions.create(model="chat", prompt=prompt + [7] * 300, max_tokens=4, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 20, "return_token_ids": True})
    tail = client.completions.create(model="chat", prompt=(prompt + [7] * 300)[-20:], max_tokens=4, temperature=0,
                                     extra_body={"return_token_ids": True})
    assert cut.usage.prompt_tokens == 20 and cut.choices[0].token_ids == tail.choices[0].token_ids
    named = client.completions.create(model="chat", prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                      extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = named.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{i}" for i in choice.token_ids]
    assert all(name.startswith("token_id:") for top in choice.logprobs.top_logprobs for name in top)



def test_sigterm_under_load_finishes_or_ends_each_request_cleanly_and_exits_0(server):
    """Admission stops; what runs gets the deadline (1 s here); what is left then ends with a clear error."""
    process, url = server
    body = {"model": "chat", "prompt": GREEDY["prompt"], "temperature": 0, "max_tokens": 150, "stream": True,
            "ignore_eos": True}

    async def one(http):
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:  # still queued at the deadline: never started
                return response.status_code, [await response.aread()]
            return 200, [line[5:].strip() async for line in response.aiter_lines() if line.startswith("data:")]

    async def load():
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            before = _finished(metrics(server))
            tasks = [asyncio.create_task(one(http)) for _ in range(12)]
            # Every request in the server: running, waiting, or already finished (a fast one may be).
            await _until(http, lambda m: m["kvattn_requests_running"] + m["kvattn_requests_waiting"]
                         + _finished(m) - before >= 12, "the 12 requests in the server")
            process.send_signal(signal.SIGTERM)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)

    outcomes = asyncio.run(load())
    for status, events in outcomes:
        if status != 200:
            assert status == 503 and "shutting down" in json.loads(events[0])["error"]["message"]
            continue
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        if "error" in last:  # ran past the deadline: told so
            assert "shutting down" in last["error"]["message"]
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert any(status == 200 for status, _ in outcomes)
    assert process.wait(timeout=30) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=5)
