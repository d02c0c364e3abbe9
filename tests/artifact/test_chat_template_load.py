"""A chat template is compiled when the model loads. One that does not parse still loads
(plain prompts work) with a warning, and every chat rendering raises `ChatTemplateInvalid`
naming the file, the line and jinja2's message (the server's answer to it, 400, is in
tests/server/test_chat_template.py)."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

import slotserve as ss
from slotserve import testing
from slotserve.artifact import weight_cache
from slotserve.artifact.gguf_load import load_gguf
from slotserve.engine.probe import teacher_forced_logits
from slotserve.tokenizer import (
    ChatTemplateInvalid,
    ChatTemplateMissing,
    Tokenizer,
    compile_chat_template,
)

BROKEN = "{% for m in messages %}{{ m['content'] }}\n{% if %}{% endif %}{% endfor %}"
BROKEN_LINE = 2  # the `{% if %}`
MESSAGES = [{"role": "user", "content": "hi"}]


def assert_refuses_chat(tokenizer: Tokenizer, source: str) -> ChatTemplateInvalid:
    error = tokenizer.chat_template_error
    assert error is not None and error.source == source and error.line == BROKEN_LINE
    for render in (tokenizer.render_chat, tokenizer.encode_chat):
        with pytest.raises(ChatTemplateInvalid) as raised:
            render(MESSAGES)
        assert isinstance(raised.value, ChatTemplateMissing)  # answered as a missing one
        message = str(raised.value)
        assert message.startswith(f"{source}: the chat template does not parse (line 2: ")
        assert "--chat-template FILE" in message
    return error


def test_a_broken_template_in_a_gguf_loads_and_refuses_chat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(testing, "CHAT_TEMPLATE", BROKEN)
    path = testing.write_tiny_gguf(tmp_path / "m.gguf", "llama", "Q8_0")
    source = f"{path} [tokenizer.chat_template]"
    with caplog.at_level(logging.WARNING, logger="slotserve"):
        model = load_gguf(path, progress=False)
    assert f"{source}: the chat template does not parse (line 2" in caplog.text
    assert model.tokenizer.chat_template == BROKEN  # kept as the file gave it
    assert_refuses_chat(model.tokenizer, source)
    assert (
        teacher_forced_logits(model, model.tokenizer.encode("hello")).isfinite().all()
    )  # prompts work
    # From the weight cache's entry: the same error, still naming the GGUF.
    assert weight_cache.entry_path(weight_cache.file_digest(path)).is_file()
    assert_refuses_chat(load_gguf(path, progress=False).tokenizer, source)


def test_a_broken_template_in_tokenizer_config_names_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = testing.write_tiny_hf_dir(tmp_path / "hf")
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": BROKEN}))
    with caplog.at_level(logging.WARNING, logger="slotserve"):
        model = ss.load(directory)
    assert str(config_file) in caplog.text
    error = assert_refuses_chat(model.tokenizer, f"{config_file} [chat_template]")
    assert "expected" in error.reason.lower()  # jinja2's own words


def test_a_broken_chat_template_jinja_names_that_file(tmp_path: Path) -> None:
    directory = testing.write_tiny_hf_dir(tmp_path / "hf")
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["chat_template"]
    config_file.write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text(BROKEN)
    model = ss.load(directory)
    assert_refuses_chat(model.tokenizer, str(directory / "chat_template.jinja"))


def test_a_tokenizer_round_trip_keeps_the_refusal(tmp_path: Path) -> None:
    model = testing.tiny_model(tmp_path / "hf")
    model.tokenizer.set_chat_template(BROKEN, source="here")
    copy = Tokenizer.from_json(model.tokenizer.to_json(), chat_template_source="a bundle")
    assert copy.chat_template == BROKEN
    assert_refuses_chat(copy, "a bundle")


def test_setting_a_template_compiles_it_and_clears_the_refusal(tmp_path: Path) -> None:
    tokenizer = testing.tiny_model(tmp_path / "hf").tokenizer
    good = tokenizer.render_chat(MESSAGES)
    tokenizer.chat_template = BROKEN  # as serve --chat-template sets it
    assert_refuses_chat(tokenizer, "chat template")
    tokenizer.chat_template = testing.CHAT_TEMPLATE
    assert tokenizer.chat_template_error is None and tokenizer.render_chat(MESSAGES) == good
    tokenizer.chat_template = None
    with pytest.raises(ChatTemplateMissing) as missing:
        tokenizer.render_chat(MESSAGES)
    assert type(missing.value) is ChatTemplateMissing


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("{% if %}", 1, "expected an expression"),
        ("{{ x }}\n\n{% for %}", 3, "expected an expression"),
        ("{% if x %}", 1, "end of template"),
        ("{{ x | no_such_filter }}", 1, "no filter named"),
        ("{% generation %}{% endgeneration %}", 1, "unknown tag"),
    ],
)
def test_compile_names_jinjas_line_and_message(text: str, line: int, words: str) -> None:
    with pytest.raises(ChatTemplateInvalid) as raised:
        compile_chat_template(text, "f.jinja")
    assert raised.value.line == line and words in raised.value.reason.lower()
    assert str(raised.value).startswith(f"f.jinja: the chat template does not parse (line {line}")


def test_a_template_that_is_not_text_is_refused() -> None:
    with pytest.raises(ChatTemplateInvalid, match="not text but a int"):
        compile_chat_template(7, "m.gguf [tokenizer.chat_template]")


def test_a_refusal_raised_from_many_threads_stays_small(tmp_path: Path) -> None:
    tokenizer = testing.tiny_model(tmp_path / "hf").tokenizer
    tokenizer.chat_template = BROKEN
    raised: list[ChatTemplateInvalid] = []

    def chat() -> None:
        for _ in range(50):
            try:
                tokenizer.encode_chat(MESSAGES)
            except ChatTemplateInvalid as exc:
                raised.append(exc)

    threads = [threading.Thread(target=chat) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(raised) == 200 and len({id(exc) for exc in raised}) == 200  # a fresh one each
    assert tokenizer.chat_template_error is not None
    assert tokenizer.chat_template_error.__traceback__ is None  # the stored one never raised
