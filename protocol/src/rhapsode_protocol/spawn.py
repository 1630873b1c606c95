"""
The spawn contract's names (protocol.md section 2): the environment variables a core
sets for each worker it starts, which the worker reads at start-up.

Both sides name them from here, so a rename cannot leave one side reading a variable
the other no longer sets.
"""

from __future__ import annotations

import os

__all__ = [
    "CONTRACT_VARIABLE",
    "CORES_VARIABLE",
    "CORE_DIR_VARIABLE",
    "DEVICE_VARIABLE",
    "ENGINE_VARIABLE",
    "LISTEN_VARIABLE",
    "LOG_LEVEL_VARIABLE",
    "VOICE_DIR_VARIABLE",
    "machine_cores",
]

#: Where the worker listens: C{unix:PATH} or C{tcp:HOST:PORT}.
LISTEN_VARIABLE = "RHAPSODE_WORKER_LISTEN"
#: The engine id the core knows the worker by.
ENGINE_VARIABLE = "RHAPSODE_WORKER_ENGINE"
#: The newest contract version the core speaks; the worker answers with its choice.
CONTRACT_VARIABLE = "RHAPSODE_WORKER_CONTRACT"
#: The folder the worker keeps its voices in.
VOICE_DIR_VARIABLE = "RHAPSODE_WORKER_VOICE_DIR"
#: The worker's log level (the core's, unless the engine's config says otherwise).
LOG_LEVEL_VARIABLE = "RHAPSODE_WORKER_LOG_LEVEL"
#: How many cores the worker's runs may use at once, all its generations together.
CORES_VARIABLE = "RHAPSODE_WORKER_CORES"
#: The folder of lock files every worker of one core shares to count those cores.
CORE_DIR_VARIABLE = "RHAPSODE_WORKER_CORE_DIR"
#: The device a torch worker puts its model on: C{cpu}, C{mps}, C{cuda} or C{cuda:N}
#: (the core's config for the engine; unset, the worker takes the first card it sees,
#: else the CPU).  A worker whose runtime has one device only ignores it.
DEVICE_VARIABLE = "RHAPSODE_WORKER_DEVICE"


def machine_cores() -> int:
    """
    The cores this process may run on (its CPU affinity), at least one.
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)
