"""Ctrl-C and SIGTERM of the process that runs a job (``kc train``), stopped the way torchrun stops (issue 45 §1).

Before, a Ctrl-C raised ``KeyboardInterrupt`` wherever the flow was: the launch task and the flow run ended
*Crashed*, the ranks were SIGKILLed mid-step, and Prefect printed its crash reports. Here :func:`install` (by
``kc train``, before anything starts) takes SIGINT and SIGTERM — the terminal's Ctrl-C, Slurm's ``scancel``,
a Prefect cancellation of the process — and the job stops on purpose:

- **first signal**, while this process's launcher waits for its ranks (:func:`attempt`, local attempts): the
  attempt's stop file (``$KC_STOP_FILE`` of the ranks, see :mod:`kuangchao_core.engine.live_config`) is created, so
  the ranks stop together at their next check (every ``train.log_interval`` steps), checkpoint that step and exit;
  the launcher then raises :class:`Interrupted` (ending them itself :data:`ACKNOWLEDGED_EXIT_S` after they said
  so, rather than wait seconds for their interpreters and torchrun to exit). Ranks not stopped within ``grace_s``
  (``$KC_INTERRUPT_GRACE_S``, default 8 s) are killed at once (:func:`overdue`): the newest published checkpoint
  stays intact, since a save in flight is only a temporary directory until it is published.
- **first signal** anywhere else (preparing, between attempts, finishing, or a Slurm or multi-node attempt, whose own
  clean-up on an exception cancels its ranks): :class:`Interrupted` is raised where the main thread is, as Python
  raises ``KeyboardInterrupt``; the flow ends its run *Cancelled* with one line (:func:`line`).
- **a second signal**: the ranks are killed at once and the hook given to :func:`install` runs (``kc train``: the
  one line and exit ``128 + N``, without waiting for the flow).

:func:`note_event` (a listener of the launcher's view) keeps the last step the ranks reported, for that line.
"""

from __future__ import annotations

import os
import shlex
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: the ranks' stop file of a local attempt, in its ``attempt_<n>`` directory
STOP_FILE = "interrupt_stop"
ENV_GRACE = "KC_INTERRUPT_GRACE_S"
DEFAULT_GRACE_S = 8.0
#: how long ranks that stopped and checkpointed get to exit on their own (rank 0 flushes its last metrics)
ACKNOWLEDGED_EXIT_S = 1.5
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The job's process was sent SIGINT or SIGTERM. A BaseException, as ``KeyboardInterrupt``: no ``except
    Exception`` (a task's retry, the recovery loop) takes it for a failure to answer."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


class _Attempt:
    """The ranks this process's launcher waits for: their stop file, and how to kill them now."""

    def __init__(self, stop_file: str | None) -> None:
        self.stop_file = stop_file
        self.kill: Callable[[], None] | None = None  # set once the group is started
        self.acknowledged_at: float | None = None  # when the launcher first saw the ranks' acknowledgement


class _State:
    def __init__(self, on_second: Callable[[int], None] | None, grace_s: float) -> None:
        self.on_second = on_second
        self.grace_s = grace_s
        self.signum: int | None = None
        self.count = 0
        self.at: float | None = None
        self.attempt: _Attempt | None = None
        self.last_step: int | None = None
        self.hooks: list[Callable[[], None]] = []  # run at the first signal (quiet the console)


_STATE: _State | None = None
_LOCK = threading.Lock()


def install(on_second: Callable[[int], None] | None = None, grace_s: float | None = None) -> None:
    """Take SIGINT and SIGTERM in this process from now on (call from the main thread); ``on_second(signum)`` runs
    at a second signal, after the ranks were killed (it may end the process; if it returns, :class:`Interrupted`
    is raised)."""
    global _STATE
    grace = float(grace_s if grace_s is not None else os.environ.get(ENV_GRACE) or DEFAULT_GRACE_S)
    _STATE = _State(on_second, grace)
    rearm()


def rearm() -> None:
    """Take the signals again where other code took them meanwhile (Prefect's flow engine installs its own SIGTERM
    handler while a flow runs, and puts back the one it found when the flow ends); nothing when :func:`install` was
    not called or outside the main thread."""
    if _STATE is None or threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)


@contextmanager
def installed(on_second: Callable[[int], None] | None = None) -> Iterator[None]:
    """:func:`install` for the block; on the way out the handlers found before are back and the state is gone (a
    command run in-process by a test leaves its runner's Ctrl-C as it was)."""
    global _STATE
    main = threading.current_thread() is threading.main_thread()
    before = {sig: signal.getsignal(sig) for sig in SIGNALS} if main else {}
    install(on_second)
    try:
        yield
    finally:
        _STATE = None
        for sig, handler in before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def requested() -> int | None:
    """The signal that interrupted the job, or None."""
    return _STATE.signum if _STATE is not None else None


