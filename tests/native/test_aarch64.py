"""The kernels' AArch64 path, cross-built with Debian's gcc-aarch64-linux-gnu and run under
qemu-aarch64 (qemu-user), checked against the host's plain-C build bit for bit.

At each AArch64 level (`build.AARCH64_LEVELS`: plain C, the dot product, i8mm) the C
program ``csrc/tests/check_kernels.c`` runs every product type on rows 1..19 and 1, 2 and
3 threads, and every attention variant, on the cases `kernel_cases` writes from the host's
plain-C libraries: each output must have the reference's bits. The dot-product level runs
on a CPU model without i8mm and on ``max``, the i8mm level on ``max``. Each level uses the
instructions it is for and no fused multiply-add; a NEON path with one lane changed is
caught; and the dot-product path executes at least 4x fewer instructions than plain C per
Q4_K and Q8_0 product at 1 and 8 rows, as QEMU counts them (``count_instructions.c``,
a plugin).

``make test`` installs the tools (``make cross-tools``); where they are missing, every test
here is skipped with the reason.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from slotserve.native import build
from slotserve.native.blocks import BlockKernel
from tests.native.kernel_cases import (
    ATTENTION_VARIANTS,
    KV_DTYPES,
    PRODUCT_KINDS,
    ROWS,
    product_label,
    write_cases,
)

SYSROOT = Path("/usr/aarch64-linux-gnu")  # Debian's libc6-arm64-cross and libgomp1-arm64-cross
TESTS = build.CSRC / "tests"
THREADS = ("1", "2", "3")
# The host's plain-C build: the reference every AArch64 level must equal.
REFERENCE_FLAGS = tuple(f.replace("native", "x86-64") for f in build.FLAGS)
# (level, CPU model): neoverse-n1 has the dot product and no i8mm; cortex-a53 neither.
RUNS = [("plain", "cortex-a53"), ("dotprod", "neoverse-n1"), ("dotprod", "max"), ("i8mm", "max")]
ATTENTION_LABELS = {
    f"attend {dtype} {variant[0]}" for dtype in KV_DTYPES for variant in ATTENTION_VARIANTS
}
PRODUCT_LABELS = {product_label(kind) for kind in PRODUCT_KINDS}
CHECKS = (len(PRODUCT_KINDS) * ROWS + len(ATTENTION_LABELS)) * len(THREADS)


def missing_tools() -> str | None:
    """Why the emulated tests cannot run here, or None."""
    if platform.machine() != "x86_64":
        return "the reference outputs come from the host's x86-64 plain-C build"
    for tool, package in (
        (build.AARCH64_COMPILER, "gcc-aarch64-linux-gnu"),
        ("aarch64-linux-gnu-objdump", "binutils-aarch64-linux-gnu"),
        ("qemu-aarch64", "qemu-user"),
    ):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH (Debian's {package}; `make cross-tools` installs it)"
    for library in ("ld-linux-aarch64.so.1", "libgomp.so.1"):
        if not (SYSROOT / "lib" / library).exists():
            return f"no {SYSROOT / 'lib' / library} (`make cross-tools` installs it)"
    return None


@pytest.fixture(scope="module", autouse=True)
def tools() -> None:
    if reason := missing_tools():
        pytest.skip(f"AArch64 kernel tests: {reason}")


@dataclass(frozen=True)
class Level:
    """One AArch64 level's libraries."""

    blocks: Path
    attention: Path


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("aarch64")


@pytest.fixture(scope="module")
def cases(work: Path) -> Path:
    path = work / "cases.bin"
    blocks = BlockKernel(build.load("blocks", REFERENCE_FLAGS), threads=1)
    write_cases(path, blocks, build.load("attention", REFERENCE_FLAGS))
    return path


