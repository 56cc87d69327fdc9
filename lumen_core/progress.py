"""What loading is doing, on stderr: the long phases (tokenizer, weights, kernel warm-up) each report.

On a terminal a phase shows a live line that counts its seconds (the weights a bar), replaced by its result
when it ends; elsewhere (a log, a pipe) each phase writes one line with its time when it ends. Disabled, it
prints nothing. The engine knows no screen: it only calls `phase` and `bar`.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager


class Phase:
    """The phase being timed; ``note`` (set while it runs) is added to its line, e.g. what it loaded."""

    def __init__(self, label: str):
        self.label, self.note, self.seconds = label, "", 0.0

    def line(self) -> str:
        return f"lumen: {self.label}: {self.seconds:.1f} s" + (f" ({self.note})" if self.note else "")


class Progress:
    def __init__(self, enabled: bool = True, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.live = enabled and _isatty(self.stream)

    @contextmanager
    def phase(self, label: str, live_line: bool = True):
        """Time the block as one phase; its line is written when it ends (not when it raises). ``live_line=False``
        for a phase that draws its own `bar`."""
        phase = Phase(label)
        ticker = _Ticker(self.stream, phase) if self.live and live_line else None
        start = time.perf_counter()
        try:
            yield phase
        finally:
            phase.seconds = time.perf_counter() - start
            if ticker is not None:
                ticker.stop()
        if self.enabled:
            print(phase.line(), file=self.stream, flush=True)

    def bar(self, total: int, label: str, unit: str):
        """A tqdm bar on a terminal (nothing elsewhere: the phase line says it all)."""
        from tqdm import tqdm

        return tqdm(total=total, desc=f"lumen: {label}", unit=unit, file=self.stream,
                    disable=not self.live or total < 2, leave=False)


class _Ticker:
    """A live 'lumen: LABEL … 3 s' line on a terminal, redrawn every half second until stopped."""

    def __init__(self, stream, phase: Phase):
        self.stream, self.phase = stream, phase
        self.start = time.perf_counter()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.5):
            elapsed = time.perf_counter() - self.start
            if elapsed >= 1.0:  # a short phase never flickers
                self.stream.write(f"\r\x1b[2Klumen: {self.phase.label} … {elapsed:.0f} s")
                self.stream.flush()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        self.stream.write("\r\x1b[2K")
        self.stream.flush()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
