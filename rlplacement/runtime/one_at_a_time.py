"""Actor methods that may run on two threads take turns.

Ray runs an actor's plain calls one at a time on its main thread, but a Ray Compiled Graph runs its
tasks on a background thread of the same actor (``runtime.update_graph``): a weight update could
then overlap a generation or a train step, mixing versions or reading half-written weights. Every
public method of a class decorated with :func:`one_call_at_a_time` holds the instance's re-entrant
lock, so calls never interleave, as with plain calls alone: an update issued while a generation
runs is applied after it.
"""

from __future__ import annotations

import functools
import threading
import time
import types

_LOCK_ATTR = "_one_call_lock"
_NOW_ATTR = "_one_call_now"  # (method name, monotonic start) of the call holding the turn, or None
_making_locks = threading.Lock()


def _lock_of(instance) -> threading.RLock:
    lock = instance.__dict__.get(_LOCK_ATTR)
    if lock is None:
        with _making_locks:
            lock = instance.__dict__.setdefault(_LOCK_ATTR, threading.RLock())
    return lock


def _holding_lock(fn):
    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        with _lock_of(self):
            outermost = self.__dict__.get(_NOW_ATTR) is None
            if outermost:
                self.__dict__[_NOW_ATTR] = (fn.__name__, time.monotonic())
            try:
                return fn(self, *args, **kwargs)
            finally:
                if outermost:
                    self.__dict__[_NOW_ATTR] = None

    method.__one_call_at_a_time__ = True
    return method


def current_call(self) -> str:
    """The method holding this actor's turn and for how long ("" when none), read without waiting
    for a turn: what a driver asks an actor that did not answer in time."""
    now = self.__dict__.get(_NOW_ATTR)
    return "" if now is None else f"{now[0]} for {time.monotonic() - now[1]:.1f}s"


current_call.__one_call_at_a_time__ = True  # never waits for the lock: that is its point
current_call.__control_call__ = True


def control_call(fn):
    """Mark a method that runs beside the call holding the turn (it never takes the lock): a poll of
    finished samples or an abort must reach an engine while its generation or an update runs. Such a
    method guards its own state. ``ray_engines`` gives these methods their own Ray concurrency group."""
    fn.__one_call_at_a_time__ = True
    fn.__control_call__ = True
    return fn


def one_call_at_a_time(cls):
    """Wrap every public method of ``cls`` (inherited ones included) in the instance's lock, and give
    it :func:`current_call`."""
    cls.current_call = current_call
    seen = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        for name, attr in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            if isinstance(attr, types.FunctionType) and not getattr(attr, "__one_call_at_a_time__", False):
                setattr(cls, name, _holding_lock(attr))
    return cls
