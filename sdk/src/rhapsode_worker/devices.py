"""
The device a torch adapter runs on, and what its model costs there (protocol.md section 3).

A torch adapter builds one L{TorchDevice} from the spawn contract before it serves
(L{TorchDevice.probe}): the device is C{RHAPSODE_WORKER_DEVICE} (C{cpu}, C{mps}, C{cuda}
or C{cuda:N}, from the core's config), and where that is unset the first card torch
sees, else Apple's Metal, else the CPU; never a hard-coded C{cuda:0}.  The probe imports
torch, so it runs before the reactor does, as the runtime's own CPU probe does; from then
on C{/capabilities} and C{/health} read what the probe and the last load or unload
recorded (L{rhapsode_worker._memory}), and never call into the device from the reactor
thread: a CUDA call can wait behind a kernel for as long as the kernel runs.

Around a load (L{TorchDevice.measured}) the device's memory is read on the worker
thread before and after: on a card, the card-wide bytes in use (C{mem_get_info}) once
the CUDA context exists, so the context, which stays for the life of the process, is
not counted as the model's; on the CPU the process's resident set.  The figure is what
the adapter's C{memory_bytes()} returns.  An unload (L{TorchDevice.release}) drops the
adapter's references, collects, empties torch's caching allocator and checks that the
memory came back, logging what did not.

On the CPU a generation takes cores from the budget every worker of the core shares
(L{TorchDevice.cores}), as L{BudgetedSession} does for onnxruntime: torch's intra-op
thread count is set to the cores the run holds, for that run.  L{seeded} seeds torch,
numpy and random on the thread that generates.

Nothing here is imported by the SDK itself, and torch is imported only on call.
"""

from __future__ import annotations

import gc
import os
import random
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, TypeVar

from twisted.logger import Logger

from rhapsode_protocol.spawn import DEVICE_VARIABLE

from . import _memory
from ._heap import malloc_trim
from ._threads import CoreGate, process_gate

__all__ = [
    "DEVICE_VARIABLE",
    "Released",
    "TorchDevice",
    "configured_device",
    "seeded",
]

_T = TypeVar("_T")

log = Logger(namespace="rhapsode_worker.devices")

_DEVICE = re.compile(r"cpu|mps|cuda(?::(\d{1,3}))?")

#: What an unload may leave behind on a card and still count as having given it back:
#: the allocator's bookkeeping and a kernel or two's workspace, never a model's weights.
RELEASE_TOLERANCE = 64 << 20


def configured_device(environ: Mapping[str, str]) -> str | None:
    """
    The device the spawn contract names, or None where it names none (or C{auto}).

    @raise ValueError: for anything but C{cpu}, C{mps}, C{cuda}, C{cuda:N} or C{auto}.
    """
    raw = environ.get(DEVICE_VARIABLE, "").strip().lower()
    if raw in ("", "auto"):
        return None
    if not _DEVICE.fullmatch(raw):
        raise ValueError(f"{DEVICE_VARIABLE} must be cpu, mps, cuda or cuda:N, not {raw!r}")
    return raw


def seeded(seed: int | None) -> None:
    """
    Seed torch (every card's generator too), numpy's global generator and random, on
    the calling thread's process, for a generation that was given a seed.  None leaves
    them as they are: an unseeded generation is whatever comes next.
    """
    if seed is None:
        return
    import numpy
    import torch

    random.seed(seed)
    numpy.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


@dataclass(frozen=True)
class Released:
    """
    What an unload gave back: the device's bytes in use before and after, and what the
    model had taken at its load.
    """

    before: int | None
    after: int | None
    baseline: int | None

    @property
    def left(self) -> int | None:
        """
        Bytes still held beyond what the device held before the load; None unmeasured.
        """
        if self.after is None or self.baseline is None:
            return None
        return max(0, self.after - self.baseline)


