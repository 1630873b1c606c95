"""
For adapters that run an onnxruntime graph: the session that shares the cores the core
gives its workers, and the budget it shares them by (L{rhapsode_worker._threads}).

    from rhapsode_worker.onnx import BudgetedSession

    session = BudgetedSession(model_path)   # instead of onnxruntime.InferenceSession

Importing this module imports no onnxruntime: a session imports it when it is built.
"""

from rhapsode_protocol.spawn import CORE_DIR_VARIABLE, CORES_VARIABLE, machine_cores

from ._threads import BudgetedSession, CoreGate, core_budget

__all__ = [
    "BudgetedSession",
    "CORES_VARIABLE",
    "CORE_DIR_VARIABLE",
    "CoreGate",
    "core_budget",
    "machine_cores",
]
