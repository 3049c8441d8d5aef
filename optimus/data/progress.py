"""What `optimus data prepare` shows while it works: a bar on a terminal, plain lines elsewhere.

The bar follows the bytes of input read (compressed bytes for compressed files), so a source
of thousands of files and a single large one both move smoothly.
"""

from __future__ import annotations

import sys
import time

from optimus.files import human_bytes

PLAIN_EVERY_S = 10.0  # a log file gets a line this often, and one at the end


class PrepareProgress:
    """Counts documents, tokens, bytes and files; draws them when `enabled`."""

    def __init__(self, files: int, total_bytes: int, enabled: bool):
        self.files, self.total_bytes = files, total_bytes
        self.files_done = self.docs = self.tokens = self.bytes = 0
        self.enabled = enabled
        self._counted: dict[int, int] = {}  # bytes counted so far of each input in flight
        self._finished: set[int] = set()
        self._bar = self._task = None
        self._last_line = time.monotonic()
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(BarColumn(bar_width=20),
                                 TextColumn("{task.percentage:>3.0f}%"),
                                 TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
                                 TimeRemainingColumn(), console=Console(stderr=True))
            self._task = self._bar.add_task("prepare", total=max(1, total_bytes),
                                            detail=self._detail())
            self._bar.start()

    def _detail(self) -> str:
        return (f"{self.files_done}/{self.files} files, {self.docs:,} docs, "
                f"{self.tokens:,} tokens, {human_bytes(self.bytes)} of "
                f"{human_bytes(self.total_bytes)}")

    def add(self, i: int, docs: int, tokens: int, nbytes: int) -> None:
        """Input `i` read `nbytes` more and wrote `docs` documents of `tokens` tokens."""
        if i in self._finished:  # a late report: file_done counted its bytes already
            nbytes = 0
        else:
            self._counted[i] = self._counted.get(i, 0) + nbytes
        self.docs, self.tokens = self.docs + docs, self.tokens + tokens
        self.bytes += nbytes
        self._show()

    def file_done(self, i: int, size: int, docs: int = 0, tokens: int = 0) -> None:
        """Input `i` of `size` bytes is finished (one done before brings its documents and
        tokens: nothing was reported for it)."""
        self.files_done += 1
        self._finished.add(i)
        self.docs, self.tokens = self.docs + docs, self.tokens + tokens
        self.bytes += size - self._counted.pop(i, 0)
        self._show()

    def _show(self, final: bool = False) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.bytes, detail=self._detail())
        elif final or time.monotonic() - self._last_line >= PLAIN_EVERY_S:
            self._last_line = time.monotonic()
            print(f"prepare: {self._detail()}", file=sys.stderr, flush=True)

    def note(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(message)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._show()
            self._bar.stop()
        else:
            self._show(final=True)
