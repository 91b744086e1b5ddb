"""Blocking facades over the async SDK classes, made by one mechanism.

`LoopThread` runs coroutines from synchronous code on one private event loop in a daemon thread.
`sync_facade` fills a facade class from its async core: the constructor builds the core on the loop
thread, and every named coroutine method becomes a blocking method run there (plain methods and
properties are passed through). Each generated member is `functools.wraps` of the async one, so
`inspect.signature` and the docstring are the core's: a behaviour and its documentation are written
once. What does not fit the rule (iterators, context managers, close) stays hand-written on the facade.

A facade made here holds `self._loop` (its LoopThread) and `self._core` (the async object).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

T = TypeVar("T")
C = TypeVar("C", bound=type)
F = TypeVar("F", bound=Callable)


class LoopThread:
    def __init__(self, name: str = "maskroll-client") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if self.loop.is_closed():  # closed: the coroutine is never run (nor left unawaited)
            coro.close()
            raise RuntimeError("closed: its event loop thread has stopped")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()  # KeyboardInterrupt / timeout: don't leave the coroutine running
            raise

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()


def sync_facade(
    core: type,
    *,
    methods: Iterable[str] = (),
    properties: Iterable[str] = (),
    init_doc: str,
    thread_name: str,
    open: Callable[[Any], Awaitable[Any]] | None = None,
) -> Callable[[C], C]:
    """Class decorator: `__init__` with `core.__init__`'s signature (the core is built, and `open`ed
    if given, on a new LoopThread; a failure closes the thread), one member per name in `methods`
    (a coroutine method runs on the loop and blocks for its result; a plain one is called as is) and a
    read-only property per name in `properties`."""

    def decorate(cls: C) -> C:
        cls.__init__ = _init(cls, core, init_doc, thread_name, open)
        for name in methods:
            setattr(cls, name, _method(cls, getattr(core, name)))
        for name in properties:
            setattr(cls, name, _property(core, name))
        return cls

    return decorate


def signature_of(fn: Callable, doc: str) -> Callable[[F], F]:
    """For a hand-written facade member (an iterator, say): `fn`'s parameters (functools.wraps), with
    its own return annotation, docstring and name."""

    def decorate(member: F) -> F:
        qualname, returns = member.__qualname__, inspect.signature(member).return_annotation
        out = functools.wraps(fn)(member)
        out.__doc__, out.__qualname__ = doc, qualname
        out.__signature__ = inspect.signature(fn).replace(return_annotation=returns)
        return out

    return decorate


def _named(cls: type, fn: Callable) -> Callable:
    fn.__qualname__ = f"{cls.__qualname__}.{fn.__name__}"
    fn.__module__ = cls.__module__
    return fn


def _init(cls: type, core: type, doc: str, thread_name: str, open_: Callable | None) -> Callable:
    async def make(args: tuple, kwargs: dict) -> Any:
        obj = core(*args, **kwargs)
        if open_ is None:
            return obj
        try:
            return await open_(obj)
        except BaseException:
            await obj.close()
            raise

    @functools.wraps(core.__init__)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._loop = LoopThread(thread_name)
        try:
            self._core = self._loop.run(make(args, kwargs))  # built inside the thread that runs it
        except BaseException:
            self._loop.close()
            raise

    __init__.__doc__ = doc
    return _named(cls, __init__)


def _method(cls: type, fn: Callable) -> Callable:
    name = fn.__name__
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        def blocking(self, *args: Any, **kwargs: Any) -> Any:
            return self._loop.run(getattr(self._core, name)(*args, **kwargs))

        return _named(cls, blocking)

    @functools.wraps(fn)
    def plain(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._core, name)(*args, **kwargs)

    return _named(cls, plain)


def _property(core: type, name: str) -> property:
    attr = inspect.getattr_static(core, name, None)
    doc = attr.__doc__ if isinstance(attr, property) else None
    return property(lambda self: getattr(self._core, name), doc=doc)
