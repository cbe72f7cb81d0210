"""How memory/token_chunks.py cuts the token axis: `token_slices` for one stream, `stream_slices` for streams chunked
side by side (Flux's double block: text and image tokens, by separate weights)."""
from __future__ import annotations

import pytest

from tightrope.memory.token_chunks import stream_slices, token_slices


def sizes(slices):
    return [s.stop - s.start for s in slices]


def covers(slices, n):
    return [i for s in slices for i in range(s.start, s.stop)] == list(range(n))


@pytest.mark.parametrize("n, chunks, expected", [(16, 4, [4] * 4), (13, 3, [5, 4, 4]), (3, 8, [1, 1, 1]),
                                                 (5, 1, [5]), (0, 4, [0])])
def test_token_slices_cover_the_stream_in_chunks_differing_by_at_most_one(n, chunks, expected):
    slices = token_slices(n, chunks)
    assert sizes(slices) == expected and covers(slices, n)


@pytest.mark.parametrize("lengths, chunks, expected", [
    ((512, 16384), 8, [[512], [2048] * 8]),  # Flux at 2048 px: the text is one chunk, not 8 of 64 tokens
    ((512, 4096), 8, [[512], [512] * 8]),  # 1024 px: exactly one image chunk's length
    ((513, 4096), 8, [[257, 256], [512] * 8]),  # one token longer: two chunks, none longer than 512
    ((5, 13), 4, [[3, 2], [4, 3, 3, 3]]),
    ((3, 6), 4, [[2, 1], [2, 2, 1, 1]]),  # the longest in `chunks` chunks, though 3 of 2 tokens would hold it
    ((5, 13), 40, [[1] * 5, [1] * 13]),  # more chunks than tokens: a token each, in every stream
    ((13, 5), 3, [[5, 4, 4], [5]]),  # whichever stream is the longest
    ((7, 7), 2, [[4, 3], [4, 3]]),
    ((0, 9), 3, [[0], [3, 3, 3]]),  # an empty stream stays one empty slice, as token_slices has it
])
def test_streams_side_by_side_are_cut_no_finer_than_the_longest_streams_chunks(lengths, chunks, expected):
    """The longest stream gets `chunks` chunks; every other the fewest chunks that are each no longer than the
    longest's longest (a block's working set follows its longest chunk, so a finer cut saves nothing)."""
    out = stream_slices(lengths, chunks)
    assert [sizes(s) for s in out] == expected
    assert all(covers(s, n) for s, n in zip(out, lengths))
    assert len(out[lengths.index(max(lengths))]) == max(1, min(chunks, max(lengths)))  # the longest: `chunks`
    longest = max(max(sizes(s)) for s in out)
    assert longest == max(sizes(token_slices(max(lengths), chunks)))
