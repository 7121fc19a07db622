"""Fuzz the placement JSON loader: a valid placement or one clear sentence (``PlacementError``),
never another exception (issue 20)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import PlacementError, TesselError
from engine.io.placement_json import load_placement, placement_from_dict, placement_to_dict


def examples(ci: int) -> int:
    """Cases for a test: ``ci`` under the ``ci`` profile (40 cases by default), scaled with the loaded one."""
    return max(1, ci * settings.default.max_examples // 40)


def _check_sentence(e: TesselError) -> None:
    text = str(e)
    assert text and "\n" not in text and "Traceback" not in text, text


def _load_or_sentence(path):
    """The loaded placement (which must round-trip through its JSON form), or None after a sentence."""
    try:
        pl = load_placement(path)
    except PlacementError as e:
        _check_sentence(e)
        return None
    # what loads is a placement whose JSON form loads back to the same placement
    assert placement_from_dict(json.loads(json.dumps(placement_to_dict(pl)))) == pl
    return pl


@settings(max_examples=examples(60))
@given(data=st.data())
def test_mutated_placement_files_load_or_raise_a_sentence(data, valid_placement_docs, mutate_json, tmp_path_factory):
    doc = data.draw(st.sampled_from(valid_placement_docs), label="placement")
    bad = mutate_json(data, doc)
    path = tmp_path_factory.mktemp("pl") / "placement.json"
    path.write_text(json.dumps(bad), encoding="utf-8")
    _load_or_sentence(path)


@settings(max_examples=examples(30))
@given(data=st.data())
def test_mutated_placement_dicts_load_or_raise_a_sentence(data, valid_placement_docs, mutate_json):
    """The same on the parsed value (what a plan embeds), where non-JSON values such as tuples
    never occur but every JSON value does."""
    doc = data.draw(st.sampled_from(valid_placement_docs), label="placement")
    bad = mutate_json(data, doc, max_mutations=5)
    try:
        placement_from_dict(bad)
    except PlacementError as e:
        _check_sentence(e)


@settings(max_examples=examples(30))
@given(data=st.data())
def test_damaged_placement_text_loads_or_raises_a_sentence(data, valid_placement_docs, tmp_path_factory):
    """Truncated files, bytes that are not UTF-8, deep nesting, empty files."""
    doc = data.draw(st.sampled_from(valid_placement_docs), label="placement")
    raw = json.dumps(doc).encode()
    kind = data.draw(st.sampled_from(["truncate", "garbage", "nest", "empty", "bom"]), label="damage")
    if kind == "truncate":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1), label="cut")]
    elif kind == "garbage":
        at = data.draw(st.integers(0, len(raw)), label="at")
        raw = raw[:at] + data.draw(st.binary(min_size=1, max_size=8), label="bytes") + raw[at:]
    elif kind == "nest":
        depth = data.draw(st.sampled_from([10, 1000, 100_000]), label="depth")
        raw = b"[" * depth + b"]" * depth
    elif kind == "empty":
        raw = b""
    else:
        raw = b"\xef\xbb\xbf" + raw
    path = tmp_path_factory.mktemp("pl") / "placement.json"
    path.write_bytes(raw)
    _load_or_sentence(path)


@pytest.mark.parametrize("what", ["missing", "folder"])
def test_a_path_that_is_not_a_placement_file_is_a_sentence(tmp_path, what):
    path = tmp_path / "placement.json"
    if what == "folder":
        path.mkdir()
    with pytest.raises(PlacementError, match="placement.json") as e:
        load_placement(path)
    _check_sentence(e.value)
