"""llama.cpp's own server tests (``tools/server/tests`` in the ``llama-cpp-python`` sdist), run
unchanged against slotserve and against ``llama-server``, both on the bundled SmolLM2 GGUF.

The suite starts its server as ``$LLAMA_SERVER_BIN_PATH ARGS…`` (its ``utils.ServerProcess``)
with llama-server's flags. This module is that executable for both sides
(``as-llama-server BACKEND ARGS…``):

- ``llama-server``: the built binary (``make bench-deps``), its hub model flags replaced by
  ``--model`` and the bundled GGUF;
- ``slotserve``: ``slotserve serve`` with the flags translated
  (`llamacpp_stand_in.translate`), behind a thin proxy on the suite's port that only sets
  each request's ``model`` field to the served name (llama-server answers any name;
  slotserve answers 404 for a name it does not serve).

Only the suite's ``tinyllama2`` preset (``ggml-org/test-model-stories260K``) maps to the
bundled model; any other hub model, and a flag with no slotserve counterpart that would
change what a test sees, is refused at start (the test errors with the reason in its output).
Nothing is downloaded from a model hub: the suite's session fixture that fetches every preset
(``ServerPreset.load_all``) is switched off by `llamacpp_suite_plugin`, which also stands in
for the ``wget`` module the suite imports and never calls here.

Run it (the suite is unpacked once into the cache dir, from the sdist ``pip download`` gets)::

    python -m slotserve.bench.llamacpp_suite --backend both --out /tmp/llamacpp-suite

It writes ``BACKEND.xml`` (JUnit) per side and ``summary.md``: each test's outcome on each
side, llama-server's passes, and how many of them slotserve passes. ``--suite DIR`` names an
unpacked ``vendor/llama.cpp`` instead; arguments after ``--`` go to pytest (``-k``, more
files).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from slotserve.bench.llama_server import LLAMA_CPP_PYTHON_VERSION
from slotserve.bench.llamacpp_stand_in import serve_llama_server, serve_slotserve
from slotserve.bench.processes import free_port
from slotserve.paths import cache_dir

BACKENDS = ("llama-server", "slotserve")
SOURCE = Path(__file__).resolve().parents[2]  # the folder slotserve is imported from
# The suite's tests of the features compared, each with every parametrisation: stream
# chunk shapes, grammars and JSON schemas, tool calls (plain and streamed), past reasoning
# in the template, and the Anthropic and Responses streams (the suite has no test of a tool
# call cut by max_tokens, nor of typical_p, DRY, XTC, min_tokens, top_n_sigma or mirostat). Each
# test starts its own server; `--all-files` runs the whole of `FILES` instead.
SELECTED = (
    "unit/test_chat_completion.py::test_chat_completion_stream",
    "unit/test_chat_completion.py::test_chat_completion_with_openai_library",
    "unit/test_chat_completion.py::test_completion_with_response_format",
    "unit/test_chat_completion.py::test_completion_with_json_schema",
    "unit/test_chat_completion.py::test_completion_with_grammar",
    "unit/test_chat_completion.py::test_completion_with_invalid_grammar",
    "unit/test_chat_completion.py::test_chat_completion_with_timings_per_token",
    "unit/test_chat_completion.py::test_logprobs",
    "unit/test_chat_completion.py::test_logprobs_stream",
    "unit/test_tool_call.py::test_completion_without_tool_call_fast",
    "unit/test_compat_anthropic.py::test_anthropic_messages_streaming",
    "unit/test_compat_anthropic.py::test_anthropic_tool_use_basic",
    "unit/test_compat_anthropic.py::test_anthropic_tool_result",
    "unit/test_compat_anthropic.py::test_anthropic_tool_streaming",
    "unit/test_compat_anthropic.py::test_anthropic_streaming_content_block_indices",
    "unit/test_compat_anthropic.py::test_anthropic_thinking_history_in_count_tokens",
    "unit/test_compat_anthropic.py::test_anthropic_thinking_history_in_template",
    "unit/test_compat_oai_responses.py::test_responses_stream_with_openai_library",
)
FILES = (
    "unit/test_chat_completion.py",
    "unit/test_tool_call.py",
    "unit/test_template.py",
    "unit/test_compat_anthropic.py",
    "unit/test_compat_oai_responses.py",
)
# Tests of a model other than the bundled one's stand-in (a vision model).
DESELECTED = ("unit/test_compat_anthropic.py::test_anthropic_vision_base64_with_multimodal_model",)
SUITE_PARTS = ("tools/server/tests/", "models/templates/")


def suite_dir() -> Path:
    """The unpacked ``vendor/llama.cpp`` (its server tests and chat templates), once."""
    from rich.console import Console

    from slotserve.bench.llama_server import llama_cpp_sources

    target = cache_dir() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}" / "suite"
    if (target / "tools" / "server" / "tests" / "utils.py").is_file():
        return target
    with tempfile.TemporaryDirectory(prefix="slotserve-suite-") as tmp:
        source = llama_cpp_sources(Path(tmp), Console(stderr=True), SUITE_PARTS)
        partial = target.with_name(f".suite.{os.getpid()}")
        shutil.copytree(source, partial)
        partial.replace(target)
    return target


def wrapper_script(folder: Path, backend: str) -> Path:
    """An executable that runs ``as-llama-server BACKEND`` in this interpreter."""
    script = folder / f"llama-server-as-{backend}"
    source = str(SOURCE)
    script.write_text(
        "#!/bin/sh\n"
        f'PYTHONPATH="{source}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" '
        f'-m slotserve.bench.llamacpp_suite as-llama-server {backend} "$@"\n'
    )
    script.chmod(0o755)
    return script


def run_suite(
    backend: str, llama_cpp: Path, out: Path, tests: tuple[str, ...], extra: list[str]
) -> Path:
    """Run the selected tests with ``backend`` as the suite's server; returns the JUnit file."""
    folder = llama_cpp / "tools" / "server" / "tests"
    junit = out / f"{backend}.xml"
    source = str(SOURCE)
    env = {
        **os.environ,
        "LLAMA_SERVER_BIN_PATH": str(wrapper_script(out, backend)),
        "PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")])),
    }
    env.pop("DEBUG", None)
    command = [sys.executable, "-m", "pytest", *tests, "-m", "not slow", "-v"]
    command += ["-p", "slotserve.bench.llamacpp_suite_plugin", "-p", "no:cacheprovider"]
    command += [f"--deselect={test}" for test in DESELECTED]
    command += [f"--junitxml={junit}", "-o", "junit_family=xunit1", *extra]
    with open(out / f"{backend}.log", "w") as log:
        subprocess.run(command, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
    return junit


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """Test id -> (passed / failed / error / skipped, the first line of why)."""
    found: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').removeprefix('unit.')}::{case.get('name')}"
        outcome, why = "passed", ""
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                outcome = "failed" if kind == "failure" else kind
                why = (element.get("message") or "").strip().split("\n")[0][:160]
                break
        found[name] = (outcome, why)
    return found


def summary(results: dict[str, dict[str, tuple[str, str]]]) -> str:
    """The Markdown comparison of the two sides' outcomes."""
    ours = results.get("slotserve", {})
    theirs = results.get("llama-server", {})
    names = sorted(set(ours) | set(theirs))
    passed_there = [n for n in names if theirs.get(n, ("",))[0] == "passed"]
    passed_both = [n for n in passed_there if ours.get(n, ("",))[0] == "passed"]
    lines = [
        f"{len(names)} tests; llama-server passed {len(passed_there)}, slotserve passed "
        f"{len(passed_both)} of those ({sum(o[0] == 'passed' for o in ours.values())} in all).",
        "",
        "| test | llama-server | slotserve | slotserve's failure |",
        "| --- | --- | --- | --- |",
    ]
    for name in names:
        there = theirs.get(name, ("not run", ""))
        here = ours.get(name, ("not run", ""))
        why = here[1].replace("|", "\\|") if here[0] != "passed" else ""
        lines.append(f"| `{name}` | {there[0]} | {here[0]} | {why} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``as-llama-server BACKEND ARGS…`` (the suite's server) or the runner (see the module
    docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["as-llama-server"]:
        backend, rest = argv[1], argv[2:]
        return serve_slotserve(rest) if backend == "slotserve" else serve_llama_server(rest)
    parser = argparse.ArgumentParser(prog="python -m slotserve.bench.llamacpp_suite")
    parser.add_argument("--backend", choices=[*BACKENDS, "both"], default="both")
    parser.add_argument("--suite", type=Path, help="an unpacked vendor/llama.cpp")
    parser.add_argument("--out", type=Path, default=Path("llamacpp-suite"))
    parser.add_argument("--all-files", action="store_true", help="every test of FILES")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    options = parser.parse_args(argv)
    llama_cpp = (options.suite or suite_dir()).resolve()
    out = options.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    backends = BACKENDS if options.backend == "both" else (options.backend,)
    tests = FILES if options.all_files else SELECTED
    results = {}
    for backend in backends:
        junit = run_suite(backend, llama_cpp, out, tests, options.pytest_args)
        results[backend] = outcomes(junit)
    for backend in BACKENDS:  # a side run before keeps its results in the summary
        junit = out / f"{backend}.xml"
        if backend not in results and junit.is_file():
            results[backend] = outcomes(junit)
    text = summary(results)
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
