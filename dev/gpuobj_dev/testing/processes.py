"""Stopping child processes the same way everywhere: a signal, a bounded wait, SIGKILL as the last word."""

from __future__ import annotations

import signal
import subprocess


def terminate(proc: subprocess.Popen, timeout: float, sig: int = signal.SIGTERM) -> bool:
    """Send ``sig`` and wait up to ``timeout``; SIGKILL if it is still there. True if it exited in time."""
    if proc.poll() is not None:
        return True
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        return False
