"""Chat templates: compiled in a sandbox as transformers builds it, and rendered bounded in time, output and memory.

`compile_template` gives the jinja2 environment of transformers'
`apply_chat_template` (sandboxed and immutable, with its filters and
globals), so a template from the Hub renders the same text here as there;
`conversation` checks the messages it is given. `TemplateProcesses` renders
one template in child processes that a runaway template cannot take down
with it: past `seconds` the child is killed and replaced, its output is cut
at `max_chars`, and its address space is capped at `memory_bytes`. Each
failure is a `ValueError` for the one request. A leaf: it imports jinja2
and the standard library only, so a child starts in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import threading
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils

__all__ = ["TemplateProcesses", "compile_template", "conversation", "plain"]


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Unlike jinja2's own tojson, no HTML escaping: the output is a prompt, not a web page.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's `namespace()`, refusing underscore-prefixed names so a template cannot reach Python internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold an underscore-prefixed name, got {name!r}")


def compile_template(source: str) -> jinja2.Template:
    """A chat template compiled in a sandbox that refuses unsafe attributes and any mutation of its inputs."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                               extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace)
    try:
        return environment.from_string(source)
    except jinja2.TemplateError as error:
        raise ValueError(f"the chat template does not compile: {error}") from error


def plain(value, where: str):
    """A copy of JSON-shaped data (string-keyed dicts, lists, strings, numbers, bools, None), refusing anything else.

    The template sees only these, so no object with methods of its own ever reaches the sandbox.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: plain(item, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item, f"{where}[{index}]") for index, item in enumerate(value)]
    raise ValueError(f"{where} must be JSON data (strings, numbers, lists, objects), got {type(value).__name__}")


def conversation(messages) -> list[dict]:
    """The messages as plain dicts, each with a string `role` and `content` (an assistant's message with
    `tool_calls` may have none); keys set to None are dropped."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{role, content}} objects, got {messages!r:.80}")
    checked = []
    for index, message in enumerate(messages):
        calls = isinstance(message, dict) and message.get("tool_calls") and message.get("content") is None
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and (isinstance(message.get("content"), str) or calls)):
            raise ValueError(f"messages[{index}] must be an object with a string role and content, got {message!r:.80}")
        checked.append(plain({key: item for key, item in message.items() if item is not None}, f"messages[{index}]"))
    return checked


def render(template: jinja2.Template, variables: dict, max_chars: int) -> str:
    """`template` rendered with `variables`, chunk by chunk, refusing output past `max_chars` characters."""
    pieces, size = [], 0
    for piece in template.generate(**variables):
        size += len(piece)
        if size > max_chars:
            raise ValueError(f"the chat template's output passed {max_chars} characters")
        pieces.append(piece)
    return "".join(pieces)


def _serve() -> None:
    """A child's loop (`python -m kvattn.templates`): one JSON line in, one out.

    The first line is `{"source", "max_chars", "memory_bytes"}`; each next
    one a variables object, answered `["ok", text]` or `["error", message]`.
    """
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    settings = json.loads(stdin.readline())
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (settings["memory_bytes"], settings["memory_bytes"]))
    except (ImportError, ValueError, OSError):  # not Linux, or a lower hard limit: the time bound still holds
        pass
    template = compile_template(settings["source"])
    for line in stdin:
        try:
            answer = ["ok", render(template, json.loads(line), settings["max_chars"])]
        except MemoryError:
            answer = ["error", f"the chat template needed more than {settings['memory_bytes']} bytes of memory"]
        except Exception as error:  # template code runs on request data: any failure is the request's
            answer = ["error", f"the chat template refused the messages: {type(error).__name__}: {error}"]
        stdout.write(json.dumps(answer).encode() + b"\n")
        stdout.flush()


class TemplateProcesses:
    """Renders one chat template in up to `processes` child processes, each render bounded.

    Each child is `python -m kvattn.templates`, a fresh interpreter that
    loads jinja2 and this module only, spoken to in JSON lines over its
    standard streams.

    Args:
      source: the template's jinja2 source (compiled here first, so a
        template that does not compile fails at once).
      seconds: the longest a render may take; past it the child is killed
        (a thread could not be stopped) and the next render starts another.
      max_chars: the longest output.
      memory_bytes: each child's address-space limit (Linux), so one
        expression that would build a huge string fails in the child.
      processes: children at most, one per render running at once; a
        render waits for a free one.
    """

    def __init__(self, source: str, *, seconds: float, max_chars: int, memory_bytes: int, processes: int):
        compile_template(source)
        self.seconds = seconds
        self._settings = json.dumps({"source": source, "max_chars": max_chars, "memory_bytes": memory_bytes})
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(processes)

    def render(self, variables: dict) -> str:
        """The template rendered with `variables` (JSON data); `ValueError` if it raised or ran past a bound."""
        with self._slots:
            try:
                child = self._idle.get_nowait()
            except queue.Empty:
                child = self._start()
            answer, answered = ["error", "the chat template's process ended while rendering"], False
            try:
                child.stdin.write(json.dumps(variables).encode() + b"\n")
                child.stdin.flush()
                if select.select([child.stdout], [], [], self.seconds)[0]:
                    line = child.stdout.readline()
                    if line:
                        answer, answered = json.loads(line), True
                else:
                    answer = ["error", f"the chat template ran past {self.seconds} s"]
            except (OSError, ValueError):  # the child died (e.g. killed by the system)
                pass
            if answered and child.poll() is None:
                self._idle.put(child)
            else:  # ran past its time, or gone: a fresh child next time
                _end(child)
        kind, value = answer
        if kind != "ok":
            raise ValueError(value)
        return value

    def _start(self) -> subprocess.Popen:
        # The parent's path, so the child imports the same kvattn (an uninstalled checkout included).
        path = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH"))
                               if p)
        child = subprocess.Popen([sys.executable, "-m", "kvattn.templates"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": path})
        child.stdin.write(self._settings.encode() + b"\n")
        child.stdin.flush()
        return child

    def close(self) -> None:
        """Ends the idle children."""
        while True:
            try:
                _end(self._idle.get_nowait())
            except queue.Empty:
                return


def _end(child: subprocess.Popen) -> None:
    child.kill()
    child.wait()
    for stream in (child.stdin, child.stdout):
        stream.close()


if __name__ == "__main__":
    _serve()
