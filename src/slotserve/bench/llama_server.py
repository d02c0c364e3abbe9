"""llama.cpp's own server as the side-by-side peer of ``slotserve bench servers``.

`build_llama_server` compiles ``llama-server`` and ``llama-bench`` from the llama.cpp sources
vendored in the ``llama-cpp-python`` sdist (the package registry is the only network these
machines reach), for this CPU's instruction sets (`cpu_cmake_flags`, never AMX), statically
linked, and caches the binaries under the user cache dir. ``make bench-deps`` runs it
(``python -m slotserve.bench.llama_server``); it took 5 min 18 s on 2 cores (Intel Xeon).
With ``llama-quantize`` it also makes the bench's Q4_K_M SmolLM2 (`make_q4_k_m`), and with
llama.cpp's own converter (``convert_hf_to_gguf.py``, from the same sdist) the GGUF of
all-MiniLM-L6-v2 that ``slotserve bench models`` embeds with (`make_minilm_gguf`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from rich.console import Console

from slotserve.paths import cache_dir

# Pinned, so that a figure measured against llama-server names the llama.cpp it ran.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BINARIES = ("llama-server", "llama-bench", "llama-quantize")  # the last makes bench files
# Where a user's own llama-server can be named instead of building one.
ENV_BINARY = "SLOTSERVE_LLAMA_SERVER"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",  # the instruction sets are named one by one: `cpu_cmake_flags`
    "-DBUILD_SHARED_LIBS=OFF",  # standalone binaries that survive the build tree
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # would download the web UI
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)


# /proc/cpuinfo flag -> ggml's cmake option. AMX is left out on purpose: on the Xeon VMs
# these benchmarks run on, a native build's AMX matmul segfaults at the first decode
# (`ggml_backend_amx_mul_mat`), so llama.cpp runs its AVX-512 VNNI kernels there.
CPU_OPTIONS = {
    "sse4_2": "GGML_SSE42",
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "avx_vnni": "GGML_AVX_VNNI",
    "bmi2": "GGML_BMI2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}


def cpu_cmake_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """ggml's instruction-set options, on for each flag this CPU reports (AMX never)."""
    flags: set[str] = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    return [
        f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in CPU_OPTIONS.items()
    ]


def binary_dir() -> Path:
    """Where `build_llama_server` puts the binaries (per llama-cpp-python version)."""
    return cache_dir() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}" / "bin"


def find_llama_server() -> Path | None:
    """``$SLOTSERVE_LLAMA_SERVER``, else the cached build, else ``llama-server`` on PATH."""
    named = os.environ.get(ENV_BINARY)
    if named:
        path = Path(named)
        if not path.is_file():
            raise ValueError(f"{ENV_BINARY}={named} is not a file; unset it or name llama-server")
        return path
    cached = binary_dir() / "llama-server"
    if cached.is_file():
        return cached
    found = shutil.which("llama-server")
    return Path(found) if found else None


def build_llama_server(jobs: int | None = None, console: Console | None = None) -> Path:
    """Download the sdist, build the binaries, cache them; returns llama-server's path.
    A build already cached is returned as it is."""
    console = console or Console(stderr=True)
    target = binary_dir()
    if all((target / name).is_file() for name in BINARIES):
        console.print(f"llama-server is already built: {target / 'llama-server'}")
        return target / "llama-server"
    jobs = jobs or os.cpu_count() or 2
    with tempfile.TemporaryDirectory(prefix="slotserve-llama-") as tmp:
        work = Path(tmp)
        source = llama_cpp_sources(work, console)
        build = work / "build"
        with console.status("configuring llama.cpp (cmake)"):
            _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS, *cpu_cmake_flags()])
        with console.status(
            f"compiling {', '.join(BINARIES)} ({jobs} jobs, about 6 min on 2 cores)"
        ):
            _run(["cmake", "--build", str(build), "--target", *BINARIES, "-j", str(jobs)])
        target.mkdir(parents=True, exist_ok=True)
        for name in BINARIES:  # beside, then renamed: a running llama-server keeps its file
            partial = target / f".{name}.{os.getpid()}"
            shutil.copy2(build / "bin" / name, partial)
            partial.replace(target / name)
    console.print(f"built {', '.join(BINARIES)} into {target}")
    return target / "llama-server"


