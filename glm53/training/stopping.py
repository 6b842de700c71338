"""SIGINT / SIGTERM during `glm53 train`: finish the step in flight, save (with --save), exit 128 + the signal.

No tensors here. The trainer asks `SignalStop.signum` after every step (every rank agrees through one
all-reduce, trainer._agree); a second Ctrl-C raises KeyboardInterrupt at once (cli.py: exit 130, nothing more
saved). Outside the main thread signals are left alone.
"""

from __future__ import annotations

import signal
import sys


class Interrupted(Exception):
    """SIGINT / SIGTERM stopped the run after a complete step (saved when --save); `status` 128 + the signal."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class SignalStop:
    """A context manager installing the handlers; `signum` is the first signal received (None before)."""

    def __init__(self, announce: bool) -> None:
        self.announce, self.signum, self._old = announce, None, {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum
        if self.announce:
            print(
                f"\nglm53 train: {signal.Signals(signum).name}: finishing this step, then saving and stopping",
                file=sys.stderr,
                flush=True,
            )

    def __enter__(self) -> "SignalStop":
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread
            pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}


__all__ = ["Interrupted", "SignalStop"]
