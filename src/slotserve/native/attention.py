"""Binding of ``csrc/attention.c``: a layer's KV write and attention for one step, in the
pool's cells, in place (no gather, padding or mask; see the C source for the contract).

`AttendArgs` mirrors the C ``attend_args`` struct field for field (a test compares their
layouts); `StepCells` is one step's cell indices, made once and shared by every layer.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from slotserve.native.abi import layout_mismatch

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}

_P, _I64 = ctypes.c_void_p, ctypes.c_int64

Storage = tuple[torch.Tensor, torch.Tensor | None]  # (data, int8 scales)


class AttendArgs(ctypes.Structure):
    """``attend_args`` of the C source."""

    _fields_ = [
        ("q", _P), ("q_stride", _I64), ("k_new", _P), ("v_new", _P), ("kv_stride", _I64),
        ("write", _P), ("out", _P), ("keys", _P), ("values", _P), ("key_scales", _P),
        ("value_scales", _P), ("keys_step", _P), ("values_step", _P), ("key_step_scales", _P),
        ("value_step_scales", _P), ("step_split", _I64), ("dtype", _I64), ("cells", _P),
        ("key_len", _I64), ("seq", _P),
        ("pos", _P), ("n_queries", _I64), ("heads", _I64), ("kv_heads", _I64), ("dim", _I64),
        ("window", _I64), ("sinks", _I64), ("scale", ctypes.c_float), ("scratch", _P),
        ("threads", _I64),
    ]  # fmt: skip


@dataclass(frozen=True)
class StepCells:
    """One step's indices for the kernel, made once and shared by every layer of a group:
    ``write[T]`` the cells of the new rows, ``cells[B, key_len]`` the cell of each
    sequence's positions, ``seq[T]`` and ``pos[T]`` each query's sequence and position, and
    the ``scratch`` the softmax needs (``heads / kv_heads * key_len`` floats for each of
    ``threads``: the kernel shares a large step's work out over OpenMP threads);
    ``pointers`` are their addresses, read once (each torch call in a step costs
    microseconds, and a step has one kernel call a layer).

    ``step_rows`` (optional): K and V buffers, of the storage's dtype, for the step's new rows;
    cells from ``split`` on name their rows (cell ``split + t``: row t). A ring writes there
    first, so every query reads its keys from storage-dtype rows, old and new alike, and the
    ring keeps its old cells until the step has attended (then the layout copies the kept
    rows in)."""

    write: torch.Tensor
    cells: torch.Tensor
    seq: torch.Tensor
    pos: torch.Tensor
    scratch: torch.Tensor
    threads: int
    pointers: tuple[int, int, int, int, int]
    step_rows: tuple[Storage, Storage] | None = None
    split: int = -1

    @classmethod
    def of(
        cls,
        write: torch.Tensor,
        cells: torch.Tensor,
        seq: torch.Tensor,
        pos: torch.Tensor,
        queries_per_kv_head: int,
        threads: int,
        step_rows: tuple[Storage, Storage] | None = None,
        split: int = -1,
    ) -> StepCells:
        write, cells, seq, pos = (t.to(torch.int64).contiguous() for t in (write, cells, seq, pos))
        if write.shape != seq.shape or seq.shape != pos.shape:
            raise ValueError(
                f"write {tuple(write.shape)}, seq {tuple(seq.shape)} and pos "
                f"{tuple(pos.shape)} must have one entry per query row"
            )
        scratch = torch.empty(threads, queries_per_kv_head * cells.shape[1])
        pointers = (
            write.data_ptr(), cells.data_ptr(), seq.data_ptr(), pos.data_ptr(),
            scratch.data_ptr(),
        )  # fmt: skip
        return cls(write, cells, seq, pos, scratch, threads, pointers, step_rows, split)


class LayerAttends:
    """Each layer's `AttendArgs` of a group of layers, kept from step to step, for a caller
    that runs the attention from C (`slotserve.native.BlockKernel.layer_stack`): a step
    sets them all from one call's arguments (`set`), whose storages are then each
    layer's own. ``addresses`` are theirs, by layer."""

    def __init__(self, storages: dict[int, tuple[Storage, Storage]]) -> None:
        self._args = (AttendArgs * len(storages))()
        self._storages = [
            (keys.data_ptr(), values.data_ptr(), _address(key_scales), _address(value_scales))
            for (keys, key_scales), (values, value_scales) in storages.values()
        ]
        self.addresses = {
            layer: ctypes.addressof(args) for layer, args in zip(storages, self._args, strict=True)
        }

    def set(self, step: AttendArgs) -> None:
        """Every layer's arguments: ``step``'s, with the layer's own storages."""
        for i, (keys, values, key_scales, value_scales) in enumerate(self._storages):
            self._args[i] = step
            args = self._args[i]
            args.keys, args.values = keys, values
            args.key_scales, args.value_scales = key_scales, value_scales


@dataclass(frozen=True)
class AttentionCalls:
    """A step's attention for every layer as C calls: ``function`` the address of
    ``update_and_attend`` and ``args[layer]`` the address of that layer's `AttendArgs`,
    set for the step (`LayerAttends`)."""

    function: int
    args: ctypes.Array[ctypes.c_void_p]


class AttentionKernel:
    """``update_and_attend`` of the loaded library, on ``threads`` OpenMP threads."""

    def __init__(self, library: ctypes.CDLL, threads: int) -> None:
        if mismatch := layout_mismatch(library, "attend_args", AttendArgs):
            raise OSError(f"attention kernel ABI differs from its binding: {mismatch}")
        self._function = library.update_and_attend
        self._function.restype, self._function.argtypes = ctypes.c_int, [ctypes.c_void_p]
        self.threads = threads
        # For a caller that runs a step's layers in C (`slotserve.native.BlockKernel.layer_stack`).
        self.address: int = ctypes.cast(self._function, ctypes.c_void_p).value or 0

    def update_and_attend(
        self,
        qkv: torch.Tensor,
        heads: int,
        step: StepCells,
        keys: Storage,
        values: Storage,
        window: int | None,
        sinks: int = 0,
    ) -> torch.Tensor:
        """Store the step's K/V rows at cells ``step.write`` of the ``keys`` and ``values``
        storages, then return the attention of the queries (query ``t`` of sequence
        ``step.seq[t]`` at position ``step.pos[t]``) over the keys at positions
        ``0..pos[t]`` (with a ``window``, the last ``window`` of them and the first
        ``sinks``), which live at ``step.cells[seq[t], p]``: ``[T, heads * dim]`` fp32.
        Each query's scores, softmax and weighted sum run in position order, whatever else
        the step holds: a row's result does not depend on its batch.

        ``qkv[T, (heads + 2·kv_heads)·dim]`` are one fused projection's rows (the query
        heads, then the key heads, then the value heads), read in place."""
        if qkv.dtype != torch.float32 or qkv.stride(1) != 1:
            qkv = qkv.float().contiguous()
        out = torch.empty(step.write.shape[0], heads * keys[0].shape[2])
        args = self.arguments(qkv, heads, step, keys, values, window, sinks, out)
        if self._function(ctypes.byref(args)) != 0:
            raise ValueError(
                f"update_and_attend refused its arguments ({args.n_queries} queries of "
                f"{heads} heads, cells {tuple(step.cells.shape)}, positions "
                f"{step.pos.tolist()}): a query position is past the cells given, or the head "
                "counts do not divide"
            )
        return out

    @staticmethod
    def arguments(
        qkv: torch.Tensor,
        heads: int,
        step: StepCells,
        keys: Storage,
        values: Storage,
        window: int | None,
        sinks: int,
        out: torch.Tensor,
    ) -> AttendArgs:
        """`update_and_attend`'s arguments (``qkv`` fp32 with unit column stride, read in
        place; ``out[T, heads * dim]`` fp32 contiguous, written), for a call now or by
        address from C (`slotserve.native.BlockKernel.layer_stack`)."""
        (data, key_scales), (value_data, value_scales) = keys, values
        n_queries, kv_heads, dim = step.write.shape[0], data.shape[1], data.shape[2]
        start, stride = qkv.data_ptr(), qkv.stride(0)
        q_bytes, kv_bytes = heads * dim * 4, kv_heads * dim * 4
        write, cells, seq, pos, scratch = step.pointers
        (step_k, step_k_scales), (step_v, step_v_scales) = step.step_rows or ((None, None),) * 2
        return AttendArgs(
            start, stride, start + q_bytes, start + q_bytes + kv_bytes, stride, write,
            out.data_ptr(), data.data_ptr(), value_data.data_ptr(), _address(key_scales),
            _address(value_scales), _address(step_k), _address(step_v), _address(step_k_scales),
            _address(step_v_scales), step.split,
            DTYPE_CODES[data.dtype], cells, step.cells.shape[1], seq, pos, n_queries, heads,
            kv_heads, dim, window or 0, sinks, dim**-0.5, scratch, step.threads,
        )  # fmt: skip


def _address(tensor: torch.Tensor | None) -> int | None:
    return tensor.data_ptr() if tensor is not None else None
