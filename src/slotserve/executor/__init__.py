"""Backends that run one batch step of a model over the KV pool.

`TorchExecutor` runs the eager PyTorch model where its weights are (the CPU, as loaded
today). A lowered ExecuTorch program would implement the same `step`.
"""

from slotserve.executor.torch_executor import Executor, TorchExecutor

__all__ = ["Executor", "TorchExecutor"]
