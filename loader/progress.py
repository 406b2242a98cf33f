"""Rate-limited progress lines on stderr for long checkpoint writes and scans."""
from __future__ import annotations

import sys
import time


class Progress:
    """Prints `label: done/total GB (rate) note` at most once per `every` seconds, and at the end."""

    def __init__(self, label: str, total_bytes: int, enabled: bool = True, every: float = 2.0):
        self.label, self.total, self.enabled, self.every = label, total_bytes, enabled, every
        self.done = 0
        self.start = self.last = time.monotonic()

    def add(self, nbytes: int, note: str = "") -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and (now - self.last >= self.every or self.done >= self.total):
            self.last = now
            rate = self.done / max(now - self.start, 1e-9) / 1e6
            print(f"{self.label}: {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
                  f"({rate:.0f} MB/s) {note}", file=sys.stderr, flush=True)
