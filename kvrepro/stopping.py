"""How the `kvrepro` command reacts to Ctrl-C (SIGINT), SIGTERM and SIGHUP, at any moment.

Three phases, one rule: the command ends with one line on stderr, exit 130, no traceback, and
nothing it started left running.

* **Start-up** (:func:`quiet_until_ready`, first thing `kvrepro.cli` does when it is the
  program): importing typer, rich and kvrepro takes a second or two; nothing has been started
  yet, so a signal prints ``interrupted`` and exits 130 at once.
* **Any command** (:func:`install_default`, from ``cli.main``): a signal raises
  :class:`Interrupted` (a ``KeyboardInterrupt``) in the main thread; what runs unwinds through
  its ``finally`` blocks (engines stopped, run folders marked) and the command exits 130.
* **Long-running commands** (:func:`stop_on_signals`: `matrix run`, `suite run`, `bisect`, `load replay`,
  `explore`, `triage --run`, `engine serve`):
  the first signal only sets a stop event: running repetitions are recorded, engines stopped, the
  rest marked interrupted; a second one raises :class:`Interrupted` to stop at once.

A raised :class:`Interrupted` can be lost: CPython runs a signal handler at the next bytecode
boundary, and when that falls inside a weakref callback or a ``__del__`` (importlib's module-lock
callback, mid-import, is one) the exception goes to ``sys.unraisablehook`` (by default a
traceback on stderr) and the program goes on. So the handlers also record the signal
(:func:`last_signal`), the hook drops such an exception without a traceback, and the record is
what counts: :func:`stop_on_signals` raises at once when a stop came before it, and the program
exits 130 whatever code a command returns after one (``kvrepro.report.terminal.run_program``), or
whatever error comes out of it (a library may turn the Interrupted into its own: pydantic-core,
interrupted while it built a validator, raised a SchemaError).

Only this module is imported before the handlers are in place, so it imports nothing heavy.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_CODE = 130  # README: "130 interrupted", whichever of the three signals it was


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived (typer turns a KeyboardInterrupt into exit 130)."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signum)
        self.signum = signum


def name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def _say(text: str) -> None:
    try:  # async-signal-safe enough: one write, no locks (rich may be mid-print)
        os.write(2, (text + "\n").encode())
    except OSError:
        pass


def quiet_until_ready() -> None:
    """Before the imports: a signal now exits 130 with one line (nothing has been started)."""

    def handler(signum, frame):  # noqa: ARG001
        _say(f"{name(signum)}: interrupted")
        os._exit(EXIT_CODE)

    for sig in SIGNALS:
        signal.signal(sig, handler)


_last: dict[str, int | None] = {"signum": None}


def last_signal() -> int | None:
    """The signal that interrupted this process, if any."""
    return _last["signum"]


def exit_code(code: int) -> int:
    """The program's exit code for a command that ended with ``code``: :data:`EXIT_CODE` once a stop
    signal came, even where its Interrupted was lost (module docstring)."""
    return EXIT_CODE if _last["signum"] is not None else code


def install_default() -> None:
    """Every signal raises :class:`Interrupted` in the main thread, with one line."""

    def handler(signum, frame):  # noqa: ARG001
        first = _last["signum"] is None
        _last["signum"] = signum
        if first:
            _say(f"{name(signum)}: interrupted")
        raise Interrupted(signum)

    for sig in SIGNALS:
        signal.signal(sig, handler)
    default_hook = sys.unraisablehook

    def unraisable(info) -> None:
        if isinstance(info.exc_value, Interrupted):
            return  # a lost stop: recorded above, acted on later (module docstring); not a traceback
        default_hook(info)

    sys.unraisablehook = unraisable


def ignore() -> None:
    """While exiting (cleanup after the command): nothing may interrupt that any more."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


@contextmanager
def deferred() -> Iterator[None]:
    """Stop signals wait (blocked, not lost) while a record's final status is written: a second
    Ctrl-C must not cut a status save short. Delivered, and handled as usual, on leaving."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread runs Python's signal handlers
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextmanager
def stop_on_signals(stop: threading.Event, on_first: Callable[[int], None] | None = None) -> Iterator[None]:
    """The first signal sets ``stop`` (and calls ``on_first(signum)``); the next raises
    :class:`Interrupted`. The handlers in place before are restored on leaving."""

    def handler(signum, frame):  # noqa: ARG001
        if stop.is_set():
            _last["signum"] = signum
            raise Interrupted(signum)
        _last["signum"] = signum
        stop.set()
        if on_first is not None:
            on_first(signum)

    previous = {sig: signal.signal(sig, handler) for sig in SIGNALS}
    try:
        if _last["signum"] is not None:  # a stop came before and its Interrupted was lost (module docstring)
            raise Interrupted(_last["signum"])
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def ignored() -> Iterator[None]:
    """Every run is recorded and nothing is left running; what remains (the table, the report)
    takes a moment. A further signal must not land inside it (a KeyboardInterrupt raised in a
    library's callback prints a traceback and leaves a half-written report): ignored, then the
    handlers in place before are back."""
    previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


__all__ = ["EXIT_CODE", "Interrupted", "SIGNALS", "deferred", "exit_code", "ignore", "ignored", "install_default",
           "last_signal", "name", "quiet_until_ready", "stop_on_signals"]
