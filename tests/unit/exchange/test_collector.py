"""`tandem.exchange.collector`: automatic garbage collection is off while a hold lasts (a
held call, or a `Held` until released), and back as it was once the last hold ends, whatever
they raise and however they nest or overlap across threads."""

import gc
import threading

import pytest

from tandem.exchange import collector


@pytest.fixture(autouse=True)
def _collector_on():
    gc.enable()
    yield
    gc.enable()


def test_a_held_call_runs_without_automatic_collection_and_gives_it_back():
    seen = []
    assert collector.held(lambda: seen.append(gc.isenabled()) or 7)() == 7
    assert seen == [False] and gc.isenabled()


def test_the_collector_comes_back_after_an_error():
    @collector.held
    def broken():
        raise KeyError("x")

    with pytest.raises(KeyError):
        broken()
    assert gc.isenabled()


def test_a_collector_turned_off_by_the_caller_stays_off():
    gc.disable()
    collector.held(lambda: None)()
    assert not gc.isenabled()


def test_overlapping_held_calls_keep_it_off_until_the_last_ends():
    inner_in, outer_may_end, inner_may_end = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    @collector.held
    def outer():
        inner_thread.start()
        assert inner_in.wait(10)
        outer_may_end.wait(10)

    @collector.held
    def inner():
        inner_in.set()
        assert inner_may_end.wait(10)
        seen["inner, after outer ended"] = gc.isenabled()

    inner_thread = threading.Thread(target=inner)
    outer_thread = threading.Thread(target=outer)
    outer_thread.start()
    assert inner_in.wait(10)
    outer_may_end.set()
    outer_thread.join(10)
    seen["between"] = gc.isenabled()  # outer is over, inner still runs
    inner_may_end.set()
    inner_thread.join(10)
    assert not outer_thread.is_alive() and not inner_thread.is_alive()
    assert seen == {"between": False, "inner, after outer ended": False}
    assert gc.isenabled()


def test_a_hold_released_early_gives_it_back_once():
    with collector.Held() as hold:
        assert not gc.isenabled()
        hold.release()  # a rolling push's trainers were answered: its waves go on, collected
        assert gc.isenabled()
        with collector.Held():  # another hold meanwhile is not undone by the first's end
            hold.release()
            assert not gc.isenabled()
        assert gc.isenabled()
    assert gc.isenabled()
