"""Waiting on a condition in tests: poll with a deadline, never a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = 30.0, interval: float = 0.01) -> Any:
    """Poll a condition; return its first truthy value, or fail with `what` if it does not hold in time."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)
