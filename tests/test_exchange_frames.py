"""How the dist transport cuts a stream of boxes into bounded messages (both ends agree)."""

from tandem.exchange.transports.dist import SMALL_BYTES, frames


def test_large_boxes_travel_alone_cut_by_whole_rows_and_small_ones_are_packed():
    limit = 4 * SMALL_BYTES
    row = SMALL_BYTES // 2
    sizes = [100, 200, 10 * row, 300, 3 * limit]
    rows = [1, 2, 10, 3, 12]
    got = frames(sizes, rows, limit)
    assert got == [
        [(0, 0, 1), (1, 0, 2)],
        [(2, 0, 8)],
        [(2, 8, 10)],
        [(3, 0, 3)],
        [(4, 0, 4)],
        [(4, 4, 8)],
        [(4, 8, 12)],
    ]
    for frame in got:  # every message within the limit
        assert sum(sizes[i] // rows[i] * (b - a) for i, a, b in frame) <= limit


def test_a_row_larger_than_the_limit_travels_alone_and_packing_respects_the_limit():
    assert frames([10 * SMALL_BYTES], [1], SMALL_BYTES) == [[(0, 0, 1)]]
    small = SMALL_BYTES // 4
    assert frames([small] * 3, [1] * 3, 2 * small) == [[(0, 0, 1), (1, 0, 1)], [(2, 0, 1)]]
