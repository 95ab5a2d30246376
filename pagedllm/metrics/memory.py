"""Process memory readings for /metrics and the periodic log line (Linux ``/proc``)."""
from __future__ import annotations

import os
from typing import Optional


def resident_memory_bytes(pid: Optional[int] = None) -> int:
    """Resident set size of process ``pid`` (default: this one) in bytes.

    Source: the second field of ``/proc/<pid>/statm`` (resident pages) times the page size,
    the figure ``ps``/``top`` report as RSS. Returns 0 where ``/proc`` is unavailable.
    """
    path = f"/proc/{pid if pid is not None else 'self'}/statm"
    try:
        with open(path) as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def format_bytes(n: float) -> str:
    """``1.23 GiB`` / ``456.7 MiB`` (binary units)."""
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / 1024**2:.1f} MiB"
