"""Cache-aware routing over a node's ranks (``vexpert serve --prefix-caching`` with several ranks).

Each rank caches the KV blocks of the prompts it computed (:mod:`.kv_cache`); a request whose prompt
starts like one a rank served before — a chat's next turn, an agent's growing context, a shared
system prompt — skips that prefill only on that rank. :class:`PrefixAffinity` remembers, per prompt
block digest (the ranks' own :func:`~.kv_cache.token_block_digests`, so equal digests mean equal
prefixes), the rank the dispatcher last sent it to, and proposes the rank holding a request's
longest remembered prefix. The dispatcher takes the proposal unless that rank carries more than
``slack`` requests (or an eighth, if more) beyond the least-loaded one: affinity never piles a node's
load onto one rank. SGLang's cache-aware router allows 32; vExpert's ranks step in lockstep, so a
rank with more sequences holds every other one back, and on two CPU ranks a slack of 2 kept the
same hit rate as 32 (``benchmarks/results/prefix_routing_cpu.txt``).

What it remembers is an approximation of the ranks' caches (a rank may have evicted the blocks);
a wrong guess costs a prefill, never a wrong token. Memory is bounded: the least recently routed
digests are forgotten first. With ``--api-servers N`` each API server remembers what it sent (a chat
whose turns arrive on different connections may reach different servers, and then different ranks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from vexpert_runtime.serve.kv_cache import salt_digest, token_block_digests

DEFAULT_SLACK = 2  # requests in flight beyond the least-loaded rank that affinity may add (at least)
RELATIVE_SLACK = 0.125  # ... or this share of the least-loaded rank's, if more
DEFAULT_CAPACITY = 1 << 17  # digests remembered (~2 M prompt tokens at 16-token blocks; ~20 MB)


class PrefixAffinity:
    """Digest → rank of the prompt blocks the dispatcher routed (see the module docstring).

    Args:
        block_size: the ranks' KV block size in tokens (digests must match theirs).
        slack: how many more requests in flight than the least-loaded rank a preferred rank may have
            (or :data:`RELATIVE_SLACK` of the least-loaded rank's, if more).
        capacity: digests remembered at most.
    """

    def __init__(self, block_size: int, slack: int = DEFAULT_SLACK, capacity: int = DEFAULT_CAPACITY) -> None:
        if block_size < 1 or slack < 0 or capacity < 1:
            raise ValueError(f"block_size {block_size}, slack {slack}, capacity {capacity}")
        self.block_size = block_size
        self.slack = slack
        self.capacity = capacity
        self._rank_of: OrderedDict[bytes, int] = OrderedDict()

    def digests(self, prompt_ids: Sequence[int], salt: str | None = None) -> list[bytes]:
        """The digests of the prompt's whole blocks (``salt``: its ``cache_salt``; no lock needed: pure)."""
        return token_block_digests(prompt_ids, self.block_size, salt_digest(salt))

    def preferred(self, digests: Sequence[bytes]) -> int | None:
        """The rank that was sent the longest prefix of ``digests``, or None (no block known)."""
        rank = None
        for digest in digests:
            known = self._rank_of.get(digest)
            if known is None:
                break
            rank = known
        return rank

    def choose(self, digests: Sequence[bytes], in_flight: Sequence[int], open_ranks: Sequence[int],
               least_loaded: int) -> int:
        """The rank for a request: its prefix's rank if open and within the slack of the least-loaded
        rank's in-flight count, else ``least_loaded`` (one of ``open_ranks``)."""
        preferred = self.preferred(digests)
        base = in_flight[least_loaded]
        if (preferred is not None and preferred != least_loaded and preferred in open_ranks
                and in_flight[preferred] <= base + max(self.slack, int(base * RELATIVE_SLACK))):
            return preferred
        return least_loaded

    def record(self, digests: Sequence[bytes], rank: int) -> None:
        """``rank`` was sent a prompt of these blocks: it will hold them (most recent first to keep)."""
        rank_of = self._rank_of
        for digest in digests:
            rank_of[digest] = rank
            rank_of.move_to_end(digest)
        while len(rank_of) > self.capacity:
            rank_of.popitem(last=False)
