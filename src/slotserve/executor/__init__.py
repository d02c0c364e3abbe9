"""Backends that run one batch step of a model over the KV pool.

`TorchExecutor` runs the eager PyTorch model; `ExecuTorchExecutor`
(`slotserve.executor.executorch`, optional ``executorch`` package) runs a bundle's lowered
program. `executor_for` picks the one a loaded model needs.
"""

from slotserve.executor.torch_executor import Executor, TorchExecutor, executor_for

__all__ = ["Executor", "TorchExecutor", "executor_for"]
