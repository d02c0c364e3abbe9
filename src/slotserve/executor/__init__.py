"""Running a model's batch steps over the KV pool, behind the engine.

`Executor` (`slotserve.executor.base`) is the contract the engine relies on. `TorchExecutor`
runs a loaded model's layer halves: eager torch, the block kernels, or a bundle's program
methods on ExecuTorch (the halves `slotserve.load` picked). `executor_for` gives the one a
loaded model needs.
"""

from slotserve.executor.base import Executor, HiddenStates
from slotserve.executor.torch_executor import TorchExecutor, executor_for

__all__ = ["Executor", "HiddenStates", "TorchExecutor", "executor_for"]
