"""`slotserve.bench.llamacpp_suite`: llama-server's flags, as llama.cpp's suite passes them,
become ``slotserve serve`` flags, and every model but the stand-in preset's is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from slotserve.bench.llamacpp_stand_in import (
    STAND_IN_REPO,
    Refused,
    llama_server_args,
    translate,
)
from slotserve.bench.llamacpp_suite import outcomes, summary

# What the suite's tinyllama2 preset starts its server with (utils.ServerProcess.start).
TINYLLAMA2 = (
    f"--port 8090 --temp 0.8 --seed 42 --host 127.0.0.1 --offline --hf-repo {STAND_IN_REPO} "
    "--batch-size 32 --no-slots --alias tinyllama-2 --ctx-size 512 --parallel 2 "
    "--n-predict 64 --no-jinja"
).split()


def test_the_preset_becomes_the_bundled_model_with_the_per_slot_context() -> None:
    flags, port = translate(TINYLLAMA2)
    assert port == 8090
    assert flags[:2] == ["--model", "bundled"]
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    assert pairs["--max-seqs"] == "2"
    assert pairs["--max-context"] == "256"  # llama.cpp splits --ctx-size among its slots
    assert pairs["--served-model-name"] == "tinyllama-2"
    assert pairs["--temperature"] == "0.8"
    assert pairs["--max-batch-tokens"] == "32"


def test_a_template_file_is_passed_and_a_template_name_refused(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    flags, _ = translate([*TINYLLAMA2, "--chat-template-file", str(template)])
    assert flags[flags.index("--chat-template") + 1] == str(template.resolve())
    with pytest.raises(Refused, match="--chat-template chatml"):
        translate([*TINYLLAMA2, "--chat-template", "chatml"])


@pytest.mark.parametrize(
    "model",
    [
        ["--hf-repo", "ggml-org/tinygemma3-GGUF:Q8_0"],
        ["--hf-repo", "ggml-org/models", "--hf-file", "bert-bge-small/ggml-model-f16.gguf"],
        ["--model", "/some/file.gguf"],
    ],
)
def test_any_other_model_is_refused_on_both_sides(model: list[str]) -> None:
    flags = ["--port", "8090", *model]
    with pytest.raises(Refused, match="only ggml-org/test-model-stories260K"):
        translate(flags)
    with pytest.raises(Refused, match="only ggml-org/test-model-stories260K"):
        llama_server_args(flags, Path("bundled.gguf"))


def test_llama_server_gets_the_bundled_gguf_and_its_other_flags_unchanged() -> None:
    args = llama_server_args(TINYLLAMA2, Path("/m/bundled.gguf"))
    assert args[:2] == ["--model", "/m/bundled.gguf"]
    assert "--hf-repo" not in args and "--offline" not in args
    assert args[2:] == [f for f in TINYLLAMA2 if f not in ("--offline", "--hf-repo", STAND_IN_REPO)]


def test_the_summary_counts_slotserve_on_what_llama_server_passed(tmp_path: Path) -> None:
    junit = tmp_path / "x.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="unit.test_a" name="t1"/>'
        '<testcase classname="unit.test_a" name="t2"><failure message="boom&#10;more"/></testcase>'
        "</testsuite></testsuites>"
    )
    found = outcomes(junit)
    assert found == {"test_a::t1": ("passed", ""), "test_a::t2": ("failed", "boom")}
    text = summary({"llama-server": found, "slotserve": {"test_a::t1": ("failed", "x")}})
    assert text.startswith("2 tests; llama-server passed 1, slotserve passed 0 of those")
