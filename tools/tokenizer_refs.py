"""Reference tokenisations of Gemma 3 270M by llama.cpp itself, for
tests/artifact/test_spm_tokenizer.py: llama-server's ``POST /tokenize`` (``add_special`` and
``parse_special`` true, as a prompt is tokenised; and ``parse_special`` false) and
``POST /detokenize`` on each prompt below.

    python tools/tokenizer_refs.py                      # writes tests/data/gemma3_tokens.json
    python tools/tokenizer_refs.py --server PATH/llama-server --out FILE

The server is `slotserve.bench.llama_server.find_llama_server`'s (``make bench-deps`` builds
it), the model `slotserve.artifact.gemma3.gemma3_gguf_path`'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

from slotserve.artifact.gemma3 import gemma3_gguf_path
from slotserve.bench.llama_server import LLAMA_CPP_PYTHON_VERSION, find_llama_server
from slotserve.bench.processes import ServerProcess, free_port

OUT = Path(__file__).parents[1] / "tests" / "data" / "gemma3_tokens.json"

# About 3,000 characters of mixed prose, code, numbers and non-Latin text.
_PARAGRAPHS = (
    "Serving a language model on a small device is mostly a question of memory: the "
    "weights, the key/value cache and the activations must all fit at once.\n",
    "def step(batch):\n    logits = model(batch.tokens)\n    return sample(logits, 0.8)\n\n",
    "In 2024, 3 of 17 runs (17.6%) took longer than 1.25 s; the median was 0.412 s.\n",
    "Les élèves ont déjà lu « Le Petit Prince » — c'était un vrai régal.\n",
    "東京の天気は晴れです。明日は雨が降るでしょう。我们明天见！\n",
    "\t- item\twith tabs\n\t\t- nested  item  with  double  spaces\n",
)
LONG_TEXT = "".join(_PARAGRAPHS[i % len(_PARAGRAPHS)] for i in range(12))[:3000]

PROMPTS = [
    "",
    "a",
    " ",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "multiple     spaces   between words",
    "line one\nline two\n\nline four\n\n\n",
    "\n\nstarts with newlines",
    "tabs\tand\t\tmore\t\t\ttabs",
    "mixed \t \n whitespace \r\n windows line endings\r\n",
    "\n" * 40 + " " * 40 + "\t" * 40 + "end",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    '#include <stdio.h>\nint main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}\n',
    '{"name": "slotserve", "version": [0, 1, 0], "ok": true, "nested": {"a": null}}',
    "<table><tr><td>cell</td></tr></table> <b>bold</b> <h1>Title</h1>",
    "# Heading\n\n- item one\n- item two\n\n```python\nprint('hi')\n```\n",
    "1234567890 3.14159 -42 1e-9 0x1F 1,000,000 2024-06-01",
    "Emoji: 👩‍👩‍👧‍👦 🇫🇷 🤖🔥 ✌🏽 😀",
    "日本語のテキストと中文文本，还有한국어 문장.",
    "Größenordnung, façade, naïve café — déjà vu. Ærøskøbing",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी, ไทย",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝑥² ∑∫√ ≠ ≤ \ue000\U0010fffd",
    "zero\u200bwidth\u200d joiner \u00a0nbsp \u3000ideographic",
    "\x00\x01\x07\x1b[31mred\x1b[0m",
    "don't won't it's we're they've I'm y'all",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "https://example.com/path?q=1&r=two#frag user@example.org",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!!!!!!!!????....",
    "pre▁escaped ▁ spaces▁▁",
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello! How can I help?"
    "<end_of_turn>\n<start_of_turn>user\n  Tell me a joke.\n<end_of_turn>\n",
    "<end_of_turn><start_of_turn> between <eos>and<pad> text <bos> in the middle",
    "</s> is control in llama.cpp, <s> is user-defined",
    "<unused0> and <unused6241>, <start_of_image>[multimodal]<end_of_image>",
    "<0x41> is not a byte token; <unk> <mask>",
    LONG_TEXT,
]


def reference(client: httpx.Client, url: str, text: str) -> dict[str, object]:
    def tokenize(parse_special: bool) -> list[int]:
        body = {"content": text, "add_special": True, "parse_special": parse_special}
        tokens: list[int] = client.post(url + "/tokenize", json=body).json()["tokens"]
        return tokens

    tokens = tokenize(True)
    detokenized = client.post(url + "/detokenize", json={"tokens": tokens}).json()["content"]
    return {
        "text": text,
        "tokens": tokens,
        "tokens_text_only": tokenize(False),
        "detokenized": detokenized,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", type=Path, default=None, help="llama-server binary")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    binary = args.server or find_llama_server()
    if binary is None:
        print("no llama-server: run `make bench-deps` or pass --server", file=sys.stderr)
        return 2
    gguf = gemma3_gguf_path()
    port = free_port()
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    server = ServerProcess([*command, "-c", "2048", "-t", "1", "--no-webui"], port)
    try:
        with httpx.Client(timeout=60) as client:
            cases = [reference(client, server.url, text) for text in PROMPTS]
    finally:
        server.stop()
    data: dict[str, object] = {
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
        "model": gguf.name,
        "fields": {
            "tokens": "POST /tokenize, add_special and parse_special true",
            "tokens_text_only": "POST /tokenize, add_special true, parse_special false",
            "detokenized": "POST /detokenize of tokens",
        },
        "cases": cases,
    }
    args.out.write_text(_one_case_a_line(data), encoding="utf-8")
    print(f"{len(cases)} prompts -> {args.out}")
    return 0


def _one_case_a_line(data: dict[str, object]) -> str:
    """``data`` as JSON with each case on a line of its own (a reviewable diff)."""
    cases = data["cases"]
    assert isinstance(cases, list)
    head = json.dumps({**data, "cases": []}, ensure_ascii=False)[: -len("[]}")]
    lines = ",\n".join(" " + json.dumps(case, ensure_ascii=False) for case in cases)
    return f"{head}[\n{lines}\n]}}\n"


if __name__ == "__main__":
    sys.exit(main())
