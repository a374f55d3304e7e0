"""Griffe extensions for the API pages: each parameter with its own row, its own default.

- `SplitNames`: kvattn's docstrings document parameters that go together on
  one line (`k_cache, v_cache: ...`). Griffe reads that as one parameter
  named `k_cache, v_cache`, which matches none of the signature's, so its
  type and default are lost (the table says "required"). Each name gets
  its own entry, with the shared description.
- `FieldHelpers`: a dataclass field whose default is a call to a helper of
  the same module that returns `dataclasses.field(default=...)` (as
  `kvattn.config._recorded` does) gets the default it really has, rather
  than the helper's call (`_recorded(None)`, or `_recorded()` for a field
  that has none).
"""

from __future__ import annotations

import ast
import re

import griffe

_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Params|Other Parameters):[ \t]*$")
_ENTRY = re.compile(r"^(\s+)(\**\w+(?:,\s*\**\w+)+):(.*)$")


def _split(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    section_indent = None  # the indent of the current parameters section's title, or None outside one
    i = 0
    while i < len(lines):
        line = lines[i]
        title = _SECTION.match(line)
        if title:
            section_indent = len(title.group(1))
            out.append(line)
            i += 1
            continue
        stripped = len(line) - len(line.lstrip())
        if section_indent is not None and line.strip() and stripped <= section_indent:
            section_indent = None
        entry = _ENTRY.match(line) if section_indent is not None else None
        if entry is None:
            out.append(line)
            i += 1
            continue
        indent, names, first = entry.groups()
        body = [first]
        i += 1
        while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > len(indent):
            body.append("\n" + lines[i])  # the description's continuation lines
            i += 1
        for name in (n.strip() for n in names.split(",")):
            out.append(f"{indent}{name}:{''.join(body)}")
    return "\n".join(out)


class SplitNames(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and "," in obj.docstring.value:
            obj.docstring.value = _split(obj.docstring.value)


class FieldHelpers(griffe.Extension):
    def on_attribute_instance(self, *, node, attr: griffe.Attribute, **kwargs) -> None:
        value = getattr(node, "value", None)
        if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and not value.keywords):
            return
        helper = attr.module.members.get(value.func.id)
        if not isinstance(helper, griffe.Function) or not helper.parameters:
            return
        first = helper.parameters[0]
        if not re.search(rf"return\s+dataclasses\.field\(\s*default\s*=\s*{first.name}\b", helper.source):
            return
        if value.args:
            attr.value = attr.value.arguments[0]
        elif first.default is None or str(first.default) == "dataclasses.MISSING":
            attr.value = None  # no default: a required parameter
        else:
            attr.value = first.default
