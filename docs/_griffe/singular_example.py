"""A griffe extension for the API pages: a docstring's `Example:` section is read as `Examples:`.

kvattn's docstrings title their doctests `Example:`, which the Google-style
parser would otherwise render as an admonition of plain text; as an examples
section, the `>>>` lines and their outputs render as code.
"""

from __future__ import annotations

import re

import griffe

_SINGULAR = re.compile(r"^(\s*)Example:[ \t]*$", flags=re.M)


class SingularExample(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _SINGULAR.sub(r"\1Examples:", obj.docstring.value)
