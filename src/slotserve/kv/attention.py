"""Attention over gathered K/V for a ragged `StepBatch`, via torch SDPA.

Layouts gather each sequence's keys into ``[B, kv_heads, L, head_dim]`` and call
`attend`; the padding of ragged queries and the masks live here, in one place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slotserve.kv.batch import StepBatch


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    batch: StepBatch,
    window: int | None,
) -> torch.Tensor:
    """Attention of the step's queries ``q[T, heads, head_dim]`` over ``keys/values
    [B, kv_heads, L, head_dim]`` (L = longest sequence after the step).

    Returns ``[T, heads * head_dim]`` on the flattened token axis.
    """
    n_tokens, n_heads, head_dim = q.shape
    key_len = keys.shape[2]
    padded = _pad_queries(q, batch)  # [B, heads, max_len, head_dim]
    mask = batch.mask(window, key_len)
    if mask is not None and batch.size == 1 and window is None and batch.starts[0] == 0:
        out = F.scaled_dot_product_attention(padded, keys, values, is_causal=True, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(padded, keys, values, mask, enable_gqa=True)
    return _unpad(out, batch).reshape(n_tokens, n_heads * head_dim)


def _pad_queries(q: torch.Tensor, batch: StepBatch) -> torch.Tensor:
    if batch.uniform:
        return q.view(batch.size, batch.max_len, *q.shape[1:]).transpose(1, 2)
    seq, within = batch.pad_index()
    padded = q.new_zeros(batch.size, batch.max_len, *q.shape[1:])
    padded[seq, within] = q
    return padded.transpose(1, 2)


def _unpad(out: torch.Tensor, batch: StepBatch) -> torch.Tensor:
    out = out.transpose(1, 2)  # [B, max_len, heads, head_dim]
    if batch.uniform:
        return out.reshape(-1, *out.shape[2:])
    seq, within = batch.pad_index()
    return out[seq, within]
