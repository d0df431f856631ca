"""audit.retime.fresh's text prompts (no model, no worker): pieces of a split's lines, each from a
line start drawn anew, joined and cut to the mirrored length; never starting like one of the
stream's prompts; NoFreshPrompts where the split cannot give one."""
import random

import pytest

from audit.retime import fresh
from audit.retime.fresh import HELD_START_TOKENS, LineRuns, LineStarts, NoFreshPrompts


class Chars:
    """A tokenizer of one token per character."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


def numbered(files: int, lines: int) -> list[str]:
    """Files of lines that each name their file and line: where a piece came from shows."""
    return ["".join(f"file {f:02d} line {k:03d} of the split\n" for k in range(lines)) for f in range(files)]


def test_every_line_start_of_the_split_begins_a_piece():
    lines = LineStarts(["a\nbb\n\n", "ccc"], "x")  # no line starts after a file's last newline
    assert len(lines) == 4
    rng = random.Random(0)
    assert {lines.piece(rng, 1) for _ in range(200)} == {"a\n", "bb\n", "\n", "ccc\n"}
    # whole lines until the piece holds the characters asked (or its file ends)
    assert {lines.piece(rng, 3) for _ in range(200)} == {"a\nbb\n", "bb\n", "\n", "ccc\n"}


def line_of(line: str) -> tuple[int, int]:
    """(file, line) a line of ``numbered`` names."""
    return int(line[5:7]), int(line[13:16])


def pieces_of(text: str) -> list[tuple[tuple[int, int], int]]:
    """(where, lines) of each run of lines that follow each other in one file; the cut last line
    goes with its run."""
    runs = []
    for line in text.split("\n"):
        if not line:
            continue
        f, k = line_of(line)
        if runs and runs[-1][0][0] == f and runs[-1][0][1] + runs[-1][1] == k:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append(((f, k), 1))
    return runs


def test_a_prompt_is_pieces_from_independent_line_starts():
    texts = numbered(40, 100)  # 30 characters a line: three lines make a piece of 64 or more
    runs = LineRuns(LineStarts(texts, "x"), Chars())
    assert runs.chars_per_token == 1 and len(runs.lines) == 4000
    length = 2000
    ids = runs.draw(random.Random(1), length, set())
    text = Chars().decode(ids)
    assert len(ids) == length
    lines = text.split("\n")
    # every line one of the split's, whole (but the last, cut to the length)
    assert all(line + "\n" in texts[line_of(line)[0]] for line in lines[:-1])
    assert lines[-1] and ("\n" + texts[line_of(lines[-1])[0]]).count("\n" + lines[-1]) == 1
    pieces = pieces_of(text)
    # three lines a piece (fewer where its file ends): 2000 characters are some 23 pieces
    assert len(pieces) >= 23 and all(n == 3 or k + n == 100 for (_, k), n in pieces[:-1]), pieces
    assert len({f for (f, _), _ in pieces}) > 10  # from many files
    # the same generator draws the same prompt, another another
    assert runs.draw(random.Random(1), length, set()) == ids != runs.draw(random.Random(2), length, set())


def test_a_short_prompt_is_several_shorter_pieces():
    runs = LineRuns(LineStarts(numbered(40, 100), "x"), Chars())
    assert runs.piece_chars(10 * fresh.PIECE_CHARS) == fresh.PIECE_CHARS
    assert runs.piece_chars(90) == 90 // fresh.MIN_PIECES and runs.piece_chars(1) == 1
    for seed in range(20):  # a line a piece
        pieces = pieces_of(Chars().decode(runs.draw(random.Random(seed), 90, set())))
        assert [n for _, n in pieces] == [1] * fresh.MIN_PIECES


def test_never_starting_like_one_of_the_streams_prompts():
    texts = ["x" * 20 + "\n", "y" * 20 + "\n"]
    runs = LineRuns(LineStarts(texts, "x"), Chars())
    held = {tuple(Chars().encode("x" * 40))}
    drawn = [Chars().decode(runs.draw(random.Random(s), 40, held)) for s in range(20)]
    assert all(t.startswith("y" * HELD_START_TOKENS) for t in drawn)
    only_x = LineRuns(LineStarts(texts[:1], "x"), Chars())
    with pytest.raises(NoFreshPrompts, match="each started like one of the stream's prompts"):
        only_x.draw(random.Random(0), 40, held)


def test_a_split_that_cannot_give_a_prompt_raises(monkeypatch):
    class Nothing(Chars):
        def encode(self, text):
            return []

    with pytest.raises(NoFreshPrompts, match="encode to no more than 0 tokens"):
        LineRuns(LineStarts(numbered(2, 5), "x"), Nothing()).draw(random.Random(0), 10, set())

    class Empty:
        def split(self, name):
            return []
    monkeypatch.setattr(fresh, "collect", lambda: Empty())
    with pytest.raises(NoFreshPrompts, match="no x-split lines"):
        LineStarts.of("x")
