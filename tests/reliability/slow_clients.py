"""Slow HTTP clients for the reliability tests (issue 31): the probe that sends a request
head, a few bytes of its body, then a byte now and then. Standard library only, so a child
process imports it in no time."""

from __future__ import annotations

import asyncio
import time

KEY = "sekret"
BODY_TIMEOUT_S = 2.0  # the --body-timeout of the servers these probes run against


def head(path: str, length: int, *, key: bool) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Content-Length: {length}",
    ]
    if key:
        lines.append(f"Authorization: Bearer {KEY}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def slow_body(
    port: int, request_head: bytes, trickle_s: float, after_s: float = 0.0
) -> tuple[int | None, float]:
    """The issue's probe on one connection, opened ``after_s`` from now: a head announcing
    100,000 bytes, 11 of them, then a byte every ``trickle_s``. Returns the answer's status
    (None if none could be read) and the seconds until the server closed the connection."""
    await asyncio.sleep(after_s)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    writer.write(request_head + b'{"model": "')

    async def trickle() -> None:
        try:
            while True:
                await asyncio.sleep(trickle_s)
                writer.write(b"x")
                await writer.drain()
        except OSError:  # the server closed: nothing more to send
            pass

    sender = asyncio.create_task(trickle())
    try:
        answer = await asyncio.wait_for(reader.read(), BODY_TIMEOUT_S + 10)  # to EOF
    except (OSError, TimeoutError):
        answer = b""
    finally:
        sender.cancel()
        writer.close()
    closed = time.monotonic() - start
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None
    return status, closed


async def flood(port: int, count: int, ramp_s: float) -> list[tuple[int | None, float]]:
    """``count`` slow bodies without the key, opened evenly over ``ramp_s``."""
    request = head("/v1/chat/completions", 100_000, key=False)
    return await asyncio.gather(
        *(slow_body(port, request, trickle_s=0.5, after_s=i * ramp_s / count) for i in range(count))
    )
