"""A tied embedding is stored and resident once: the head's weights in ``weights.ptd``, which
the runtime maps and hands to the ``embed`` method (schema 2, `Manifest.tied_embedding`),
instead of a second table for ``embed`` (int8 blocks beside the head's int8 rows, or an
fp32 table mlocked beside the head's packed copy).

The model is a tiny random Llama with a tied embedding large enough (32768 x 256) to
dominate its weights, so a second copy shows in the file and in the resident set.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import slotserve as ss
from slotserve.artifact.bundle import MANIFEST, WEIGHTS, read_bundle
from slotserve.engine.probe import teacher_forced_logits
from slotserve.errors import ArtifactError
from slotserve.kv import KVConfig, KVPool, StepBatch
from slotserve.memory import rss_bytes
from tests.exports import TIED_DIM, TIED_VOCAB, ExportFarm

VOCAB, DIM = TIED_VOCAB, TIED_DIM
MiB = 2**20


@pytest.fixture(scope="module")
def tied(export_farm: ExportFarm) -> ss.Model:
    """The eager model the farm exported as `tied_bundles` (`write_tied_llama`)."""
    model = ss.load(export_farm.source("tied-fp32"))
    assert model.weights is not None and model.weights.tied
    return model


def embedding_bytes(quant: str) -> int:
    return VOCAB * DIM * (4 if quant == "fp32" else 1)


@pytest.mark.parametrize("quant", ["fp32", "8da4w"])
def test_the_manifest_says_where_the_heads_rows_are(
    tied_bundles: dict[str, Path], quant: str
) -> None:
    manifest = read_bundle(tied_bundles[quant]).manifest
    assert manifest.schema == 2 and manifest.readable_by == (2,)
    tied = manifest.tied_embedding
    assert tied is not None
    rows = tied["rows"]
    assert (rows["dtype"], rows["shape"]) == (
        "float32" if quant == "fp32" else "int8",
        [VOCAB, DIM],
    )
    if quant == "fp32":
        assert "scales" not in tied
    else:
        assert (tied["scales"]["dtype"], tied["scales"]["shape"]) == ("float32", [VOCAB])
    embed = next(m for m in manifest.methods if m.name == "embed")
    assert embed.inputs[:2] == (("T",), (VOCAB, DIM))
    assert embed.outputs == (("T", DIM),)


@pytest.mark.parametrize("quant", ["fp32", "8da4w"])
def test_the_weights_file_holds_the_embedding_once(
    tied: ss.Model, tied_bundles: dict[str, Path], quant: str
) -> None:
    stored = (tied_bundles[quant] / WEIGHTS).stat().st_size
    rest = tied.weight_bytes - VOCAB * DIM * 4  # the layers' fp32 bytes
    # One table, plus the layers (fp32, or int4 with their scales), never a second table.
    assert stored < embedding_bytes(quant) + (1.1 if quant == "fp32" else 0.5) * rest + MiB


RSS_PROBE = """
import json, sys
import slotserve as ss
from slotserve.memory import read_process, trim_heap

def serve(path):
    model = ss.load(path)
    config = ss.EngineConfig(max_seqs=1, max_context=64, budget_scope="process")
    with ss.Engine(model, config) as engine:
        engine.submit(list(range(3, 60)), ss.SamplingParams(max_new_tokens=1)).result()
    return model

def mapping(address):
    # The mapping of /proc/self/maps that holds address: its file and the file offset.
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(end, 16) for end in fields[0].split("-"))
            if low <= address < high:
                name = fields[5] if len(fields) > 5 else ""
                return name, int(fields[2], 16) + address - low
    return "", -1

