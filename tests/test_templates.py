"""`kvattn.templates`: chat templates rendered in child processes, bounded in time, output and memory."""

from __future__ import annotations

import resource
import time

import pytest

from kvattn.serving.tokenizer import Tokenizer
from kvattn.templates import TemplateProcesses
from tests.helpers import FIXTURES

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "and?"}]
BOUNDS = dict(seconds=1.0, max_chars=10_000, memory_bytes=512 << 20, processes=2)


def test_a_bounded_render_equals_the_render_in_this_process():
    tokenizer = Tokenizer.from_directory(FIXTURES / "chat")
    here = [tokenizer.render_chat(MESSAGES), tokenizer.render_chat(MESSAGES[:2], add_generation_prompt=False)]
    tokenizer.bound_rendering(**BOUNDS)
    assert [tokenizer.render_chat(MESSAGES), tokenizer.render_chat(MESSAGES[:2], add_generation_prompt=False)] == here
    with pytest.raises(ValueError, match="must be an object with a string role"):
        tokenizer.render_chat([{"role": "user"}])  # checked before any child sees it
    tokenizer.close()


def test_a_runaway_template_fails_its_render_in_time_and_the_next_render_works():
    template = ("{% if messages[0].content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
                "{% endfor %}{% endfor %}{% endif %}{{ messages[0].content }}")
    processes = TemplateProcesses(template, **BOUNDS)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="ran past 1.0 s"):
        processes.render({"messages": [{"role": "user", "content": "loop"}]})
    assert time.perf_counter() - start < 5
    assert processes.render({"messages": [{"role": "user", "content": "fine"}]}) == "fine"
    processes.close()


@pytest.mark.parametrize("template, words", [
    ("{{ messages[0].content * 1000000000 }}", "bytes of memory"),  # one expression: the child's memory limit
    ("{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}", "passed 10000 characters"),
    ("{{ raise_exception('no ' + messages[0].content) }}", "TemplateError: no thanks"),
])
def test_a_template_that_builds_too_much_or_raises_fails_its_request_alone(template, words):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    processes = TemplateProcesses(template, **BOUNDS)
    with pytest.raises(ValueError, match=words):
        processes.render({"messages": [{"role": "user", "content": "thanks"}]})
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100_000  # KiB: nothing big came back here
    processes.close()
