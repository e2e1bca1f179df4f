"""The background side of an online learner (``OnlineRuntime.background``): a daemon
thread that runs the updates serving queues, holds at step boundaries while paused, and is
stopped before the interpreter exits."""

from __future__ import annotations

import atexit
import threading
import weakref

# Learners with a running thread. A process that exits with one still running aborts
# ("terminate called without an active exception": torch's C++ state is torn down under
# the thread), so the threads are stopped at exit, each given a bounded time to finish.
_running: weakref.WeakSet = weakref.WeakSet()
EXIT_JOIN_S = 30.0


@atexit.register
def _stop_learners_at_exit() -> None:
    for learner in list(_running):
        learner._stop(EXIT_JOIN_S)


class UpdateThread:
    """Base of ``OnlineLearner``: the queue of due updates and the thread that runs them.

    Serving queues an update by raising ``_due`` under ``_lock`` and notifying ``_wake``;
    the thread merges whatever is queued into one call of ``_run_update()``. A subclass
    provides ``_run_update()`` (one update; it handles its own failures) and
    ``_fault(kind, error)``, and calls ``_init_thread()`` before anything takes ``_lock``.
    Without a started thread (``_thread`` None) the learner trains inline and the pause
    controls do nothing.
    """

    def _init_thread(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._due = 0
        self._busy = False
        self._closed = False
        # pause(): the background thread holds at its next step boundary until resume().
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._parked = False
        self._thread: threading.Thread | None = None

    def _start_thread(self, name: str) -> None:
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _running.add(self)

    @property
    def busy(self) -> bool:
        """True while an update is queued or running."""
        with self._lock:
            return bool(self._due or self._busy)

    @property
    def training(self) -> bool:
        """True while the background thread runs an update (not while it holds, paused):
        the load it puts beside serving. Read without the lock: a step only samples it."""
        return self._busy and not self._parked

    def wait(self) -> None:
        """Block until no update is queued or running; while paused, until the background
        thread holds (the queued work goes on after :meth:`resume`)."""
        with self._lock:
            while (self._due or self._busy) and not self._parked:
                self._wake.wait(timeout=0.05)

    def pause(self) -> None:
        """Hold the background thread at its next step boundary (before an update, between
        optimizer steps, before the guard's evaluation) until :meth:`resume`: it then takes
        no CPU or memory bandwidth from serving. Requests go on being recorded and updates
        queue. An inline learner (``background=False``) trains only inside serving calls
        and ignores this."""
        self._unpaused.clear()

    def resume(self) -> None:
        """Let a paused background thread go on where it held."""
        with self._lock:
            self._unpaused.set()
            self._parked = False  # wait() blocks on the resumed work from here on

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

    def _hold(self) -> None:
        """In the background thread: block while paused."""
        if self._unpaused.is_set() or threading.current_thread() is not self._thread:
            return
        with self._lock:
            self._parked = True
            self._wake.notify_all()
        self._unpaused.wait()
        with self._lock:
            self._parked = False

    def close(self) -> None:
        """Stop the background thread (pending work is finished first; a paused learner
        is resumed for it)."""
        if self._thread is None:
            return
        self.resume()
        self.wait()
        self._stop(None)

    def _stop(self, timeout: float | None) -> None:
        """Let the thread finish what is queued, then end it (waiting at most ``timeout``
        seconds, None: as long as it takes)."""
        thread = self._thread
        if thread is None:
            return
        self.resume()
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        thread.join(timeout)
        if not thread.is_alive():
            self._thread = None
            _running.discard(self)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._due and not self._closed:
                    self._wake.wait()
                if self._closed and not self._due:
                    return
            self._hold()
            with self._lock:
                self._due = 0
                self._busy = True
            try:
                self._run_update()
            except Exception as e:
                # _run_update handles the update's own failures; this catches the rest
                # (a CUDA stream's). The thread must survive either way, or wait() would
                # block on a dead learner.
                self._fault("update_error", e)
            finally:
                with self._lock:
                    self._busy = False
                    self._wake.notify_all()

    def _run_update(self) -> None:
        raise NotImplementedError

    def _fault(self, kind: str, error: BaseException | str) -> None:
        raise NotImplementedError