@pytest.fixture(scope="module")
def program(work: Path) -> Path:
    """check_kernels for AArch64 (it uses no instruction beyond ARMv8-A)."""
    path = work / "check_kernels"
    subprocess.run(
        [build.AARCH64_COMPILER, "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(path),
         str(TESTS / "check_kernels.c"), "-ldl"],
        check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return path


@pytest.fixture(scope="module")
def levels() -> dict[str, Level]:
    """Every level's libraries, built side by side (cached in the cache directory)."""
    jobs = [(level, name) for level in build.AARCH64_LEVELS for name in ("blocks", "attention")]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        built = list(
            pool.map(lambda job: build.build_for(build.AARCH64_LEVELS[job[0]], job[1]), jobs)
        )
    paths = dict(zip(jobs, built, strict=True))
    return {
        level: Level(paths[level, "blocks"], paths[level, "attention"])
        for level in build.AARCH64_LEVELS
    }


def emulate(
    cpu: str, *command: str | Path, plugin: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``command`` under qemu-aarch64 on CPU model ``cpu`` (OpenMP threads wait passively:
    emulated spinning is slow)."""
    qemu = ["qemu-aarch64", "-cpu", cpu, "-L", str(SYSROOT)]
    if plugin is not None:
        qemu += ["-d", "plugin", "-plugin", str(plugin)]
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
    return subprocess.run(
        [*qemu, *map(str, command)], capture_output=True, text=True, timeout=300, env=env
    )


def failed_labels(output: str) -> dict[str, set[int]]:
    """From check_kernels' FAIL lines: each failing case's label, with the row counts that
    failed (0 for an attention call)."""
    failed: dict[str, set[int]] = {}
    for label, rows in re.findall(r"^FAIL (.+?)(?: rows=(\d+))? threads=\d+:", output, re.M):
        failed.setdefault(label, set()).add(int(rows or 0))
    return failed


@pytest.mark.parametrize(("level", "cpu"), RUNS, ids=[f"{lv}-{cpu}" for lv, cpu in RUNS])
def test_every_level_is_the_plain_c_path_bit_for_bit(
    levels: dict[str, Level], program: Path, cases: Path, level: str, cpu: str
) -> None:
    built = levels[level]
    result = emulate(cpu, program, built.blocks, built.attention, cases, *THREADS)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert f"{CHECKS} passed, 0 failed" in result.stdout


def disassembly(library: Path) -> str:
    return subprocess.run(
        ["aarch64-linux-gnu-objdump", "-d", str(library)],
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip


def test_each_level_uses_its_instructions_and_no_fused_multiply_add(
    levels: dict[str, Level],
) -> None:
    """plain: neither SDOT nor SMMLA; dotprod: SDOT, no SMMLA; i8mm: SMMLA. No level fuses
    a multiply and an add in floating point (the plain C's steps are unfused)."""
    mnemonics = {}
    for level, built in levels.items():
        code = disassembly(built.blocks) + disassembly(built.attention)
        found = set(re.findall(r"\t(sdot|smmla|fmla|fmls|fmadd|fmsub|fnmadd|fnmsub)\s", code))
        mnemonics[level] = found
    assert mnemonics == {"plain": set(), "dotprod": {"sdot"}, "i8mm": {"sdot", "smmla"}}


# (level, library, file, text, its change): each file is compiled into that library only
MUTANTS = {
    # word 7's activations from lane 2 of their register instead of lane 3
    "sdot lane": (
        "dotprod", "blocks", "quants_neon.h",
        "second = vdotq_laneq_s32(second, u[7], high, 3)",
        "second = vdotq_laneq_s32(second, u[7], high, 2)",
    ),
    # the zip of a quad's rows 2 and 3 for SMMLA takes their two words in swapped order
    "smmla lane": (
        "i8mm", "blocks", "quants_neon.h",
        "pair[k][1] = vreinterpretq_s8_s32(vzip2q_s32(first, second))",
        "pair[k][1] = vreinterpretq_s8_s32(vzip2q_s32(second, first))",
    ),
    # the softmax sum adds lane 1 of four exponentials twice, lane 2 never
    "softmax lane": (
        "dotprod", "attention", "attention_neon.h",
        "total += vgetq_lane_f32(e, 2);",
        "total += vgetq_lane_f32(e, 1);",
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def mutants(work: Path, levels: dict[str, Level]) -> dict[str, Level]:
    """Each mutant's level: the library its file is compiled into built from a copy of csrc
    with its change (in the test's temporary directory), side by side, beside the level's
    other library unchanged. The libraries are cached as the levels' are (`build.build_for`:
    the file name carries a digest of the changed sources), so a mutant is compiled again
    only when the sources it was made from change."""

    def mutate(name: str) -> Level:
        level, library, file, text, change = MUTANTS[name]
        csrc = work / f"mutant-{name.replace(' ', '-')}"
        shutil.copytree(build.CSRC, csrc, ignore=shutil.ignore_patterns("tests"))
        source = (csrc / file).read_text()
        assert source.count(text) == 1, (name, text)
        (csrc / file).write_text(source.replace(text, change))
        built = build.build_for(build.AARCH64_LEVELS[level], library, csrc=csrc)
        return replace(levels[level], **{library: built})

    with ThreadPoolExecutor(max_workers=len(MUTANTS)) as pool:
        return dict(zip(MUTANTS, pool.map(mutate, MUTANTS), strict=True))


def test_a_changed_lane_of_the_neon_path_is_caught(
    mutants: dict[str, Level], program: Path, cases: Path
) -> None:
    """Each mutant fails exactly where its change reaches: the SDOT lane every product that
    takes 32 activations a dot (all but Q6_K), at every row count; the SMMLA zip every type
    from 2 rows on (1 row keeps to SDOT); the softmax lane every attention call and no
    product."""
    dot32 = {product_label(kind) for kind in PRODUCT_KINDS if kind != "Q6_K"}
    expected = {
        "sdot lane": {label: set(range(1, ROWS + 1)) for label in dot32},
        "smmla lane": {label: set(range(2, ROWS + 1)) for label in PRODUCT_LABELS},
        "softmax lane": {label: {0} for label in ATTENTION_LABELS},
    }
    for name, built in mutants.items():
        result = emulate("max", program, built.blocks, built.attention, cases, "1")
        assert result.returncode == 1, (name, result.stdout[-2000:], result.stderr[-2000:])
        assert failed_labels(result.stdout) == expected[name], name


@pytest.fixture(scope="module")
def counter(work: Path) -> Path:
    """The instruction-counting plugin, built for the host."""
    plugin = work / "count_instructions.so"
    subprocess.run(
        [build.compiler(), "-O2", "-shared", "-fPIC", "-o", str(plugin),
         str(TESTS / "count_instructions.c")],
        check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return plugin


def instructions_per_product(
    counter: Path, program: Path, built: Level, cases: Path, kind: str, rows: int
) -> int:
    """The guest instructions one product executes: a run of 3 products less a run of 1,
    halved (the program's start, the case file's reading and the exit cancel out)."""
    counts = []
    for repeats in ("1", "3"):
        result = emulate(
            "max", program, "--repeat", repeats, built.blocks, cases, product_label(kind),
            str(rows), plugin=counter,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        counts.append(int(re.findall(r"instructions: (\d+)", result.stderr)[-1]))
    return (counts[1] - counts[0]) // 2


def test_the_dot_product_path_takes_4x_fewer_instructions_than_plain_c(
    levels: dict[str, Level], program: Path, cases: Path, counter: Path
) -> None:
    """Instructions executed per product under emulation (QEMU's count, through the
    plugin), a proxy for speed until ARM hardware is at hand: a [45 x 512] Q4_K and Q8_0
    product at 1 and 8 rows, on one thread. SMMLA serves pairs of rows: at 8 rows it must
    take fewer than SDOT alone."""
    report = []
    for kind in ("Q4_K", "Q8_0"):
        for rows in (1, 8):
            counts = {
                level: instructions_per_product(counter, program, levels[level], cases, kind, rows)
                for level in build.AARCH64_LEVELS
            }
            report.append((kind, rows, counts))
            print(f"{kind} x {rows} rows: instructions per product {counts}")
    for kind, rows, counts in report:
        assert counts["plain"] >= 4 * counts["dotprod"], (kind, rows, counts)
        if rows > 1:
            assert counts["i8mm"] < counts["dotprod"], (kind, rows, counts)
