"""Attention over gathered K/V for a ragged `StepBatch`, via torch SDPA.

Layouts gather each sequence's visible keys into ``[B, kv_heads, L, head_dim]`` with their
positions and call `attend`; the padding of ragged queries and the masks live here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slotserve.kv.batch import StepBatch


def visibility_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    k_valid: torch.Tensor,
    window: int | None,
    sinks: int = 0,
) -> torch.Tensor:
    """``[B, 1, Q, L]`` True where query ``q_pos[b, i]`` may attend key ``k_pos[b, j]``:
    the key is valid, not in the future, and inside the window (or one of the sinks)."""
    q = q_pos.unsqueeze(-1)  # [B, Q, 1]
    k = k_pos.unsqueeze(1)  # [B, 1, L]
    allowed = k_valid.unsqueeze(1) & (k <= q)
    if window is not None:
        allowed &= (q - k < window) | (k < sinks)
    return allowed.unsqueeze(1)


def prefix_mask(batch: StepBatch, key_len: int, window: int | None) -> torch.Tensor | None:
    """Mask for keys at positions ``0..key_len-1`` of every sequence (flat and cell
    layouts); ``None`` when plain attention over all keys is already exact."""
    ends = batch.ends
    window_covers_all = window is None or window >= key_len
    if batch.max_len == 1 and window_covers_all and all(e == key_len for e in ends):
        return None
    k_pos = torch.arange(key_len).expand(batch.size, key_len)
    k_valid = k_pos < torch.tensor(ends).view(-1, 1)
    return visibility_mask(batch.query_positions(), k_pos, k_valid, window)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    batch: StepBatch,
    mask: torch.Tensor | None,
    causal_from_zero: bool = False,
) -> torch.Tensor:
    """Attention of the step's queries ``q[T, heads, head_dim]`` over ``keys/values
    [B, kv_heads, L, head_dim]``; returns ``[T, heads * head_dim]``.

    ``causal_from_zero`` (one sequence whose queries are exactly keys 0..L-1, no window)
    lets SDPA use its causal kernel instead of a materialised mask.
    """
    n_tokens, n_heads, head_dim = q.shape
    padded = pad_rows(q, batch).transpose(1, 2)  # [B, heads, max_len, head_dim]
    if causal_from_zero:
        out = F.scaled_dot_product_attention(padded, keys, values, is_causal=True, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(padded, keys, values, mask, enable_gqa=True)
    return unpad_rows(out.transpose(1, 2), batch).reshape(n_tokens, n_heads * head_dim)


def pad_rows(x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
    """``[T, ...]`` on the flattened token axis → ``[B, max_len, ...]`` (zero padding)."""
    if batch.uniform:
        return x.view(batch.size, batch.max_len, *x.shape[1:])
    seq, within = batch.pad_index()
    padded = x.new_zeros(batch.size, batch.max_len, *x.shape[1:])
    padded[seq, within] = x
    return padded


def unpad_rows(x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
    """Inverse of `pad_rows`."""
    if batch.uniform:
        return x.reshape(-1, *x.shape[2:])
    seq, within = batch.pad_index()
    return x[seq, within]
