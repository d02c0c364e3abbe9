"""The compiled KV kernel (`kernels/update_and_attend.c`): in a decode-sized step, one call
per layer writes the new K/V rows into the pool's cells and attends over the cells in place,
without the gather, padding, mask and a dozen small torch ops of the torch path.

Built once per machine with the system C compiler (``-O3 -march=native``, `slotserve.paths`)
and loaded with ctypes. Where there is no compiler, or the build fails, `attention_kernel`
returns None and the pool keeps the torch path (the reason is logged once).
``SLOTSERVE_ATTENTION=torch`` turns the kernel off for a process.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from slotserve.paths import load_library, process_cores

SOURCE = Path(__file__).with_name("kernels") / "update_and_attend.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}

_log = logging.getLogger(__name__)
_POINTER, _I64 = ctypes.c_void_p, ctypes.c_int64


Storage = tuple[torch.Tensor, torch.Tensor | None]  # (data, int8 scales)


class AttentionKernel:
    """``update_and_attend`` of a loaded library: see the C source for the contract."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = library.update_and_attend
        self._function.restype = ctypes.c_int
        self._function.argtypes = [
            _POINTER,
            _I64,
            *(_POINTER,) * 2,
            _I64,
            *(_POINTER,) * 6,
            ctypes.c_int,
            _POINTER,
            _I64,
            *(_POINTER,) * 2,
            *(_I64,) * 5,
            ctypes.c_float,
            _POINTER,
            ctypes.c_int,
        ]

    def update_and_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        step: StepCells,
        keys: Storage,
        values: Storage,
        window: int | None,
    ) -> torch.Tensor:
        """Store the step's ``k, v[T, kv_heads, dim]`` at cells ``step.write`` of the
        ``keys`` and ``values`` storages, then return the attention of ``q[T, heads, dim]``
        (query ``t`` of sequence ``step.seq[t]`` at position ``step.pos[t]``) over the keys
        at positions ``0..pos[t]`` (the last ``window`` of them), which live at
        ``step.cells[seq[t], p]``: ``[T, heads * dim]`` fp32. ``q, k, v`` may be row-strided
        views (of one fused projection): they are read in place."""
        q, k, v = _rows(q), _rows(k), _rows(v)
        if k.stride(0) != v.stride(0):
            k, v = k.contiguous(), v.contiguous()
        pointers = (q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0))
        return self._run(pointers, q.shape[1], step, keys, values, window)

    def update_and_attend_rows(
        self,
        qkv: torch.Tensor,
        heads: int,
        step: StepCells,
        keys: Storage,
        values: Storage,
        window: int | None,
    ) -> torch.Tensor:
        """The same for one fused projection's rows, ``qkv[T, (heads + 2·kv_heads)·dim]``
        (the query heads, then the key heads, then the value heads), read in place: no view
        of it is made (in a step, each torch call costs several microseconds)."""
        if qkv.dtype != torch.float32 or qkv.stride(1) != 1:
            qkv = qkv.float().contiguous()
        width = keys[0].shape[1] * keys[0].shape[2] * 4  # one row's K (or V) bytes
        start, stride = qkv.data_ptr(), qkv.stride(0)
        q_bytes = heads * keys[0].shape[2] * 4
        pointers = (start, stride, start + q_bytes, start + q_bytes + width, stride)
        return self._run(pointers, heads, step, keys, values, window)

    def _run(
        self,
        rows: tuple[int, int, int, int, int],
        heads: int,
        step: StepCells,
        keys: Storage,
        values: Storage,
        window: int | None,
    ) -> torch.Tensor:
        """One call: ``rows`` are the pointers and row strides of q, k and v."""
        (data, key_scales), (value_data, value_scales) = keys, values
        n_queries, kv_heads, dim = step.write.shape[0], data.shape[1], data.shape[2]
        out = torch.empty(n_queries, heads * dim)
        status = self._function(
            *rows,
            step.pointers[0],
            out.data_ptr(),
            data.data_ptr(),
            value_data.data_ptr(),
            key_scales.data_ptr() if key_scales is not None else None,
            value_scales.data_ptr() if value_scales is not None else None,
            DTYPE_CODES[data.dtype],
            step.pointers[1],
            step.key_len,
            *step.pointers[2:4],
            n_queries,
            heads,
            kv_heads,
            dim,
            window or 0,
            dim**-0.5,
            step.pointers[4],
            step.threads,
        )
        if status != 0:
            raise ValueError(
                f"update_and_attend refused its arguments ({n_queries} queries of {heads} "
                f"heads, cells {tuple(step.cells.shape)}, positions {step.pos.tolist()}): a "
                "query position is past the cells given, or the head counts do not divide"
            )
        return out


@dataclass(frozen=True)
class StepCells:
    """One step's indices for the kernel, made once and shared by every layer of a group:
    ``write[T]`` the cells of the new rows, ``cells[B, key_len]`` the cell of each
    sequence's positions, ``seq[T]`` and ``pos[T]`` each query's sequence and position, and
    the ``scratch`` the softmax needs (``heads / kv_heads * key_len`` floats for each of
    ``threads``, the process's cores: the kernel shares a large step's work out over
    OpenMP threads); ``pointers`` are their addresses, read once."""

    write: torch.Tensor
    cells: torch.Tensor
    seq: torch.Tensor
    pos: torch.Tensor
    scratch: torch.Tensor
    pointers: tuple[int, int, int, int, int]
    key_len: int
    threads: int

    @classmethod
    def of(
        cls,
        write: torch.Tensor,
        cells: torch.Tensor,
        seq: torch.Tensor,
        pos: torch.Tensor,
        queries_per_kv_head: int,
    ) -> StepCells:
        write, cells, seq, pos = (t.to(torch.int64).contiguous() for t in (write, cells, seq, pos))
        if write.shape != seq.shape or seq.shape != pos.shape:
            raise ValueError(
                f"write {tuple(write.shape)}, seq {tuple(seq.shape)} and pos "
                f"{tuple(pos.shape)} must have one entry per query row"
            )
        threads = process_cores()
        scratch = torch.empty(threads, queries_per_kv_head * cells.shape[1])
        pointers = (
            write.data_ptr(),
            cells.data_ptr(),
            seq.data_ptr(),
            pos.data_ptr(),
            scratch.data_ptr(),
        )
        return cls(write, cells, seq, pos, scratch, pointers, cells.shape[1], threads)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x[T, heads, dim]`` as fp32 whose heads and values are contiguous within a row
    (rows may be apart: a view into a fused projection stays a view, without a copy)."""
    if x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.float().contiguous()


@functools.cache
def attention_kernel() -> AttentionKernel | None:
    """The kernel for this machine, built on first use; None where it cannot be built or
    ``SLOTSERVE_ATTENTION=torch``."""
    if os.environ.get("SLOTSERVE_ATTENTION", "") == "torch":
        return None
    try:
        return AttentionKernel(load_library(SOURCE, FLAGS))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        _log.warning("attention kernel unavailable (%s); using torch SDPA", detail)
        return None
