"""Actor methods take turns across threads (rlplacement.runtime.one_at_a_time): a compiled update
graph runs ``update_weights`` on a background thread of an actor whose main thread may be generating."""

import threading
import time

from rlplacement.runtime.one_at_a_time import one_call_at_a_time


class Base:
    def inherited(self, log, tag):
        log.append(("in", tag))
        time.sleep(0.05)
        log.append(("out", tag))


@one_call_at_a_time
class Actor(Base):
    def __init__(self):
        self.log = []

    def slow(self, tag):
        self.log.append(("in", tag))
        time.sleep(0.2)
        self.log.append(("out", tag))

    def outer(self):
        return self.inner() + 1  # re-entrant: a method may call another

    def inner(self):
        return 1

    def _private(self):
        return "unlocked"


def test_calls_from_two_threads_never_interleave_inherited_methods_included():
    actor = Actor()
    threads = [threading.Thread(target=actor.slow, args=("a",)),
               threading.Thread(target=actor.inherited, args=(actor.log, "b"))]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert actor.log == [("in", "a"), ("out", "a"), ("in", "b"), ("out", "b")]


def test_a_method_may_call_another_and_private_ones_are_left_alone():
    actor = Actor()
    assert actor.outer() == 2
    assert Actor._private is Actor.__dict__["_private"]


def test_current_call_names_the_method_holding_the_turn_without_waiting_for_it():
    actor = Actor()
    assert actor.current_call() == ""
    t = threading.Thread(target=actor.slow, args=("a",))
    t.start()
    time.sleep(0.05)
    started = time.monotonic()
    now = actor.current_call()
    assert time.monotonic() - started < 0.05  # answered while slow() still runs
    assert now.startswith("slow for 0.")
    t.join()
    assert actor.current_call() == ""
