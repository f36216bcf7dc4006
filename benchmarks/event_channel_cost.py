"""The API process's cost of handing one event from the ranks' reader to its request's stream.

Drives the product's :class:`~vexpert_runtime.serve.dispatcher.EventChannel` as the API does at
256 streams: the reader delivers one iteration's events (one per request) in one loop callback
(``_put_each``, what ``EventChannel.put_all`` schedules), then each request's stream task wakes and
reads its batch. Prints the best of 5 rounds in µs per event (delivery + read + the task's wake-up).

    python benchmarks/event_channel_cost.py [--streams 256] [--tokens 64]

Run it in two trees to compare (``PYTHONPATH=<tree>/runtime``). Results: ``results/event_channel_cost.txt``.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from vexpert_runtime.serve import dispatcher
from vexpert_runtime.serve.events import Event


async def read_all(channel: dispatcher.EventChannel) -> int:
    events = 0
    async for batch in channel:
        events += len(batch)
    return events


async def measure(streams: int, tokens: int, rounds: int = 5) -> float:
    loop = asyncio.get_running_loop()
    best = float("inf")
    for _ in range(rounds):
        channels = [dispatcher.EventChannel(loop) for _ in range(streams)]
        readers = [asyncio.ensure_future(read_all(channel)) for channel in channels]
        await asyncio.sleep(0)
        start = time.perf_counter()
        for step in range(tokens):
            finish = "length" if step == tokens - 1 else None
            dispatcher._put_each([(channel, Event("r", text="x", new_tokens=1, finish_reason=finish))
                                  for channel in channels])
            await asyncio.sleep(0)  # the readers run, as between two of the reader thread's wake-ups
        read = await asyncio.gather(*readers)
        best = min(best, (time.perf_counter() - start) / (streams * tokens) * 1e6)
        assert read == [tokens] * streams, read
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    us = asyncio.run(measure(args.streams, args.tokens))
    print(f"streams {args.streams} tokens {args.tokens}: {us:.2f} µs per event (delivery + read + wake-up)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
