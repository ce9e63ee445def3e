"""How many CPUs this process may use (tokenize's workers, serve's torch threads).

Offers `default_num_proc`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def default_num_proc(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may use: its affinity, at most its container's CPU quota (a pod
    limited to 4 CPUs on a 128-core node sees 128 in its affinity; 128 workers would not fit)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup)
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def _cgroup_quota(root: Path) -> float | None:
    """CPUs allowed by the cgroup's CPU quota (v2 cpu.max, v1 cfs quota/period); None: none."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None
