"""Request cancellation: one token per request, pushed to wherever the request is.

A :class:`CancelToken` is what ``InferRequest.cancelled`` holds once the server has
seen the request (:func:`ensure_token` wraps any other "has the client gone?"
callable). It turns cancelled once, with an :class:`~pdserve.core.errors.InferError`
saying why: the client went away or the gRPC call was cancelled / passed its deadline
(``CLIENT_GONE``), or the request's ``timeout`` parameter expired
(:func:`timeout_error`: ``UNAVAILABLE`` "Request timeout expired"); the metrics reason
is ``CANCELED`` either way. Whoever holds the request registers a callback for as long
as it holds it (see :class:`CancelToken`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from pdserve.core.errors import ErrorCode, InferError, client_gone

log = logging.getLogger("pdserve.cancel")

#: ``InferError.reason`` (and metrics label) of every cancellation.
CANCELED = "CANCELED"

Callback = Callable[["CancelToken"], None]


def timeout_error() -> InferError:
    """The error of a request whose ``timeout`` parameter expired (``UNAVAILABLE``,
    Triton's "Request timeout expired"; counted as a cancellation)."""
    return InferError("Request timeout expired", ErrorCode.UNAVAILABLE, reason=CANCELED)


class CancelToken:
    """One request's cancellation state. It cancels once, when:

    - the HTTP client disconnected (the HTTP frontend pushes uvicorn's disconnect) or
      the gRPC call was cancelled or passed its deadline (``context.add_done_callback``):
      ``CLIENT_GONE`` (HTTP 499, gRPC ``CANCELLED``), metrics reason ``CANCELED``;
    - the request's ``timeout`` parameter (µs, KServe V2 / Triton) expired
      (:meth:`CancelToken.set_deadline`): ``UNAVAILABLE`` "Request timeout expired"
      (HTTP 503, as Triton's queue timeout), metrics reason ``CANCELED``.

    Whoever holds the request registers a callback (:meth:`CancelToken.add_callback`)
    for as long as it holds it, or, when it only waits for the answer in a task, puts
    that task in :attr:`waiters` (see :func:`run_cancellable`): the dynamic batcher takes a queued request out of its
    queue (its ``max_queue_size`` slot is free at once), the ensemble scheduler starts
    no further step and cancels the steps in flight, the python backend tells the worker
    (``request.is_cancelled()`` turns True) and BLS children share a linked token
    (:meth:`CancelToken.child`). ``error`` is the state: a token without a ``probe``
    is read, not called; one with a probe is polled by calling it (True once cancelled).

    Triton: ``TRITONSERVER_InferenceRequestCancel`` / ``InferenceRequest::Cancel``
    (core ``infer_request.cc``); the python backend's ``request.is_cancelled()``
    (python_backend ``README.md`` "Request Cancellation Handling").

    Args:
        probe: a callable polled by :meth:`__call__` (e.g. the HTTP frontend's
            "connection lost" flag); when it returns True the token cancels with
            ``CLIENT_GONE``. None: nothing polled.
        loop: the event loop the request runs on, when the creator knows it:
            :func:`run_cancellable` then finds the current task with
            ``asyncio.current_task(loop)``, a dict lookup, instead of asking for the
            running loop (on Python 3.11 a ``getpid()`` system call per request).

    Not thread-safe: used on the server's event loop only.
    """

    __slots__ = (
        "probe",
        "error",
        "_callbacks",
        "waiters",
        "interrupted",
        "_timer",
        "deadline_ns",
        "finished",
        "_link",
        "queue_owned",
        "loop",
    )

    def __init__(
        self,
        probe: Callable[[], Any] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        #: polled by :meth:`__call__`; None: the token is pushed (read :attr:`error`).
        self.probe = probe
        self.loop = loop
        #: why the request was cancelled; None while it is not.
        self.error: InferError | None = None
        self._callbacks: list[Callback] = []
        #: tasks awaiting the request's answer: cancelled when the token cancels (a
        #: waiter appends its task and removes it when done, see :func:`run_cancellable`).
        self.waiters: list[asyncio.Task[Any]] = []
        #: the waiters this token cancelled (None: none): :meth:`interruption`, :meth:`leave`.
        self.interrupted: list[asyncio.Task[Any]] | None = None
        self._timer: asyncio.TimerHandle | None = None
        #: ``time.monotonic_ns()`` at which the request times out (0: no deadline).
        self.deadline_ns = 0
        #: the request was answered: a late cancellation changes nothing.
        self.finished = False
        #: (parent token, its forwarding callback) of a :meth:`child` token.
        self._link: tuple[CancelToken, Callback] | None = None
        #: a dynamic batcher level with ``allow_timeout_override`` took the request: its
        #: queue policy applies the ``timeout`` (REJECT or DELAY, as in Triton); the
        #: deadline cancels nothing.
        self.queue_owned = False

    def __call__(self) -> bool:
        """True once cancelled (polls the probe first)."""
        if self.error is not None:
            return True
        probe = self.probe
        if probe is not None and probe():
            self.cancel(client_gone())
            return True
        return False

    @property
    def is_timeout(self) -> bool:
        """Cancelled because the ``timeout`` parameter expired."""
        return self.error is not None and self.error.code is ErrorCode.UNAVAILABLE

    def cancel(self, error: InferError | None = None) -> bool:
        """Cancel the request (once; later calls are ignored).

        Args:
            error: why; default ``CLIENT_GONE``.

        Returns:
            True when this call cancelled it.
        """
        if self.error is not None or self.finished:
            return False
        self.error = error if error is not None else client_gone()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb(self)
            except Exception:  # one holder's failure must not stop the others
                log.exception("cancellation callback %r failed", cb)
        if self.waiters:
            self._interrupt()
        return True

    def _interrupt(self) -> None:
        """Cancel the waiting tasks, except the running one (cancelled by its own code,
        a poll, it raises the error itself)."""
        waiters, self.waiters = self.waiters, []
        try:
            current = asyncio.current_task(self.loop)
        except RuntimeError:  # no running loop: no task runs this code
            current = None
        for task in waiters:
            if task is not current:
                if self.interrupted is None:
                    self.interrupted = []
                self.interrupted.append(task)
                task.cancel()

    def interruption(self, task: asyncio.Task[Any]) -> InferError | None:
        """The error a waiter raises instead of the ``CancelledError`` that ended its
        wait: the token's, when the token cancelled ``task`` and nothing else did; None
        (re-raise) otherwise."""
        interrupted = self.interrupted
        error = self.error
        if interrupted and task in interrupted and task.uncancel() == 0 and error is not None:
            interrupted.remove(task)
            return error.fresh()
        return None

    def leave(self, task: asyncio.Task[Any]) -> None:
        """``task`` stops waiting: forget it; a cancellation this token asked of it that
        the awaited code swallowed is withdrawn."""
        if task in self.waiters:
            self.waiters.remove(task)
        elif self.interrupted and task in self.interrupted:
            self.interrupted.remove(task)
            if task.cancelling():
                task.uncancel()

    def add_callback(self, cb: Callback) -> None:
        """Call ``cb(token)`` when the token cancels (at once when it already has)."""
        if self.error is not None:
            cb(self)
        elif not self.finished:
            self._callbacks.append(cb)

    def remove_callback(self, cb: Callback) -> None:
        """Forget ``cb`` (the holder let go of the request); no error when unknown."""
        try:
            self._callbacks.remove(cb)
        except ValueError:
            pass

    def set_deadline(self, timeout_ns: int, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Cancel with :func:`timeout_error` ``timeout_ns`` from now (an earlier
        deadline than the current one only)."""
        if timeout_ns <= 0 or self.error is not None:
            return
        now = time.monotonic_ns()
        at = now + timeout_ns
        if self.deadline_ns and self.deadline_ns <= at:
            return
        self.deadline_ns = at
        if self._timer is not None:
            self._timer.cancel()
        loop = loop or asyncio.get_running_loop()
        self._timer = loop.call_later(timeout_ns / 1e9, self._expire)

    def remaining_us(self) -> int:
        """Microseconds left before the deadline (>= 1); 0 when there is none."""
        if not self.deadline_ns:
            return 0
        return max(1, (self.deadline_ns - time.monotonic_ns()) // 1000)

    def _expire(self) -> None:
        self._timer = None
        if not self.queue_owned:
            self.cancel(timeout_error())

    def finish(self) -> None:
        """The request was answered: drop the timer and the callbacks."""
        self.finished = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._callbacks.clear()
        if self._link is not None:
            parent, forward = self._link
            self._link = None
            parent.remove_callback(forward)

    def child(self, timeout_ns: int = 0) -> CancelToken:
        """A token cancelled with this one (same error), optionally with its own
        earlier deadline (an ensemble step's timeout); cancelling the child leaves
        this one alone. The link is dropped when the child finishes."""
        sub = CancelToken()
        if self.error is not None:
            sub.error = self.error
            return sub

        def forward(parent: CancelToken) -> None:
            sub.cancel(parent.error)

        self.add_callback(forward)
        sub._link = (self, forward)
        if self.deadline_ns:
            sub.deadline_ns = self.deadline_ns
        if timeout_ns > 0:
            sub.set_deadline(timeout_ns)
        return sub


def ensure_token(request: Any) -> CancelToken:
    """``request.cancelled`` as a :class:`CancelToken` (wrapping a plain callable or
    creating one), stored back on the request."""
    current = request.cancelled
    if isinstance(current, CancelToken):
        return current
    token = CancelToken(current)
    request.cancelled = token
    return token


def queue_owns_timeout(request: Any) -> None:
    """A queue whose policy applies the request's ``timeout`` parameter took it (a
    dynamic batcher level with ``allow_timeout_override``, Triton's semantics): the
    token's deadline cancels nothing from now on."""
    token = token_of(request)
    if token is not None:
        token.queue_owned = True


def token_of(request: Any) -> CancelToken | None:
    """The request's :class:`CancelToken`, or None when it has none."""
    current = request.cancelled
    return current if isinstance(current, CancelToken) else None


def parse_timeout_us(parameters: dict[str, Any]) -> int:
    """The request's ``timeout`` parameter in µs (0: none or not a positive int)."""
    value = parameters.get("timeout")
    if isinstance(value, bool):
        return 0
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return value if isinstance(value, int) and value > 0 else 0


def arm_cancellation(request: Any) -> CancelToken:
    """Give a request arriving at the server its token and, when it has a ``timeout``
    parameter, its deadline (counted from ``request.arrival_ns``).

    Returns:
        the token; the caller calls :meth:`CancelToken.finish` once it answered.
    """
    token = ensure_token(request)
    params = request.parameters
    us = parse_timeout_us(params) if params else 0
    if us:
        left = us * 1000 - (time.monotonic_ns() - request.arrival_ns)
        token.set_deadline(max(1, left))
    return token


async def run_cancellable(token: CancelToken | None, awaitable: Any) -> Any:
    """``await awaitable`` in the current task; when ``token`` cancels meanwhile the
    wait is cancelled (``asyncio`` cancellation of this task: a queued request leaves
    its queue, a waiting one stops waiting) and the token's error is raised instead.

    The scheduler on the common path (``DirectScheduler.submit``) does the same itself:
    its task in :attr:`CancelToken.waiters`, :meth:`CancelToken.interruption` and
    :meth:`CancelToken.leave` only once the token cancelled.

    Raises:
        InferError: the token's error (``CLIENT_GONE`` or the timeout), or the
            awaitable's own.
    """
    if token is None:
        return await awaitable
    if token():
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        assert token.error is not None
        raise token.error.fresh()
    # With the token's loop known this is a dict lookup; without, 3.11 asks for the
    # running loop, which checks the process id with a getpid() system call.
    task = asyncio.current_task(token.loop)
    assert task is not None
    token.waiters.append(task)
    try:
        return await awaitable
    except asyncio.CancelledError:
        error = token.interruption(task)
        if error is None:
            raise
        raise error from None
    finally:
        token.leave(task)
        # an error raised here has a traceback through this frame, and the task keeps
        # that error: without this, error -> frame -> task -> error would be a cycle
        # holding the request's tensors until a full garbage collection
        task = awaitable = None
