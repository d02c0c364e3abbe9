"""A KV pool is planned whole but resident only where sessions wrote (issue 27): storage
lives in anonymous mappings (`zeros_on_write`), whose pages the kernel backs only once
written, and `resident_bytes` counts those pages (a read maps the shared zero page, which
is not the process's)."""

from __future__ import annotations

import mmap

import torch

from slotserve.kv.storage import MAPPED_FROM_BYTES, KVStorage, resident_bytes, zeros_on_write

PAGE = mmap.PAGESIZE


def test_a_zeros_on_write_tensor_is_zero_and_held_only_where_written() -> None:
    tensor = zeros_on_write(256, PAGE // 2, dtype=torch.float16)  # a row a page
    assert tensor.shape == (256, PAGE // 2) and tensor.dtype == torch.float16
    assert resident_bytes(tensor) == 0
    assert not tensor[100:].any()  # reads give zeros and are not counted
    assert resident_bytes(tensor) == 0
    tensor[10:20] = 1.5
    assert resident_bytes(tensor) == 10 * PAGE
    assert tensor[10:20].eq(1.5).all() and not tensor[:10].any() and not tensor[20:].any()


def test_a_view_keeps_its_mapping_alive() -> None:
    rows = zeros_on_write(64, PAGE, dtype=torch.uint8).narrow(0, 8, 4)
    rows.fill_(7)  # the base tensor is gone: its mapping lives as long as the view
    assert rows.sum().item() == 7 * 4 * PAGE


def test_small_storage_is_torchs_own_and_counted_whole() -> None:
    small = zeros_on_write(4, 4)
    assert small.nbytes < MAPPED_FROM_BYTES and resident_bytes(small) == small.nbytes


def test_kv_storage_reports_the_cells_written() -> None:
    heads, dim = 2, 64  # a cell is 512 bytes in fp32: eight a page
    storage = KVStorage(4096, heads, dim, torch.float32)
    assert storage.nbytes == 4096 * heads * dim * 4 and storage.resident_bytes == 0
    storage.write(torch.arange(64, 80), torch.ones(16, heads, dim))  # two pages
    assert storage.resident_bytes == 2 * PAGE
    assert storage.gather(torch.tensor([63, 64, 79, 80])).sum().item() == 2 * heads * dim
    quantised = KVStorage(4096, heads, dim, torch.int8)
    quantised.write(torch.arange(16), torch.ones(16, heads, dim))
    assert 0 < quantised.resident_bytes < quantised.nbytes
