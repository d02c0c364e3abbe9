"""The prefix store in /metrics (every refusal and skip reason, the bytes, files and index
time) and the serve flags that turn it on (``--prefix-store DIR``, ``--prefix-store-bytes``):
a store without the prefix cache is refused with the lever to pull."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

import slotserve as ss
from slotserve.cli import build_parser
from slotserve.cli.flags import with_prefix_store
from slotserve.prefix import REFUSAL_REASONS, SKIP_REASONS
from slotserve.prefix.store import SUFFIX
from slotserve.server.ops.metrics import PrometheusMetrics

CELL = {"kv_layout": "cell", "block_size": 8, "max_seqs": 2, "max_context": 128}


def test_metrics_count_every_reason_and_the_bytes(tiny: ss.Model, tmp_path: Path) -> None:
    config = ss.EngineConfig(
        **CELL, prefix_cache_bytes="1MiB", prefix_store=tmp_path, prefix_store_min_tokens=1
    )
    with ss.Engine(tiny, config) as engine:  # a turn kept for the next: written
        params = ss.SamplingParams(max_new_tokens=2)
        engine.submit(list(range(3, 40)), params, publish_completion=True).result()
        text = PrometheusMetrics(engine.stats).exposition().decode()
    assert "slotserve_prefix_store_bytes_written_total" in text
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    path.write_bytes(path.read_bytes()[:-10])  # truncated: refused at the next start
    with ss.Engine(tiny, config) as engine:
        text = PrometheusMetrics(engine.stats).exposition().decode()
    for reason in REFUSAL_REASONS:
        count = 1.0 if reason == "checksum" else 0.0
        assert f'slotserve_prefix_store_refused_total{{reason="{reason}"}} {count}' in text
    for reason in SKIP_REASONS:
        assert f'slotserve_prefix_store_writes_skipped_total{{reason="{reason}"}}' in text
    for gauge in ("bytes", "budget_bytes", "files", "queued", "index_seconds"):
        assert f"slotserve_prefix_store_{gauge} " in text
    assert "slotserve_prefix_store_files 0.0" in text


def test_the_serve_flags_turn_the_store_on_only_with_the_cache(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["serve", "--prefix-store", str(tmp_path), "--prefix-store-bytes", "2GiB"]
    )
    assert args.prefix_store == str(tmp_path) and args.prefix_store_bytes == 2 << 30
    cached = ss.EngineConfig(**CELL, prefix_cache_bytes="1MiB")
    config = with_prefix_store(cached, args)
    assert config.prefix_store == str(tmp_path) and config.prefix_store_budget == 2 << 30
    with pytest.raises(ValueError, match="pass --prefix-cache BYTES"):
        with_prefix_store(dataclasses.replace(cached, prefix_cache_bytes=0), args)
    assert with_prefix_store(cached, argparse.Namespace(prefix_store=None)) is cached
