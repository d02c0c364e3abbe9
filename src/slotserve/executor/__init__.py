"""Backends that run one batch step of a model over the KV pool.

`TorchExecutor` runs the eager PyTorch model (CPU, or CUDA where present). A lowered
ExecuTorch program would implement the same `step`.
"""

from slotserve.executor.torch_executor import Executor, TorchExecutor

__all__ = ["Executor", "TorchExecutor"]
