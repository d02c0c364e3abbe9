"""Single-threaded numpy paths for the sampler's CPU tensors.

One logits row is too little work to split across torch's intra-op threads, and on a busy
device waking them costs milliseconds; where a tensor's memory can be shared with numpy, the
sampler and the grammar mask work through numpy instead. Owns no state.
"""

from __future__ import annotations

import torch


def numpy_view_ok(tensor: torch.Tensor) -> bool:
    """Whether ``tensor.numpy()`` shares its memory (CPU, dense, no autograd)."""
    return tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.requires_grad


def private_copy(logits: torch.Tensor) -> torch.Tensor:
    """A copy of ``logits`` the sampler may change; a single-threaded memcpy on the CPU
    (see the module docstring for why not torch's threaded clone)."""
    if numpy_view_ok(logits):
        return torch.from_numpy(logits.numpy().copy())
    return logits.clone()


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The index of each row's largest value in ``logits[B, vocab]`` (the first one on a
    tie; a NaN counts as largest), through numpy where it can share the memory: torch's
    argmax on one thread is many times slower on a large vocabulary's rows, a visible
    share of a decode step."""
    if numpy_view_ok(logits) and logits.dtype == torch.float32:
        indices: list[int] = logits.numpy().argmax(-1).tolist()
        return indices
    return logits.argmax(-1).tolist()