warm = serve(sys.argv[1])  # the runtime, kernels and engine paths, once
trim_heap()
before = read_process().anonymous
model = serve(sys.argv[2])
trim_heap()
growth = read_process().anonymous - before
tables = [mapping(table.data_ptr()) for table in model.halves._tied]
print(json.dumps({"growth": growth, "tables": tables}))
"""

# What a load and a first step add to the process's anonymous memory besides the weights
# file's bytes (the head's packed copy of the table, the layers): the step's activations
# and the runtime's own allocations, 1.2-1.7 MiB measured here. Fixed, not measured by the
# load it bounds, and below the 8 MiB of the smallest second table (8da4w's int8 rows).
SLACK = 5 * MiB


@pytest.mark.parametrize("quant", ["fp32", "8da4w"])
def test_loading_every_method_costs_one_copy_of_the_weights(
    tiny_bundle: Path, tied_bundles: dict[str, Path], quant: str
) -> None:
    """The design's shipping check: cross-method weight sharing reduces resident memory,
    never duplicates it. The table ``embed`` reads is the weights file's own pages, at the
    manifest's offsets (its storage is the file mapping, not a copy), and in a fresh process
    (after a warm-up bundle) loading the bundle and prefilling a prompt grows the anonymous
    memory by at most the weights file (one table: the head's packed copy; and the layers),
    the head's planned logits (32 rows x the vocabulary, fixed by the program) and `SLACK`.
    A second table (a copy of the rows for ``embed``) exceeds it."""
    probe = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(tiny_bundle), str(tied_bundles[quant])],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    measured = json.loads(probe.stdout.strip().splitlines()[-1])
    tied = read_bundle(tied_bundles[quant]).manifest.tied_embedding
    assert tied is not None
    weights = str((tied_bundles[quant] / WEIGHTS).resolve())
    places = [[weights, int(tied[part]["offset"])] for part in ("rows", "scales") if part in tied]
    assert measured["tables"] == places
    stored = (tied_bundles[quant] / WEIGHTS).stat().st_size
    planned = 32 * VOCAB * 4  # the head's logits
    growth = measured["growth"]
    assert growth < stored + planned + SLACK, (growth / MiB, stored / MiB)


def test_the_plan_counts_the_mapped_table_as_weights(tied_bundles: dict[str, Path]) -> None:
    """The mapped table is not resident at load; looking every row up makes it so, beside
    the head's packed copy. The process plan's weights hold it from the start."""
    model = ss.load(tied_bundles["8da4w"], progress=False)
    table = VOCAB * DIM + VOCAB * 4  # int8 rows and their fp32 scales
    assert model.halves.mapped_weight_bytes == table  # type: ignore[attr-defined]
    before = rss_bytes()
    steps = model.halves.max_step_tokens
    assert steps is not None
    for ids in torch.arange(VOCAB).split(steps):
        model.halves.embed(ids)
    assert rss_bytes() - before > 0.75 * table
    assert model.ledger is not None
    (entry,) = [a for a in model.ledger.entries if a.name == "weights"]
    assert entry.how == "measured" and entry.bytes >= table  # the table counted from the load
    with ss.Engine(model, ss.EngineConfig(max_seqs=1, max_context=64, budget_scope="process")) as e:
        assert e.plan.arenas["weights"] == entry.bytes


def logits_of(bundle: Path, model: ss.Model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The bundle's and the eager model's last logits, both with fp32 KV (the program's and
    the eager q/k/v rows differ in last bits, which fp16 storage can round apart)."""
    served = ss.load(bundle)
    config = KVConfig(layout="flat", max_seqs=1, max_context=64, dtype="fp32")
    pool = KVPool(model.info, config)
    pool.reserve(0, 64)
    batch = StepBatch.single(0, len(ids))
    pool.begin_step(batch)
    ours = served.forward(torch.tensor(ids), batch, pool)[0]
    return ours, teacher_forced_logits(model, ids, kv_dtype="fp32")[-1]


def test_an_fp32_tied_bundle_gives_the_eager_logits(
    tied: ss.Model, tied_bundles: dict[str, Path]
) -> None:
    for ids in ([5], [5, 6, 7, 8, 9, 10, 11], list(range(3, 43))):
        ours, expected = logits_of(tied_bundles["fp32"], tied, ids)
        torch.testing.assert_close(ours, expected, rtol=1e-3, atol=1e-3)  # float rounding


def test_an_8da4w_tied_embedding_is_the_heads_int8_rows(
    tied: ss.Model, tied_bundles: dict[str, Path]
) -> None:
    """The embed method reads the head's int8 rows and their scales: each row within half a
    step of per-row symmetric int8 of the eager table, rows near both ends of the table."""
    assert tied.weights is not None and isinstance(tied.weights.embed, torch.Tensor)
    tokens = torch.tensor([5, 6, 200, 12345, VOCAB - 1])
    rows = ss.load(tied_bundles["8da4w"]).halves.embed(tokens)
    table = tied.weights.embed[tokens].float()
    half_step = table.abs().amax(-1, keepdim=True) / 127 / 2
    assert rows.shape == table.shape
    assert bool(((rows - table).abs() <= half_step * 1.001 + 1e-7).all())


def test_a_tied_embedding_outside_the_weights_file_is_refused(
    tied_bundles: dict[str, Path], tmp_path: Path
) -> None:
    bundle = Path(shutil.copytree(tied_bundles["8da4w"], tmp_path / "bundle"))
    fields = json.loads((bundle / MANIFEST).read_text())
    fields["tied_embedding"]["scales"]["offset"] = (bundle / WEIGHTS).stat().st_size - 8
    (bundle / MANIFEST).write_text(json.dumps(fields))
    with pytest.raises(ArtifactError, match="lies outside the file"):
        ss.load(bundle)
    fields["tied_embedding"]["rows"]["shape"] = [VOCAB, DIM + 1]
    (bundle / MANIFEST).write_text(json.dumps(fields))
    with pytest.raises(ArtifactError, match=r"tied_embedding.rows is int8 \[32768, 257\]"):
        ss.load(bundle)
