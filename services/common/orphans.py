"""Files named after the process that made them (the lane's sockets, the rings' memory files),
and their removal once that process is gone: a service killed with SIGKILL cannot remove its
own, and each restart names new ones after its new pid."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether a process `pid` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_orphans(root: Path, pattern: str, pid_field: int) -> None:
    """Unlink the files of `root` matching `pattern` whose name's `pid_field`-th "-"-separated
    part (dots cut) names a process that is gone."""
    for old in root.glob(pattern):
        parts = old.name.split("-")
        pid = parts[pid_field].split(".")[0] if len(parts) > pid_field else ""
        if pid.isdigit() and not alive(int(pid)):
            with contextlib.suppress(OSError):
                old.unlink()
