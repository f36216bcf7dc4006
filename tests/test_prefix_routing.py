"""Cache-aware routing (serve/prefix_routing.py, serve/multirank.py): with prefix caching on several
ranks, a prompt goes to the rank that was sent the longest prefix of it — a chat's next turn to the
rank holding its earlier turns — unless that rank carries more than the slack beyond the least-loaded
one; without prefix caching the dispatcher stays least-loaded only."""

from __future__ import annotations

import asyncio
import queue
from typing import Any

import pytest

from vexpert_runtime.serve.events import GenerationRequest, RankEvent, RankLoad, SamplingParams
from vexpert_runtime.serve.kv_cache import salt_digest, token_block_digests
from vexpert_runtime.serve.multirank import MultiRankDispatcher
from vexpert_runtime.serve.prefix_routing import PrefixAffinity

BLOCK = 4


def _prompt(*blocks: int) -> tuple[int, ...]:
    """A prompt of whole 4-token blocks, block ``b`` being tokens b, b, b, b (plus one token more)."""
    return (*(b for b in blocks for _ in range(BLOCK)), 99)


def test_the_longest_remembered_prefix_names_the_rank() -> None:
    affinity = PrefixAffinity(BLOCK, slack=2)
    a, b = affinity.digests(_prompt(1, 2, 3)), affinity.digests(_prompt(1, 2, 7))
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]  # digests chain: equal prefixes, then they part
    assert affinity.preferred(a) is None
    affinity.record(a, 0)
    affinity.record(b, 1)  # the shared first two blocks now point at rank 1 (sent last)
    assert affinity.preferred(a) == 0  # its third block is rank 0's alone
    assert affinity.preferred(affinity.digests(_prompt(1, 2, 3, 4))) == 0  # a continuation of a
    assert affinity.preferred(affinity.digests(_prompt(1, 2))) == 1
    assert affinity.preferred(affinity.digests(_prompt(5, 2, 3))) is None  # another start: nothing shared
    # a cache_salt names other blocks — the ranks' own digests of that salt —, so it is routed as a prompt of its own
    salted = affinity.digests(_prompt(1, 2, 3), "tenant-b")
    assert salted == token_block_digests(_prompt(1, 2, 3), BLOCK, salt_digest("tenant-b"))
    assert not set(salted) & set(a) and affinity.preferred(salted) is None


def test_affinity_yields_to_load_beyond_its_slack_and_to_full_ranks() -> None:
    affinity = PrefixAffinity(BLOCK, slack=2)
    chat = affinity.digests(_prompt(1, 2, 3))
    affinity.record(chat, 1)
    assert affinity.choose(chat, in_flight=[0, 2], open_ranks=[0, 1], least_loaded=0) == 1  # 2 more: within
    assert affinity.choose(chat, in_flight=[0, 3], open_ranks=[0, 1], least_loaded=0) == 0  # 3 more: beyond
    assert affinity.choose(chat, in_flight=[0, 0], open_ranks=[0], least_loaded=0) == 0  # rank 1 full
    # an eighth of the least-loaded rank's when that is more: 40 + 5 within, 40 + 6 beyond
    assert affinity.choose(chat, in_flight=[40, 45], open_ranks=[0, 1], least_loaded=0) == 1
    assert affinity.choose(chat, in_flight=[40, 46], open_ranks=[0, 1], least_loaded=0) == 0
    with pytest.raises(ValueError):
        PrefixAffinity(0)


def test_memory_is_bounded_least_recently_routed_first() -> None:
    affinity = PrefixAffinity(BLOCK, capacity=4)
    old, new = affinity.digests(_prompt(1, 2, 3)), affinity.digests(_prompt(7, 8))
    affinity.record(old, 0)
    affinity.record(new, 1)  # 5 digests > 4: old's first block goes
    assert affinity.preferred(old) is None and affinity.preferred(new) == 1


def _request(rid: str, prompt: tuple[int, ...]) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=4, temperature=0))


@pytest.mark.parametrize("caching", [True, False])
def test_the_dispatcher_sends_a_chats_next_turn_to_the_rank_of_its_first(caching: bool) -> None:
    """Two ranks (fake: their inbound queues are read here, nothing finishes). Turn one of chat A goes
    to rank 0, of chat B to rank 1 (least-loaded); turn two of A — its first turn's blocks and more — goes
    to rank 0 again although rank 1 has fewer in flight then; without prefix caching, least-loaded."""

    async def run() -> list[int]:
        inbound: list[queue.Queue[Any]] = [queue.Queue(), queue.Queue()]
        events: queue.Queue[Any] = queue.Queue()
        dispatcher = MultiRankDispatcher(inbound, events, 8, lambda: None, lambda: None, max_running=8,
                                         prefix_block_size=BLOCK if caching else None)
        ranks = []
        try:
            for rid, prompt in (("a1", _prompt(1, 2, 3)), ("b1", _prompt(4, 5)), ("x", _prompt(6)),
                                ("a2", _prompt(1, 2, 3, 8, 9))):
                submitted = asyncio.ensure_future(dispatcher.submit(_request(rid, prompt)))
                sent = None
                while sent is None:
                    for rank, box in enumerate(inbound):
                        if not box.empty():
                            sent = (rank, box.get_nowait())
                    await asyncio.sleep(0.001)
                rank, request = sent
                assert request.request_id == rid
                ranks.append(rank)
                events.put(RankEvent(rank, (), (rid,), RankLoad()))  # accepted, still running
                await asyncio.wait_for(submitted, 5)
        finally:
            dispatcher.close()
        return ranks

    ranks = asyncio.run(run())
    # a1 → 0, b1 → 1, x → 0 (tie: the lowest), then rank 0 has 2 in flight and rank 1 one
    assert ranks[:3] == [0, 1, 0]
    assert ranks[3] == (0 if caching else 1)
