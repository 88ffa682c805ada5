"""Scheduler policy on hand-built sequences: admission order, starvation bound, static batches."""

from tandem.engine.kv_cache import BlockManager
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import Sequence, SequenceStatus


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _seq(
    seq_id: int, prompt_len: int, arrival: float, priority: int = 0, max_tokens: int = 8
) -> Sequence:
    return Sequence(
        seq_id, str(seq_id), 0, [1] * prompt_len, SamplingParams(), max_tokens, arrival, priority
    )


def _ids(batch) -> list[int]:
    return [s.seq_id for s in batch.seqs]


def _finish(scheduler: Scheduler, batch, done: set[int]) -> None:
    for seq in batch.seqs:
        seq.token_ids.append(2)
        if seq.seq_id in done:
            seq.status = SequenceStatus.FINISHED
    scheduler.finish_step(batch)


def test_priority_order_and_head_of_line_for_long_requests():
    clock = Clock()
    sched = Scheduler(BlockManager(8, 4), 16, 1000, policy="priority", clock=clock)
    for seq in [_seq(0, 4, 0.0, priority=5), _seq(1, 4, 0.1, priority=1), _seq(2, 4, 0.2, 1)]:
        sched.add_request([seq])
    assert _ids(sched.schedule()) == [1, 2, 0]
    # A long request (needs 6 of the 8 blocks) queued before short ones is not overtaken.
    sched = Scheduler(BlockManager(8, 4), 16, 1000, clock=clock)
    sched.add_request([_seq(10, 12, 0.0)])
    first = sched.schedule()
    sched.add_request([_seq(11, 24, 0.1)])
    for i in range(5):
        sched.add_request([_seq(20 + i, 2, 0.2 + i)])
    second = sched.schedule()
    assert _ids(second) == [10], "short requests must not overtake the long one waiting"
    _finish(sched, first, done=set())
    _finish(sched, second, done={10})
    assert _ids(sched.schedule())[0] == 11


def test_starvation_bound_lets_a_low_priority_request_in():
    clock = Clock()
    sched = Scheduler(BlockManager(4, 4), 1, 1000, policy="priority", max_wait_s=5.0, clock=clock)
    sched.add_request([_seq(0, 3, 0.0, priority=9)])
    next_id = 1
    admitted = []
    for step in range(12):
        clock.now = float(step)
        sched.add_request([_seq(next_id, 3, clock.now, priority=0)])  # steady urgent work
        next_id += 1
        batch = sched.schedule()
        admitted += _ids(batch)
        _finish(sched, batch, done=set(_ids(batch)))
    assert 0 in admitted
    waited = admitted.index(0)
    assert 5 <= waited <= 7, f"admitted after {waited} steps; bound is 5 s at 1 step/s"


def test_longest_output_first_admits_by_tokens_to_come_within_the_starvation_bound():
    """``lof``: of a backlog, the requests with the most output to come start first (arrival
    breaks ties); one waiting past ``max_wait_s`` goes before all of them."""
    clock = Clock()
    sched = Scheduler(BlockManager(64, 4), 2, 1000, policy="lof", max_wait_s=5.0, clock=clock)
    lengths = {0: 16, 1: 128, 2: 64, 3: 128, 4: 32}
    for seq_id, max_tokens in lengths.items():
        sched.add_request([_seq(seq_id, 4, 0.1 * seq_id, max_tokens=max_tokens)])
    first = sched.schedule()
    assert _ids(first) == [1, 3]
    _finish(sched, first, done={1, 3})
    clock.now = 5.05  # only request 0 has waited past the bound; 5 arrives, longer than all
    sched.add_request([_seq(5, 4, clock.now, max_tokens=512)])
    assert _ids(sched.schedule()) == [0, 5]
    fcfs = Scheduler(BlockManager(64, 4), 2, 1000, clock=Clock())
    for seq_id, max_tokens in lengths.items():
        fcfs.add_request([_seq(seq_id, 4, 0.1 * seq_id, max_tokens=max_tokens)])
    assert _ids(fcfs.schedule()) == [0, 1]


def test_static_batching_waits_for_the_whole_batch():
    sched = Scheduler(BlockManager(64, 4), 2, 1000, batching="static")
    for i in range(4):
        sched.add_request([_seq(i, 3, float(i))])
    first = sched.schedule()
    assert _ids(first) == [0, 1]
    _finish(sched, first, done={0})
    second = sched.schedule()
    assert _ids(second) == [1], "static batching admits nothing while the batch runs"
    _finish(sched, second, done={1})
    assert _ids(sched.schedule()) == [2, 3]


def test_preempted_sequences_are_readmitted_first():
    sched = Scheduler(BlockManager(3, 4), 8, 1000)
    a, b = _seq(0, 4, 0.0), _seq(1, 4, 1.0)
    sched.add_request([a])
    sched.add_request([b])
    batch = sched.schedule()
    assert _ids(batch) == [0, 1]
    _finish(sched, batch, done=set())  # both now need a second block; only one is free
    batch = sched.schedule()
    assert _ids(batch) == [0] and b.preempted and sched.num_preemptions == 1
    sched.add_request([_seq(2, 1, 0.5)])
    _finish(sched, batch, done={0})
    assert _ids(sched.schedule())[0] == 1


def test_static_batches_are_length_sorted_split_over_steps_in_flight_and_wait_for_a_burst():
    clock = Clock()
    sched = Scheduler(BlockManager(64, 4), 4, 1000, batching="static", clock=clock)
    lengths = [9, 2, 7, 3, 5, 8]
    for i, n in enumerate(lengths):
        sched.add_request([_seq(i, n, 0.0)])
    first = sched.schedule(max_seqs=2)  # a pipeline's first slot takes half the batch
    second = sched.schedule(busy=set(_ids(first)), max_seqs=2)  # the batch is still open
    assert _ids(first) + _ids(second) == [1, 3, 4, 2], "the 4 shortest, shortest first"
    _finish(sched, first, done=set())
    assert sched.schedule(busy=set(_ids(second)), max_seqs=2).seqs == first.seqs
    _finish(sched, second, done={4, 2})
    assert sched.schedule().seqs == first.seqs, "nothing joins a static batch once it ran"
    # a server's idle engine lets a burst gather before a batch starts
    sched = Scheduler(BlockManager(64, 4), 3, 1000, batching="static", clock=clock)
    sched.add_request([_seq(10, 3, 0.0)])
    clock.now = 0.03
    assert abs(sched.static_batch_window_left(0.05) - 0.02) < 1e-9
    sched.add_request([_seq(11, 3, 0.03)])
    sched.add_request([_seq(12, 3, 0.03)])
    assert sched.static_batch_window_left(0.05) == 0.0, "the batch is full"
