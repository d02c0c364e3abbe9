"""The bundled model against llama.cpp (tests/data/llamacpp_greedy.json, see its meta)."""

from __future__ import annotations

from typing import Any

import slotserve as ss


def test_chat_template_renders_the_reference_prompt(
    bundled: ss.Model, reference: dict[str, Any]
) -> None:
    chats = [c for c in reference["cases"] if c["kind"] == "chat"]
    assert chats
    for case in chats:
        messages = [{"role": "user", "content": case["user_text"]}]
        assert bundled.tokenizer.render_chat(messages) == case["prompt"]


def test_tokenisation_matches_llama_cpp(bundled: ss.Model, reference: dict[str, Any]) -> None:
    assert reference["meta"]["add_bos"] is False
    for case in reference["cases"]:
        assert bundled.tokenizer.encode(case["prompt"]) == case["prompt_tokens"], case["prompt"]


def test_teacher_forced_argmax_matches_llama_cpp(
    bundled: ss.Model, reference: dict[str, Any]
) -> None:
    agree = total = 0
    for case in reference["cases"]:
        prompt, greedy = case["prompt_tokens"], case["greedy_tokens"]
        logits = bundled.logits(prompt + greedy[:-1])[len(prompt) - 1 :]
        ours = logits.argmax(-1).tolist()
        for position, (mine, theirs, margin) in enumerate(
            zip(ours, case["teacher_forced_top1"], case["teacher_forced_margin"], strict=True)
        ):
            total += 1
            agree += mine == theirs
            if margin >= 1.0:
                assert mine == theirs, f"{case['prompt']!r} position {position}, margin {margin}"
    assert agree / total >= 0.95, f"agreement {agree}/{total}"


def test_bundled_metadata(bundled: ss.Model) -> None:
    info = bundled.info
    assert (info.arch, info.n_layers, info.dim, info.n_heads, info.n_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert info.tied_embeddings and info.eos_ids == (2,) and info.vocab_size == 49152
    assert 130e6 < bundled.weights.n_params < 140e6
