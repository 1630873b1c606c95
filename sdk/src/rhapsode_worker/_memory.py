"""
What device the worker runs on and what a load cost (protocol.md section 3).

A torch adapter's device (L{rhapsode_worker.devices.TorchDevice}) says which device it
is and what it holds through L{note_device}, from the worker thread that measured it;
once it has, these answer from what was noted and never call into the device, so
C{/health} and C{/capabilities} cannot wait behind a kernel.  Otherwise, on a CUDA
device, measured through torch when the adapter has already imported it (the SDK never
imports torch itself).  On the CPU, the cost of a load is the growth of this
process's resident set across C{load()}: it counts the weights, the runtime's arenas and
anything else allocated meanwhile, which is the right answer to "can another model fit"
and an over-estimate of "how big are the weights".  A delta that is not positive was not
measured and is reported as absent, never as 0.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any


def _torch_cuda() -> Any | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


#: The processor's name, once L{probe_cpu} has asked for it.
_cpu_name: str | None = None

#: What a torch adapter's device noted: its label, its capability block, and the bytes
#: it held at its last reading (None where it is the CPU, or unread).
_noted: tuple[str, dict[str, Any], int | None] | None = None


def note_device(label: str, info: dict[str, Any], in_use: int | None) -> None:
    """
    Record the worker's device, as read on a worker thread: C{/health} and
    C{/capabilities} report it from now on without asking the device.
    """
    global _noted
    _noted = (label, dict(info), in_use if in_use is None or in_use > 0 else None)


def probe_cpu() -> None:
    """
    Learn the processor's name.  Blocks: on Linux C{platform.processor()} runs
    C{uname -p}, so the runtime calls this at start-up, before the reactor runs, and
    C{GET /capabilities} only reads the answer.
    """
    global _cpu_name
    _cpu_name = platform.processor() or platform.machine()


def device_info() -> dict[str, Any]:
    """
    The C{device} block of the capability document.  Never blocks: without a
    L{probe_cpu} the CPU is named by its architecture (C{os.uname}, no child process).
    """
    if _noted is not None:
        return dict(_noted[1])
    torch = _torch_cuda()
    if torch is not None:
        props = torch.cuda.get_device_properties(0)
        return {"type": "cuda", "name": props.name, "vramBytes": int(props.total_memory)}
    name = _cpu_name if _cpu_name is not None else platform.machine()
    return {"type": "cpu", "name": name} if name else {"type": "cpu"}


def device_label() -> str:
    """
    The C{device} string of C{/health}: C{cpu}, C{mps} or C{cuda:N}.
    """
    if _noted is not None:
        return _noted[0]
    return "cuda:0" if _torch_cuda() is not None else "cpu"


def resident_bytes() -> int | None:
    """
    This process's resident set size, from C{/proc}; None where that is not readable.
    """
    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def device_bytes() -> int | None:
    """
    What the device holds now: CUDA memory reserved by torch, else this process's RSS.
    """
    torch = _torch_cuda()
    if torch is not None:
        try:
            torch.cuda.synchronize()
            return int(torch.cuda.memory_reserved())
        except Exception:
            return None
    return resident_bytes()


def vram_in_use() -> int | None:
    """
    C{vramBytes} for C{/health}: device memory in use, only where there is a card.
    """
    if _noted is not None:
        return _noted[2]
    torch = _torch_cuda()
    if torch is None:
        return None
    try:
        free, total = torch.cuda.mem_get_info()
    except Exception:
        return None
    used = int(total - free)
    return used if used > 0 else None


def load_delta(before: int | None, after: int | None) -> int | None:
    """
    The cost of a load, or None when it could not be measured (never 0 or negative).
    """
    if before is None or after is None or after <= before:
        return None
    return after - before
