"""A WebSocket handshake flood, run as its own process so its work is not the test's:
``python -m tests.ws_flood PORT TOKEN COUNT SECONDS [SOURCES]``.

Opens ``COUNT`` board handshakes (``GET /ws/board/`` with ``Authorization: Token``) at
an even pace over ``SECONDS``, from ``SOURCES`` loopback source addresses in turn
(127.0.1.1, 127.0.1.2, ...: the service sees that many client addresses), each over raw
asyncio streams: send the upgrade, read the answer and the first frames (an accepted
socket: the ``rate_limited`` message and the close frame, or nothing), then drop the
connection. Prints ``under way`` at its first refused handshake (the fact a test waits
for), then one JSON line: ``{"sent", "upgraded", "rate_limited", "closed_early", "refused",
"errors", "error_kinds", "elapsed_s"}`` (``closed_early``: upgraded, then reset before its frames were
read; ``errors``: handshakes that failed on this client's side, their kinds in
``error_kinds``). Standard library only.
"""
import asyncio
import base64
import json
import os
import sys
import time

CONCURRENCY = 64
READ_TIMEOUT_S = 5.0


async def one(port: int, token: str, source: str, counts: dict) -> None:
    key = base64.b64encode(os.urandom(16)).decode()
    request = (f"GET /ws/board/ HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nAuthorization: Token {token}\r\n\r\n")
    writer = None
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        writer.write(request.encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            counts["refused"] += 1
            return
        counts["upgraded"] += 1
        try:
            data = await asyncio.wait_for(reader.read(4096), 0.5)
        except TimeoutError:
            data = b""  # accepted and kept: the board's own feed (no message until an event)
        except ConnectionResetError:
            # Upgraded, then dropped before this (loaded) client read its frames: the server
            # aborts a refused socket whose close handshake nobody answered. Not a failure.
            counts["closed_early"] += 1
            return
        if b"rate_limited" in data:
            counts["rate_limited"] += 1
            if counts["rate_limited"] == 1:
                print("under way", flush=True)  # the owner's burst is used up: the flood bites
    except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
        counts["errors"] += 1
        kinds = counts.setdefault("error_kinds", {})
        kinds[type(exc).__name__] = kinds.get(type(exc).__name__, 0) + 1
    finally:
        if writer is not None:
            writer.close()


async def flood(port: int, token: str, count: int, seconds: float, sources: int) -> dict:
    counts = {"sent": 0, "upgraded": 0, "rate_limited": 0, "closed_early": 0, "refused": 0, "errors": 0}
    gate = asyncio.Semaphore(CONCURRENCY)
    started = time.monotonic()
    tasks = []

    async def paced(i: int):
        async with gate:
            await one(port, token, f"127.0.1.{1 + i % sources}", counts)

    for i in range(count):
        due = started + seconds * i / count
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        counts["sent"] += 1
        tasks.append(asyncio.create_task(paced(i)))
    await asyncio.gather(*tasks)
    counts["elapsed_s"] = round(time.monotonic() - started, 2)
    return counts


def main() -> None:
    port, token, count, seconds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    sources = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    print(json.dumps(asyncio.run(flood(port, token, count, seconds, sources))), flush=True)


if __name__ == "__main__":
    main()
