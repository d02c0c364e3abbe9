"""New-user check (issue 14, re-measured for issue 31): ask a running server "What is the
capital of France?" 20 times per setting, count the answers that contain "Paris", and show
the most frequent answers (greedy gives one answer 20 times: it is printed once).

    slotserve serve &            # the bundled model (its GGUF blocks), default sampling
    python tools/new_user_check.py http://127.0.0.1:8000 [RUNS]
"""

from __future__ import annotations

import sys
from collections import Counter

import httpx

QUESTION = "What is the capital of France?"
SETTINGS: dict[str, dict[str, float]] = {
    "server defaults (no temperature sent)": {},
    "temperature 1.0 sent, other defaults applied": {"temperature": 1.0},
    "OpenAI's plain temperature 1.0 (no top-k/top-p/min-p)": {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
    },
    "temperature 0 (greedy)": {"temperature": 0},
}
SHOWN = 2  # the most frequent answers printed per setting
SHOWN_CHARS = 100


def ask(url: str, extra: dict[str, float]) -> str:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": QUESTION}],
        **extra,
    }
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    return str(reply["choices"][0]["message"]["content"])


def main(url: str, runs: int = 20) -> None:
    for name, extra in SETTINGS.items():
        answers = [ask(url, extra) for _ in range(runs)]
        hits = sum("Paris" in answer for answer in answers)
        print(f"{name}: {hits}/{runs} answers contain 'Paris'")
        for answer, count in Counter(answers).most_common(SHOWN):
            text = " ".join(answer.split())
            shown = text[:SHOWN_CHARS] + ("…" if len(text) > SHOWN_CHARS else "")
            print(f"    {count}x {shown!r}")


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000",
        int(sys.argv[2]) if len(sys.argv) > 2 else 20,
    )
