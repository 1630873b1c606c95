"""
The thread pools the worker runs blocking calls on, as the scheduler and the model state
see them: anything with Twisted's C{ThreadPool.callInThreadWithCallback}, so that a test
(or L{rhapsode_worker.testing}) can hand them a pool that runs its calls when it says.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, TypeVar, runtime_checkable

from twisted.internet.defer import Deferred

_T = TypeVar("_T")


@runtime_checkable
class WorkerPool(Protocol):
    """
    What the worker uses of L{twisted.python.threadpool.ThreadPool}.
    """

    def callInThreadWithCallback(
        self, onResult: Callable[[bool, Any], object], func: Callable[..., Any], /, *args: Any, **kw: Any
    ) -> None: ...


def in_pool(reactor: Any, pool: WorkerPool, f: Callable[..., _T], *args: Any) -> "Deferred[_T]":
    """
    Run C{f(*args)} on C{pool}; the result (or failure) reaches the reactor thread
    through C{reactor.callFromThread}, as C{twisted.internet.threads.deferToThreadPool}
    does, which takes only a real C{ThreadPool}.
    """
    d: Deferred[_T] = Deferred()

    def on_result(success: bool, result: Any) -> None:
        if success:
            reactor.callFromThread(d.callback, result)
        else:
            reactor.callFromThread(d.errback, result)

    pool.callInThreadWithCallback(on_result, f, *args)
    return d
