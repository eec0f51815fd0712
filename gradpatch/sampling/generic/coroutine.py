"""An ``async def`` sampler under :func:`gradpatch.differentiable`: its coroutine driven step by step,
each resumption inside the call's context (grad-off constructs of the sampler's code lifted, copy on
write, the step counted), and the caller's context between resumptions, so other tasks of the event
loop run as written while the sampler awaits."""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable

from gradpatch.sampling.generic import gradoff


def _resume(coro: Any, how: str, value: Any) -> Any:  # the boundary of a coroutine's resumption
    return coro.send(value) if how == "send" else coro.throw(value)


gradoff.BOUNDARY.add(_resume.__code__)


class _Resumed:
    def __init__(self, coro: Any, entered: Callable[[], Any], stack: contextlib.ExitStack,
                 finish: Callable[[Any], Any]) -> None:
        self.coro, self.entered, self.stack, self.finish = coro, entered, stack, finish

    def __await__(self) -> Any:
        with self.stack:
            how, value = "send", None
            while True:
                try:
                    with self.entered():
                        item = _resume(self.coro, how, value)
                except StopIteration as stop:
                    result = stop.value
                    break
                try:
                    how, value = "send", (yield item)  # the event loop's future, passed through
                except GeneratorExit:
                    self.coro.close()
                    raise
                except BaseException as error:  # noqa: BLE001 - a cancellation, passed on to the sampler
                    how, value = "throw", error
        return self.finish(result)


def awaited(coro: Any, entered: Callable[[], Any], stack: contextlib.ExitStack,
            finish: Callable[[Any], Any]) -> Any:
    """A coroutine that runs the sampler's ``coro``, each resumption inside ``entered()``, with ``stack``
    (the call's shadows) closed at the end or when it is dropped unawaited; its result goes through
    ``finish`` (the plain call's checks)."""

    async def call() -> Any:
        return await _Resumed(coro, entered, stack, finish)

    waiting = call()
    weakref.finalize(waiting, stack.close)
    return waiting