class TorchDevice:
    """
    The device of this worker and its memory, for an adapter that runs torch.

    Build it with L{probe} before serving; every other method blocks and runs on a
    worker thread (a load, an unload, a generation).

    @ivar name: C{cpu}, C{mps} or C{cuda:N}.
    @ivar kind: C{cpu}, C{mps} or C{cuda}.
    @ivar index: the card's index for C{cuda}, else None.
    """

    def __init__(self, name: str, environ: Mapping[str, str], gate: CoreGate | None = None) -> None:
        self.name = name
        self.kind = name.partition(":")[0]
        self.index = int(name.partition(":")[2]) if self.kind == "cuda" else None
        self._environ = environ
        self._gate = gate
        self._gate_lock = threading.Lock()
        #: Bytes in use on the device before the resident model was loaded.
        self.baseline: int | None = None
        #: What the resident model took, measured across its load.
        self.model_bytes: int | None = None

    # -- making one ---------------------------------------------------------------------

    @classmethod
    def probe(cls, environ: Mapping[str, str] | None = None) -> "TorchDevice":
        """
        Resolve the device the spawn contract gives this worker against what torch sees,
        and record it for C{/capabilities} and C{/health}.  Blocks (it imports torch):
        call it before serving.

        @raise ValueError: if the device is malformed, or names one this box lacks
            (a worker told to use a card it cannot see must not quietly use the CPU).
        """
        import torch

        environ = os.environ if environ is None else environ
        wanted = configured_device(environ)
        cuda = torch.cuda.is_available()
        mps = bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()
        if wanted is None:
            wanted = "cuda" if cuda else "mps" if mps else "cpu"
        if wanted.startswith("cuda"):
            if not cuda:
                raise ValueError(f"{DEVICE_VARIABLE} is {wanted}, but torch {torch.__version__} sees no CUDA card")
            index = int(wanted.partition(":")[2] or torch.cuda.current_device())
            if index >= torch.cuda.device_count():
                raise ValueError(f"{DEVICE_VARIABLE} is {wanted}, but this box has "
                                 f"{torch.cuda.device_count()} CUDA card(s)")
            wanted = f"cuda:{index}"
        elif wanted == "mps" and not mps:
            raise ValueError(f"{DEVICE_VARIABLE} is mps, but torch {torch.__version__} has no Metal device here")
        device = cls(wanted, environ)
        device._record()
        return device

    def torch(self) -> Any:
        """
        The C{torch.device} to put tensors on.
        """
        import torch

        return torch.device(self.name)

    # -- memory -------------------------------------------------------------------------

    def synchronize(self) -> None:
        import torch

        if self.kind == "cuda":
            torch.cuda.synchronize(self.index)
        elif self.kind == "mps":
            torch.mps.synchronize()

    def in_use(self) -> int | None:
        """
        The device's bytes in use now: card-wide on CUDA (every process's, as the
        driver counts them), torch's allocations on Metal, this process's RSS on the CPU.
        Blocks on the device.
        """
        import torch

        try:
            if self.kind == "cuda":
                self.synchronize()
                free, total = torch.cuda.mem_get_info(self.index)
                return int(total - free)
            if self.kind == "mps":
                self.synchronize()
                return int(torch.mps.driver_allocated_memory())
        except Exception as error:  # a device that stopped answering is unmeasured, not 0
            log.warn("could not read {device}'s memory: {error}", device=self.name, error=str(error))
            return None
        return _memory.resident_bytes()

    def allocated(self) -> int | None:
        """
        What torch's allocator holds for live tensors on this device (the CPU: RSS).
        """
        import torch

        if self.kind == "cuda":
            return int(torch.cuda.memory_allocated(self.index))
        if self.kind == "mps":
            return int(torch.mps.current_allocated_memory())
        return _memory.resident_bytes()

    def _context(self) -> None:
        # The CUDA context (hundreds of MiB) is made by the first allocation and lives
        # as long as the process: made before the first reading, it is never counted
        # as a model's, and an unload is not blamed for keeping it.
        if self.kind == "cuda":
            import torch

            torch.zeros(1, device=self.name)
            self.synchronize()

    def measured(self, load: Callable[[], _T]) -> _T:
        """
        Run C{load} (which puts a model on this device) and record what it took as
        L{model_bytes}: the device's bytes in use after less before, or None where that
        is not positive.  Blocks.
        """
        self._context()
        gc.collect()
        before = self.in_use()
        result = load()
        after = self.in_use()
        self.baseline = before
        self.model_bytes = _memory.load_delta(before, after)
        self._record(after)
        log.info("{device}: the load took {bytes} bytes ({before} in use before, {after} after)",
                 device=self.name, bytes=self.model_bytes, before=before, after=after)
        return result

    def release(self, drop: Callable[[], None]) -> Released:
        """
        Give the resident model's memory back: C{drop} removes the adapter's references
        to it, then the garbage is collected and torch's caching allocator emptied, and
        the device read again.  What stayed beyond the load's baseline is logged, as a
        warning past L{RELEASE_TOLERANCE}.  Blocks.
        """
        before = self.in_use()
        drop()
        gc.collect()
        self._empty_cache()
        after = self.in_use()
        released = Released(before=before, after=after, baseline=self.baseline)
        left = released.left
        if left is not None and self.kind != "cpu" and left > RELEASE_TOLERANCE:
            log.warn("{device}: an unload left {left} bytes beyond the {baseline} in use before the "
                     "load; a terminate gives them back", device=self.name, left=left,
                     baseline=self.baseline)
        else:
            log.info("{device}: unloaded, {before} bytes in use before, {after} after",
                     device=self.name, before=before, after=after)
        self.model_bytes = None
        self._record(after)
        return released

    def _empty_cache(self) -> None:
        import torch

        if self.kind == "cuda":
            torch.cuda.synchronize(self.index)
            torch.cuda.empty_cache()
        elif self.kind == "mps":
            torch.mps.empty_cache()
        else:
            _trim_heap()

    def _record(self, in_use: int | None = None) -> None:
        """
        Tell C{/capabilities} and C{/health} (which never touch the device) what this
        device is and holds.
        """
        info: dict[str, Any]
        if self.kind == "cpu":
            return  # the runtime's own CPU probe names it, and there is no card to count
        if self.kind == "cuda":
            import torch

            props = torch.cuda.get_device_properties(self.index)
            info = {"type": "cuda", "name": props.name, "vramBytes": int(props.total_memory)}
        else:
            info = {"type": "mps", "name": "Apple Metal"}
        _memory.note_device(self.name, info, in_use)

    # -- cores --------------------------------------------------------------------------

    @contextmanager
    def cores(self) -> Iterator[int]:
        """
        Hold cores of the budget every worker of this core shares for one generation,
        with torch's intra-op threads set to as many; yields that count.  On a card a
        generation runs one host thread and takes one core.  Blocks while none is free.
        """
        import torch

        with self._gate_lock:
            if self._gate is None:
                self._gate = process_gate(self._environ)
        gate = self._gate
        lease = gate.acquire(gate.cores if self.kind == "cpu" else 1)
        try:
            torch.set_num_threads(max(1, lease.count))
            yield lease.count
        finally:
            gate.release(lease)


def _trim_heap() -> None:
    # glibc keeps freed memory in its arenas; malloc_trim hands it back to the kernel,
    # which is what makes an unload show in the resident set.
    if malloc_trim is not None:
        malloc_trim()
