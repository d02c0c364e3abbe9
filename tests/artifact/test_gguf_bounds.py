"""A crafted GGUF cannot make the reader allocate without bound (issue 30, defect 5).

Each count or length field the file declares is set to 2**32, 2**40 and 2**61 in a tiny
model, and the loader must refuse it with an `ArtifactError` naming the field, the declared
value and the bytes left, quickly and in little memory. The loads run in one child process
whose address space may grow by at most `HEADROOM` past what its imports mapped (a runaway
allocation there is a MemoryError, not a machine out of memory), and each load's Python
allocations are traced (`tracemalloc`: numpy's included) against `PEAK_LIMIT`.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from slotserve.testing import write_tiny_gguf
from tests.artifact.gguf_bytes import (
    FIRST_KEY,
    HEADER_KV_COUNT,
    HEADER_TENSOR_COUNT,
    array_count_at,
    array_element_at,
    put_u64,
    tensor_dims_at,
    tensor_offset_at,
    value_at,
)

INSPECT_ADDRESS_SPACE = 4 << 30
HEADROOM = 1 << 30  # address space the child may add after its imports
PEAK_LIMIT = 32 << 20  # traced allocations of one refused load (the file is ~200 kB)
SECONDS_LIMIT = 20.0  # one refused load, on a loaded 2-core machine (it takes milliseconds)
DECLARED = (1 << 32, 1 << 40, 1 << 61)
TENSOR = "blk.0.attn_q.weight"

# field -> (where its count lies in the file, the ArtifactError's field)
Locate = Callable[[bytes], int]
FIELDS: dict[str, tuple[Locate, str]] = {
    "token_type count": (
        lambda d: array_count_at(d, "tokenizer.ggml.token_type"),
        "tokenizer.ggml.token_type",
    ),
    "tokens count": (lambda d: array_count_at(d, "tokenizer.ggml.tokens"), "tokenizer.ggml.tokens"),
    "token length": (
        lambda d: array_element_at(d, "tokenizer.ggml.tokens", 5),
        "tokenizer.ggml.tokens[5]",
    ),
    "chat template length": (
        lambda d: value_at(d, "tokenizer.chat_template"),
        "tokenizer.chat_template",
    ),
    "key length": (lambda d: FIRST_KEY, "key 0 of 17"),
    "n_kv": (lambda d: HEADER_KV_COUNT, "kv_count"),
    "n_tensors": (lambda d: HEADER_TENSOR_COUNT, "tensor_count"),
    "tensor dimension": (lambda d: tensor_dims_at(d, TENSOR) + 8, TENSOR),
    "tensor offset": (lambda d: tensor_offset_at(d, TENSOR), TENSOR),
}
CASES = [(field, value) for field in FIELDS for value in DECLARED]

_WORKER = """
import json, resource, sys, time, tracemalloc
from pathlib import Path
from slotserve.artifact import load_gguf
from slotserve.errors import ArtifactError

with open("/proc/self/status") as status:
    vm = next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[2]), resource.RLIM_INFINITY))
for path in json.loads(sys.argv[1]):
    tracemalloc.start()
    start = time.perf_counter()
    try:
        load_gguf(Path(path), use_cache=False, progress=False)
        result = {"error": None}
    except ArtifactError as exc:
        result = {"error": "ArtifactError", "field": exc.field, "message": str(exc)}
    except BaseException as exc:  # MemoryError, or any untyped error
        result = {"error": type(exc).__name__, "message": str(exc)[:500]}
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    seconds = time.perf_counter() - start
    print(json.dumps({"path": path, "seconds": seconds, "peak": peak, **result}), flush=True)
"""


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (INSPECT_ADDRESS_SPACE, resource.RLIM_INFINITY))


def _case_file(directory: Path, field: str, value: int) -> Path:
    path = write_tiny_gguf(directory / f"{field.replace(' ', '_')}_{value}.gguf", "llama", "Q8_0")
    locate, _ = FIELDS[field]
    return put_u64(path, locate(path.read_bytes()), value)


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every case's outcome in the bounded child, by file path."""
    directory = tmp_path_factory.mktemp("hostile")
    paths = [str(_case_file(directory, field, value)) for field, value in CASES]
    done = subprocess.run(
        [sys.executable, "-c", _WORKER, json.dumps(paths), str(HEADROOM)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(paths), (done.returncode, done.stderr[-2000:])
    return {result["path"]: result for result in results}


@pytest.mark.parametrize(("field", "value"), CASES, ids=[f"{f}={v}" for f, v in CASES])
def test_a_declared_size_beyond_the_file_is_refused_in_bounded_memory(
    refusals: dict[str, dict[str, Any]], field: str, value: int
) -> None:
    path = next(p for p in refusals if Path(p).name == f"{field.replace(' ', '_')}_{value}.gguf")
    result = refusals[path]
    assert result["error"] == "ArtifactError", result
    assert result["field"] == FIELDS[field][1]
    assert str(value) in result["message"] and "bytes are left" in result["message"]
    assert path in result["message"]
    assert result["peak"] < PEAK_LIMIT, result
    assert result["seconds"] < SECONDS_LIMIT, result


def test_a_string_array_declared_longer_than_its_strings_is_refused(tmp_path: Path) -> None:
    """A tokens count within the file's bytes (each element at least its 8-byte length)
    but past its strings: the read stops at the first length that overruns the file."""
    from slotserve.artifact import load_gguf
    from slotserve.errors import ArtifactError

    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", "Q8_0")
    data = path.read_bytes()
    put_u64(path, array_count_at(data, "tokenizer.ggml.tokens"), len(data) // 8 - 100)
    with pytest.raises(ArtifactError, match="bytes are left") as err:
        load_gguf(path, use_cache=False, progress=False)
    assert err.value.field is not None


@pytest.mark.parametrize("field", ["token_type count", "token length"])
def test_inspect_reports_a_hostile_file_in_one_line(tmp_path: Path, field: str) -> None:
    """The command exits 2 with one error line naming the file and the field, no traceback (it
    runs with at most `INSPECT_ADDRESS_SPACE`: a good tiny file maps about 0.6 GiB)."""
    path = _case_file(tmp_path, field, 1 << 61)
    done = subprocess.run(
        [sys.executable, "-m", "slotserve.cli", "inspect", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        preexec_fn=_limit_address_space,
    )
    assert done.returncode == 2, done.stderr
    # Only the error's line: the log lines before it (a kernel build) are not the error's.
    lines = done.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("slotserve: error: ")]
    assert errors == lines[-1:] and "Traceback" not in done.stderr, done.stderr
    assert FIELDS[field][1] in errors[0] and str(1 << 61) in errors[0] and str(path) in errors[0]
    assert done.stdout == ""
