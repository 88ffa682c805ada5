"""How the dist transport cuts a stream of boxes into bounded messages (both ends agree), and
the order in which its ranks walk their streams."""

import pytest

from tandem.exchange.transports.p2p import SMALL_BYTES, frames, stream_order


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


@pytest.mark.parametrize("senders", range(1, 7))
@pytest.mark.parametrize("receivers", range(1, 7))
def test_stream_order_never_waits_in_a_cycle_and_pairs_ranks_in_rounds(senders, receivers):
    """A stream moves only when it is next for both its sender and its receiver (a blocking
    send meets a blocking receive): every stream must finish, in rounds of disjoint pairs."""
    sends = {
        s: stream_order(s, range(receivers), senders, receivers, sending=True)
        for s in range(senders)
    }
    recvs = {
        d: stream_order(d, range(senders), senders, receivers, sending=False)
        for d in range(receivers)
    }
    rounds = []
    while any(sends.values()):
        ready = [(s, q[0]) for s, q in sends.items() if q and recvs[q[0]][0] == s]
        assert ready, f"deadlock: senders wait on {sends}, receivers on {recvs}"
        for s, d in ready:
            sends[s].pop(0)
            recvs[d].pop(0)
        rounds.append(ready)
    assert not any(recvs.values())
    assert len(rounds) == max(senders, receivers)  # every round a matching, none wasted
    assert sorted(rounds[0]) == [(r, r) for r in range(min(senders, receivers))]