def exit_code() -> int:
    """The process's exit code after an interrupt: ``128 + N`` (130 for Ctrl-C, 143 for SIGTERM)."""
    return 128 + int(requested() or signal.SIGINT)


def last_step() -> int | None:
    """The last step the ranks reported before the interrupt (None: none reported)."""
    return _STATE.last_step if _STATE is not None else None


def on_request(hook: Callable[[], None]) -> Callable[[], None]:
    """Run ``hook`` at the first signal (at once if it came already); returns a function that removes it."""
    if _STATE is None:
        return lambda: None
    state = _STATE
    if state.signum is not None:
        hook()
    state.hooks.append(hook)
    return lambda: hook in state.hooks and state.hooks.remove(hook)


def note_event(event: dict[str, Any]) -> None:
    """A listener of the ranks' events: remembers the newest step they reported (``step``, ``steps``,
    ``stopped``)."""
    if _STATE is None or event.get("event") not in ("step", "steps", "stopped"):
        return
    step = event.get("step")
    if isinstance(step, int) and (_STATE.last_step is None or step > _STATE.last_step):
        _STATE.last_step = step


def _on_signal(signum: int, _frame: Any) -> None:
    state = _STATE
    if state is None:  # uninstalled meanwhile: Python's own behaviour
        raise KeyboardInterrupt
    with _LOCK:
        state.count += 1
        first = state.count == 1
        if first:
            state.signum, state.at = signum, time.monotonic()
        attempt = state.attempt
    if first:
        for hook in list(state.hooks):
            try:
                hook()
            except Exception:  # noqa: BLE001, S110 - a hook must not keep the stop from happening
                pass
        if attempt is not None and attempt.stop_file:
            _touch(attempt.stop_file, f"interrupted by {signal.Signals(signum).name}")
            return  # the launcher ends the attempt (at the ranks' next check, or after the grace)
        raise Interrupted(signum)
    if attempt is not None and attempt.kill is not None:
        attempt.kill()
    if state.on_second is not None:
        state.on_second(state.signum or signum)
    raise Interrupted(state.signum or signum)


def _touch(path: str, text: str) -> None:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n", encoding="utf-8")
    except OSError:  # the ranks will not see it: the grace ends them
        pass


@contextmanager
def attempt(stop_file: str | None) -> Iterator[_Attempt]:
    """Around the launcher's wait for its ranks: an interrupt creates ``stop_file`` (the ranks' ``$KC_STOP_FILE``;
    None: they are stopped at once) instead of raising. Set ``.kill`` on the yielded object once the ranks run.
    (Call :func:`raise_if_requested` before starting anything: an interrupt that came already is not repeated.)"""
    state = _STATE
    current = _Attempt(stop_file)
    if state is None:
        yield current
        return
    with _LOCK:
        state.attempt = current
    try:
        yield current
    finally:
        with _LOCK:
            state.attempt = None


def overdue() -> bool:
    """An interrupt came and the ranks have had their grace to stop on their own, or they have stopped and said so
    (``<stop file>.step``: their checkpoint is published) :data:`ACKNOWLEDGED_EXIT_S` ago: end them now (their
    interpreters' and torchrun's own exit take seconds more on a loaded machine, and save nothing)."""
    state = _STATE
    if state is None or state.at is None:
        return False
    now = time.monotonic()
    if now - state.at >= state.grace_s:
        return True
    current = state.attempt
    if current is None or not current.stop_file or not os.path.exists(f"{current.stop_file}.step"):
        return False
    current.acknowledged_at = current.acknowledged_at or now
    return now - current.acknowledged_at >= ACKNOWLEDGED_EXIT_S


def raise_if_requested() -> None:
    """Raise :class:`Interrupted` when the job was interrupted (the launcher, once its ranks have ended)."""
    if requested() is not None:
        raise Interrupted(requested())


@contextmanager
def children_spared() -> Iterator[None]:
    """Processes started inside start with SIGINT blocked (the mask is inherited through fork and exec): the
    terminal's Ctrl-C reaches this process's whole group, and is this process's to answer — a child started with
    multiprocessing's ``spawn`` would print its own ``KeyboardInterrupt`` traceback. The child calls
    :func:`ignore_terminal_interrupt` first; this process stops it when it must."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def ignore_terminal_interrupt() -> None:
    """In a child started under :func:`children_spared`: SIGINT ignored, then unblocked."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def line(step: int | None, checkpoint_step: int | None, config: str, overrides: list[str]) -> str:
    """The one line of an interrupted ``kc train``: where it stopped, its newest checkpoint, the command that
    continues it (the same ``--set`` overrides: they decide the lineage)."""
    at = f"interrupted at step {step}" if step is not None else "interrupted before the first step"
    saved = f"last checkpoint step {checkpoint_step}" if checkpoint_step is not None else "no checkpoint yet"
    command = ["kc", "train", "--config", config, *[a for o in overrides for a in ("--set", o)], "--resume", "auto"]
    return f"{at}; {saved}; resume with: {shlex.join(command)}"