def llama_cpp_sources(work: Path, console: Console, parts: tuple[str, ...] = ()) -> Path:
    """Download the pinned llama-cpp-python sdist into ``work`` and unpack its vendored
    llama.cpp (only the paths under it that start with one of ``parts``, when given);
    returns the llama.cpp directory."""
    package = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
    with console.status(f"downloading the {package} sdist"):
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        _run([*pip, "--no-binary", ":all:", package, "-d", str(work)])
    (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(sdist) as archive:
        members = None
        if parts:
            members = [
                member
                for member in archive.getmembers()
                if "/vendor/llama.cpp/" in member.name
                and member.name.split("/vendor/llama.cpp/", 1)[1].startswith(parts)
            ]
        archive.extractall(work, members=members, filter="data")
    (source,) = work.glob("llama_cpp_python-*/vendor/llama.cpp")
    return source


def _run(command: list[str]) -> None:
    """Run a build step; on failure, raise with the step's own output."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command[:3])}… failed (exit {done.returncode}):\n{done.stdout[-4000:]}"
            f"\n{done.stderr[-4000:]}"
        )


# The bench's K-quant file: the bundled SmolLM2 requantised by llama.cpp to Q4_K_M, the
# mix most downloaded GGUFs use (tests/artifact/test_gguf_parity.py reads it too).
SMOLLM2_Q4_K_M = "SmolLM2-135M-Instruct.Q4_K_M.gguf"


def smollm2_q4_k_m_path() -> Path:
    return cache_dir() / "models" / SMOLLM2_Q4_K_M


def make_q4_k_m(console: Console | None = None) -> Path:
    """``llama-quantize --allow-requantize`` of the bundled model to Q4_K_M, once."""
    from slotserve.artifact import bundled_gguf_path

    return _requantised(bundled_gguf_path(), smollm2_q4_k_m_path(), "Q4_K_M", console)


def make_f32_gguf(source: Path, console: Console | None = None) -> Path:
    """``source`` (a GGUF file) with every tensor dequantised to F32 by ``llama-quantize``,
    once, in the cache: llama-server's file for a model slotserve holds in fp32 weights
    (``--weights fp32``), the same values (a block's dequantisation is exact in f32)."""
    target = cache_dir() / "models" / f"{source.stem}.F32.gguf"
    return _requantised(source, target, "F32", console)


def _requantised(source: Path, target: Path, kind: str, console: Console | None) -> Path:
    """``target``, made from ``source`` by ``llama-quantize --allow-requantize`` to
    ``kind`` unless it exists (written aside, then moved in place)."""
    console = console or Console(stderr=True)
    if target.is_file():
        console.print(f"{target.name} is already made: {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    quantize = binary_dir() / "llama-quantize"
    with console.status(f"requantising {source.name} to {kind} (llama-quantize)"):
        _run([str(quantize), "--allow-requantize", str(source), str(partial), kind])
    partial.replace(target)
    console.print(f"made {target}")
    return target


# all-MiniLM-L6-v2 converted by llama.cpp's converter, in fp32 (as sentence-transformers
# and slotserve's encoder hold it): llama-server's ``--embeddings`` peer of ``bench models``.
MINILM_GGUF = "all-MiniLM-L6-v2.f32.gguf"
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def minilm_gguf_path() -> Path:
    return cache_dir() / "models" / MINILM_GGUF


def make_minilm_gguf(console: Console | None = None) -> Path:
    """``convert_hf_to_gguf.py --outtype f32`` of the installed all-MiniLM-L6-v2 directory,
    once, with the converter and the ``gguf`` package of the pinned llama.cpp (not the
    installed ``gguf``, which may be another version). Raises `RuntimeError` with the
    converter's output when it fails."""
    from slotserve.artifact.minilm import minilm_dir

    console = console or Console(stderr=True)
    target = minilm_gguf_path()
    if target.is_file():
        console.print(f"the MiniLM GGUF is already made: {target}")
        return target
    directory = minilm_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    with tempfile.TemporaryDirectory(prefix="slotserve-convert-") as tmp:
        source = llama_cpp_sources(Path(tmp), console, CONVERTER_PARTS)
        command = [sys.executable, str(source / "convert_hf_to_gguf.py"), str(directory)]
        command += ["--outtype", "f32", "--outfile", str(partial)]
        env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
        with console.status("converting all-MiniLM-L6-v2 to GGUF (convert_hf_to_gguf.py)"):
            done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise RuntimeError(
                f"convert_hf_to_gguf.py failed (exit {done.returncode}): {done.stderr[-2000:]}"
            )
    partial.replace(target)
    console.print(f"made {target}")
    return target


if __name__ == "__main__":
    build_llama_server()
    make_q4_k_m()
    make_minilm_gguf()
