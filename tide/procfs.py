"""What the kernel says about a process of this host, read from /proc with no other call (the launcher's
hang report and the watchdog's issued board use it when a process may be wedged in the GPU driver)."""
from __future__ import annotations


def text(path: str) -> str | None:
    """A /proc file's text, or None when it cannot be read (the process is gone)."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def state(pid: int) -> str:
    """The kernel's state of a process ("R (running)", "Z (zombie)", ...), or "gone" when /proc has no such
    process (a rank stuck exiting in the driver shows "D" and prints no stack)."""
    status = text(f"/proc/{pid}/status")
    if status is None:
        return "gone"
    return next((line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("State:")),
                "state unknown")


def ended(process_state: str) -> bool:
    """Whether a :func:`state` says the process has ended: gone, a zombie, or dead."""
    return process_state == "gone" or process_state.startswith(("Z", "X"))
