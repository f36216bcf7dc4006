"""serve/json_prefix.py: a JSON value as far as it is written, re-encoded as ``json.dumps`` writes the whole value.

What it must show (what a streamed ``hermes`` call's arguments rely on): for any JSON value written in any of the
ways a model may write it (spacing, ``\\u`` escapes or raw characters, ``\\/``, number forms), the text given for
each prefix extends the text given for the one before, is a prefix of the whole value re-encoded, and is the whole
re-encoded value once the value ends; text that cannot be JSON gives None.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vexpert_runtime.serve.json_prefix import json_prefix

_TEXT = st.text(st.sampled_from(['a', 'é', '"', '\\', '\n', '/', '\x01', '😀', '\t', ' ', '\u2028', 'ÿ']), max_size=12)
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False, allow_infinity=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12,
)


def _written(value: Any, ascii_only: bool, separators: tuple[str, str], slashes: bool) -> str:
    text = json.dumps(value, ensure_ascii=ascii_only, separators=separators)
    return text.replace("/", "\\/") if slashes else text  # (\/ is valid only inside strings: '/' appears nowhere else)


@settings(max_examples=300, deadline=None)
@given(value=_VALUES, ascii_only=st.booleans(), slashes=st.booleans(),
       separators=st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : "), (",\n  ", ":\t")]))
def test_every_prefix_is_a_prefix_of_the_whole_value_re_encoded(value: Any, ascii_only: bool, slashes: bool,
                                                                 separators: tuple[str, str]) -> None:
    text = _written(value, ascii_only, separators, slashes)
    whole = json.dumps(json.loads(text), ensure_ascii=False)
    before = ""
    for end in range(len(text) + 1):
        read = json_prefix(text[:end])
        assert read is not None, text[:end]
        assert read[0].startswith(before) and whole.startswith(read[0]), (text[:end], read[0], whole)
        before = read[0]
    assert json_prefix(text + ' , "after"') == (whole, len(text))  # complete: the whole, and where it ends
    assert json_prefix("  " + text + "\n", 1) == (whole, len(text) + 2)


@pytest.mark.parametrize("text", ['{"a" 1}', "[1,]", '{"a":1,}', "{1:2}", '["a\x01"]', '{"a":tru e}', "[1 2]",
                                  '["\\x"]', '{"a": NaN}', "]", '{"a":1]'])
def test_text_that_cannot_be_json_gives_none(text: str) -> None:
    assert json_prefix(text) is None


def test_a_cut_escape_or_half_a_surrogate_pair_waits_for_the_rest() -> None:
    assert json_prefix('["ab\\') == ('["ab', None)
    assert json_prefix('["ab\\u00') == ('["ab', None)
    assert json_prefix('["ab\\ud83d') == ('["ab', None)  # the emoji's first half: nothing of it yet
    assert json_prefix('["ab\\ud83d\\ude00') == ('["ab😀', None)
    assert json_prefix("[1") == ("[", None) and json_prefix("[1.") == ("[", None)  # 1 may go on: 12, 1.5
    assert json_prefix("[1.5e") == ("[", None) and json_prefix("[1.5e3,") == ("[1500.0, ", None)
    assert json_prefix("[tr") == ("[", None) and json_prefix("[true") == ("[", None)
