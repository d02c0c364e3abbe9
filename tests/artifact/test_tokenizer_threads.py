"""The HF tokenizer's one backend: special-token text encoded as text for one call never
leaks into another thread's call, and no second copy of the backend is made for it."""

from __future__ import annotations

import subprocess
import sys
import threading

import slotserve as ss


def test_both_modes_from_many_threads_give_their_own_ids(bundled: ss.Model) -> None:
    codec = bundled.tokenizer._codec
    text = "<|im_start|>user hello<|im_end|>"
    special, plain = codec.encode(text), codec.encode(text, parse_special=False)
    assert special != plain and len(plain) > len(special)
    wrong: list[tuple[bool, list[int]]] = []

    def work(parse_special: bool) -> None:
        for _ in range(300):
            ids = codec.encode(text, parse_special=parse_special)
            if ids != (special if parse_special else plain):
                wrong.append((parse_special, ids))

    threads = [threading.Thread(target=work, args=(i % 2 == 0,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong
    assert codec.encode(text) == special  # the flag is back where it was


_MEASURE = """
import slotserve as ss
def rss():
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) // 1024
tokenizer = ss.load("bundled", progress=False).tokenizer
before = rss()
tokenizer.encode_chat([{"role": "user", "content": "hi <|im_start|> there"}])
print(rss() - before)
"""


def test_encoding_text_makes_no_copy_of_the_backend() -> None:
    """A second backend held a copy of the vocabulary and merges: 46 MiB for the bundled
    model (measured in a fresh process: no earlier call has made or freed anything)."""
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE], capture_output=True, text=True, check=True, timeout=300
    )
    assert int(done.stdout.split()[-1]) < 10
