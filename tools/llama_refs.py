"""Parity references from llama.cpp's own server: greedy completions with their top-2
log-probabilities, for `tests/artifact/test_gguf_parity.py`.

    python tools/llama_refs.py MODEL OUT.json [--label TEXT]

MODEL is a named model (``bundled``, ``gemma3-270m``) or a .gguf path. It starts the
llama-server of ``make bench-deps`` on the file (2 threads), tokenises each prompt with
``/tokenize`` (special tokens added and parsed, as a completion does), and runs greedy
``/completion`` with ``n_probs: 2``. Greedy decoding is teacher forcing on its own tokens,
so entry i of a case holds the top-1 token after ``prompt + greedy[:i]`` and its margin
over the second, ``logprob1 - logprob2`` (= the logit difference: both come from one
softmax over the full vocabulary, before sampling). The prompts include two longer than
512 tokens, past Gemma 3's sliding window.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from slotserve.artifact import model_path
from slotserve.bench.llama_server import LLAMA_CPP_PYTHON_VERSION, find_llama_server

MAX_NEW_TOKENS = 32
_STORY = (
    "The lighthouse keeper climbed the spiral stairs each evening at dusk. He trimmed the "
    "wick, polished the great lens, and wrote the weather in a leather book. Ships passed "
    "far out on the grey water, and sometimes one would signal with a lamp. "
)
_FACTS = (
    "Water boils at one hundred degrees Celsius at sea level. The heart pumps blood through "
    "arteries and veins. Photosynthesis turns light, water and carbon dioxide into sugar. "
)
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Q: What is 12 times 12?\nA:",
    "The three primary colors are",
    "import numpy as np\n\n# Compute the mean of each column\n",
    "Here is a list of fruits: apple, banana,",
    "In 1969, the first humans landed on",
    "The quick brown fox",
    "Translate to French: 'Good morning, how are you?'\n",
    _STORY * 12 + "One night, a storm came and",
    _FACTS * 16 + "In summary, the most important fact is that",
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _post(port: int, route: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{route}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def _wait_ready(port: int, server: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("llama-server did not become ready")


def case(port: int, prompt: str) -> dict[str, Any]:
    tokens = _post(port, "/tokenize", {"content": prompt, "add_special": True})["tokens"]
    done = _post(
        port,
        "/completion",
        {
            "prompt": tokens,
            "n_predict": MAX_NEW_TOKENS,
            "temperature": 0,
            "n_probs": 2,
            "cache_prompt": False,
            "repeat_penalty": 1.0,
        },
    )
    greedy, top1, margin = [], [], []
    for entry in done["completion_probabilities"]:
        first, second = entry["top_logprobs"][:2]
        greedy.append(entry["id"])
        top1.append(first["id"])
        margin.append(round(first["logprob"] - second["logprob"], 4))
    return {
        "prompt": prompt,
        "prompt_tokens": tokens,
        "greedy_tokens": greedy,
        "teacher_forced_top1": top1,
        "teacher_forced_margin": margin,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    binary = find_llama_server()
    if binary is None:
        print("no llama-server: run `make bench-deps`", file=sys.stderr)
        return 1
    path = model_path(args.model)
    port = _free_port()
    command = [str(binary), "-m", str(path), "--port", str(port), "-c", "4096", "-t", "2"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(port, server)
        cases = []
        for i, prompt in enumerate(PROMPTS):
            cases.append(case(port, prompt))
            print(f"{i + 1}/{len(PROMPTS)}: {len(cases[-1]['prompt_tokens'])} prompt tokens")
    finally:
        server.terminate()
        server.wait(timeout=30)
    meta = {
        "producer": f"llama-server of llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}, greedy "
        "/completion with n_probs 2 (repeat penalty off, prompt cache off), 2 threads",
        "model": args.label or path.name,
        "teacher_forced": "entry i: the top-1 token after prompt + greedy[:i], and its "
        "logprob margin over the second",
        "max_new_tokens": MAX_NEW_TOKENS,
    }
    args.out.write_text(json.dumps({"meta": meta, "cases": cases}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
