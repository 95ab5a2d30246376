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


def anon_resident_bytes() -> int:
    """This process's resident anonymous memory in bytes (``RssAnon`` of ``/proc/self/status``,
    proc(5); kB x 1024): heap and anonymous mmaps such as the KV cache, without file-backed pages.

    Raises:
        RuntimeError: the kernel reports no ``RssAnon`` (not Linux, or before 4.5).
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def read_meminfo() -> dict[str, int]:
    """``/proc/meminfo`` (proc(5)) in bytes: ``{"MemTotal": ..., "MemAvailable": ..., ...}``
    (its ``kB`` figures x 1024); empty where the file is unavailable."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        return {}
    return out


def format_bytes(n: float) -> str:
    """``1.23 GiB`` / ``456.7 MiB`` (binary units)."""
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / 1024**2:.1f} MiB"
