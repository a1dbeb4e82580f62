"""Reading YAML input: what is accepted, as what, and which line each key is on."""
from __future__ import annotations

import pytest

from imagebuild.core.source import InputError, parse_document


def test_numbers_that_look_like_versions_keep_their_text():
    doc = parse_document("python: [3.10, 3.9]\ncuda: 11.8\ncudnn: 9.10\n", "m.yaml")
    assert doc.data == {"python": ["3.10", "3.9"], "cuda": "11.8", "cudnn": "9.10"}


def test_integers_stay_integers():
    assert parse_document("schema: 1\nuid: 1000\n", "m.yaml").data == {"schema": 1, "uid": 1000}


def test_every_key_and_list_item_has_its_line():
    doc = parse_document("# comment\nmatrix:\n  python:\n    - '3.10'\n    - '3.11'\n  os: [debian12]\n", "m.yaml")
    assert doc.line(("matrix",)) == 2
    assert doc.line(("matrix", "python", 1)) == 5
    assert doc.line(("matrix", "os", 0)) == 6


def test_a_missing_key_is_blamed_on_the_nearest_enclosing_one():
    doc = parse_document("matrix:\n  python: ['3.10']\n", "m.yaml")
    assert doc.line(("matrix", "python", 7)) == 2
    assert doc.line(("matrix", "exclude", 0)) == 1


def test_merge_keys_are_resolved():
    text = "common: &c {image: a, family: debian}\nos:\n  one: {<<: *c, digest: d}\n"
    doc = parse_document(text, "m.yaml", merge_keys=True)
    assert doc.data["os"]["one"] == {"image": "a", "family": "debian", "digest": "d"}


def test_a_key_written_in_the_mapping_overrides_a_merged_one():
    text = "os:\n  debian12: &deb\n    image: debian:12\n    family: debian\n  debian11:\n    <<: *deb\n    image: debian:11\n"
    doc = parse_document(text, "m.yaml", merge_keys=True)
    assert doc.data["os"]["debian11"] == {"image": "debian:11", "family": "debian"}
    assert doc.line(("os", "debian11", "image")) == 7


def test_of_several_merged_mappings_the_first_wins():
    doc = parse_document("a: &a {x: 1}\nb: &b {x: 2, y: 3}\nc:\n  <<: [*a, *b]\n", "m.yaml", merge_keys=True)
    assert doc.data["c"] == {"x": 1, "y": 3}


def test_a_mapping_reached_twice_through_an_alias_reads_the_same_both_times():
    text = "base: &base {image: debian:12, family: debian}\nderived: &derived\n  <<: *base\n  image: debian:11\n" \
           "again: *derived\n"
    doc = parse_document(text, "m.yaml", merge_keys=True)
    assert doc.data["again"] == doc.data["derived"] == {"image": "debian:11", "family": "debian"}


def test_a_key_written_twice_next_to_a_merge_is_still_a_duplicate():
    with pytest.raises(InputError, match="^m.yaml:5: c.y: duplicate key$") as error:
        parse_document("a: &a {x: 1}\nc:\n  <<: *a\n  y: 1\n  y: 2\n", "m.yaml", merge_keys=True)
    assert (error.value.line, error.value.key, error.value.message) == (5, "c.y", "duplicate key")


def test_more_than_one_document_is_refused():
    with pytest.raises(InputError, match="^m.yaml:2: a second document starts here; expected one per file$") as error:
        parse_document("schema: 1\n---\nschema: 2\n", "m.yaml")
    assert error.value.line == 2 and "second document" in error.value.message


def test_non_string_keys_are_refused():
    with pytest.raises(InputError, match="^m.yaml:2: os: keys must be strings, got a list$") as error:
        parse_document("os:\n  [a, b]: x\n", "m.yaml")
    assert error.value.line == 2 and "keys must be strings" in error.value.message
