"""IncrementalText, the one stop-string / hold-back / incremental-detokenize mechanism of both
backends and the gateway, on a byte-level toy tokenizer whose tokens can split a character."""

from __future__ import annotations

import pytest

from lightning_core.backends.text import IncrementalText

EURO = "€".encode()  # three bytes: e2 82 ac


class ByteTokenizer:
    """Each token id stands for a byte string; decoding joins them, bad UTF-8 becomes U+FFFD."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def ids(self, *pieces: str | bytes) -> list[int]:
        out = []
        for piece in pieces:
            self.pieces.append(piece.encode() if isinstance(piece, str) else piece)
            out.append(len(self.pieces) - 1)
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


@pytest.fixture
def tok() -> ByteTokenizer:
    return ByteTokenizer()


def test_a_character_split_across_tokens_waits_for_its_last_byte(tok):
    ids = tok.ids("a", EURO[:1], EURO[1:2], EURO[2:], "b")
    text = IncrementalText(tok)
    shown = []
    ready = []
    for token in ids:
        text.push([token])
        shown.append(text.take())
        ready.append(text.ready_tokens())
    assert shown == ["a", "", "", "€", "b"]
    assert ready == [1, 1, 1, 4, 5]
    assert text.text() == "a€b" and text.rest() == ""


def test_the_trailing_half_character_comes_out_only_with_rest(tok):
    ids = tok.ids("x", EURO[:2])
    text = IncrementalText(tok)
    text.push(ids)
    assert text.take() == "x"
    assert text.rest() == "\ufffd"


def test_a_stop_string_across_token_boundaries_cuts_before_the_token_it_begins_in(tok):
    ids = tok.ids("he", "llo", " wor", "ld")
    text = IncrementalText(tok, stops=["o w"])
    assert text.push(ids[:1]) is None
    assert text.push(ids[1:2]) is None
    # "hello" ends with "o", which may begin "o w": the token holding it waits.
    assert text.ready_tokens() == 1
    assert text.take() == "hell"
    assert text.push(ids[2:3]) == 1
    assert text.stopped == 1


def test_a_stop_string_beginning_inside_a_split_character(tok):
    ids = tok.ids("a", EURO[:1], EURO[1:2], EURO[2:], "b", "c")
    one_by_one = IncrementalText(tok, stops=["€b"])
    kept = [one_by_one.push([token]) for token in ids[:5]]
    assert kept == [None, None, None, None, 1]
    # vLLM's way: the whole completion at once, the stop string found in it.
    at_once = IncrementalText(tok, stops=["€b"])
    assert at_once.push(ids) == 1


def test_only_a_new_match_counts_and_the_first_stop_string_wins(tok):
    ids = tok.ids("ab", "cd", "ef")
    text = IncrementalText(tok, stops=["ef", "cd", ""])
    assert text.push(ids[:1]) is None
    assert text.push(ids[1:]) == 1  # "cd" begins before "ef"
    assert text.stop == "cd"
    assert text.push(tok.ids("cd")) is None  # stopped already: reported once


def test_hold_back_markers_hold_a_partial_tag_and_everything_from_a_tag_on(tok):
    text = IncrementalText(tok, hold=["<tool_call>"])
    shown = []
    for piece in ["Sure", " <", "b>", " <to", "ol_", "call>", '{"a": 1}']:
        text.push(tok.ids(piece))
        shown.append(text.take())
    assert shown == ["Sure", " ", "<b>", " ", "", "", ""]
    assert text.rest() == '<tool_call>{"a": 1}'
    assert text.ready_tokens() == 3  # "Sure", " <", "b>"; " <to" holds the tag's start


def test_hold_all_shows_nothing_before_the_end(tok):
    text = IncrementalText(tok, hold=["<tool_call>"], hold_all=True)
    text.push(tok.ids("plain", " text"))
    assert text.take() == ""
    assert text.ready_tokens() == 0
    assert text.rest() == "plain text"


def test_stop_strings_are_held_back_like_markers_until_ruled_out(tok):
    text = IncrementalText(tok, stops=["STOP"])
    text.push(tok.ids("go ", "ST"))
    assert text.take() == "go " and text.ready_tokens() == 1
    assert text.push(tok.ids("AY")) is None
    assert text.take() == "STAY" and text.ready_tokens() == 3
