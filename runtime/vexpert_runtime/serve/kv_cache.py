"""A rank's paged KV cache: fixed-size blocks in one pool, a block table per sequence.

:class:`BlockPool` is the host-side bookkeeping (pure Python, no tensors): which blocks are free and
which a sequence holds (its *block table*, in token order). Blocks are taken as a sequence grows —
never more than it holds tokens for — and all return at its finish; when the pool runs dry the
scheduler preempts a sequence (:mod:`.scheduler`), so a grow that does not fit is refused whole.

With ``prefix_caching``, a full block of a prompt is published under a digest of its tokens and of
every token before it (:func:`token_block_digests`); a later prompt that starts the same way attaches
those blocks instead of computing them (shared: a block counts the sequences holding it). A published
block no sequence holds stays cached until the pool needs it (least recently freed first). A full
prompt block is never written again, so sharing needs no copy.

:class:`PagedKVCache` owns the device tensors: per attention layer, one tensor of ``num_blocks ·
block_size`` token *slots* (slot ``b·block_size + i`` is token ``i`` of block ``b``), whose row is what
a token leaves behind for later queries — keys and values (GQA: ``[slots, 2, kv_heads, head_dim]``)
or DeepSeek's compressed latent and rotary key (MLA: ``[slots, kv_lora_rank + qk_rope_head_dim]``).
Block 0 is never handed out: padded tokens of a CUDA-graph batch write there.

The cache holds its rows in the model's compute dtype, or in FP8 (``--kv-cache-dtype fp8``, vLLM's option of that
name: e4m3, or e5m2): half the bytes, so twice the tokens in the same memory. As vLLM's FP8 cache without calibrated
scales, rows are stored unscaled, saturated to the format's range (:func:`write_rows`); readers widen them to the
queries' dtype (the attention kernels and their torch twins).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

import torch

from vexpert_runtime.config import KVCacheDtype
from vexpert_runtime.errors import VExpertInputError

SCRATCH_BLOCK = 0  # written by padded tokens, never read by a sequence

# ``--kv-cache-dtype`` (vLLM's names, :data:`~vexpert_runtime.config.KVCacheDtype`) → the cache's dtype; "auto": the
# model's compute dtype
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
assert tuple(KV_CACHE_DTYPES) == get_args(KVCacheDtype)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype ``--kv-cache-dtype name`` asks for, for a model computing in ``compute_dtype``."""
    if name not in KV_CACHE_DTYPES:
        raise VExpertInputError("kv_cache_dtype", f"{name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or compute_dtype


def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """This iteration's rows [T, ...] into the cache's ``slots`` [T] — into an FP8 cache saturated to the format's
    largest finite value (a cast alone makes larger ones NaN in e4m3) and written as bytes (``index_copy_`` has no
    FP8 kernel on CPU); graph-capturable."""
    if cache.dtype in FP8_DTYPES:
        largest = torch.finfo(cache.dtype).max
        stored = rows.clamp(-largest, largest).to(cache.dtype)
        cache.view(torch.uint8).index_copy_(0, slots, stored.view(torch.uint8))
    else:
        cache.index_copy_(0, slots, rows.to(cache.dtype))


class KVCacheFull(RuntimeError):
    """A sequence asked for more blocks than the pool has free (the scheduler preempts before: a bug)."""


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return -(-tokens // block_size)


def token_block_digests(token_ids: Sequence[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """One digest per full block of ``token_ids``: BLAKE2b-128 of the previous block's digest (``parent``
    for the first: the blocks before ``token_ids``, if any) and this block's token ids, so equal digests
    mean equal prefixes (no Python ``hash``: a collision would silently serve another prompt's cache)."""
    digests: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.blake2b(parent + array("q", token_ids[start:start + block_size]).tobytes(),
                                 digest_size=16).digest()
        digests.append(parent)
    return digests


def salt_digest(salt: str | None) -> bytes:
    """The parent of a salted prompt's first block (vLLM's ``cache_salt``): prompts with different salts share no
    cached block; b"" for none."""
    return b"" if salt is None else hashlib.blake2b(b"cache_salt\0" + salt.encode(), digest_size=16).digest()


class BlockPool:
    """Free list and block tables of one rank's KV cache (host side).

    Args:
        num_blocks: blocks in the pool, the scratch block included (so ``num_blocks - 1`` usable).
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise VExpertInputError("kv_block_size", f"{block_size} must be ≥ 1")
        if num_blocks < 2:
            raise VExpertInputError("kv_cache", f"{num_blocks} blocks: the pool needs at least 2 (one is scratch)",
                                    "give the KV cache more memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))  # pop() takes the lowest
        self._tables: dict[int, list[int]] = {}
        # prefix caching (see the module docstring): sequences holding each block, published blocks
        # by digest and back, and the published blocks no sequence holds (least recently freed first)
        self._holders: dict[int, int] = {}
        self._by_digest: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()
        self.hit_tokens = 0  # prompt tokens attached from the cache (over the pool's life)
        self.query_tokens = 0  # prompt tokens looked up

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        """Blocks not held by any sequence (cached ones included: reused once the never-published ones
        are gone)."""
        return len(self._free) + len(self._cached)

    @property
    def used_blocks(self) -> int:
        return self.usable_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Published blocks no sequence holds: a later prompt may still attach them."""
        return len(self._cached)

    def capacity_tokens(self) -> int:
        return self.usable_blocks * self.block_size

    def add(self, seq_id: int) -> None:
        """Start an empty block table for ``seq_id`` (admitted: its blocks come with :meth:`grow`)."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} is already admitted")
        self._tables[seq_id] = []

    def grow(self, seq_id: int, tokens: int) -> list[int]:
        """Make ``seq_id``'s table cover ``tokens`` tokens (taking blocks as needed); its table.
        Raises :class:`KVCacheFull`, taking nothing, when the pool has too few free blocks."""
        table = self._tables[seq_id]
        missing = blocks_for(tokens, self.block_size) - len(table)
        if missing > self.free_blocks:
            raise KVCacheFull(f"sequence {seq_id}: {missing} more blocks, {self.free_blocks} free")
        for _ in range(missing):
            block = self._take()
            self._holders[block] = 1
            table.append(block)
        return table

    def _take(self) -> int:
        """A block no sequence holds: a never-published one first, else the least recently freed cached one."""
        if self._free:
            return self._free.pop()
        block, _ = self._cached.popitem(last=False)
        del self._by_digest[self._digest_of.pop(block)]
        return block

    def attach_prefix(self, seq_id: int, digests: Sequence[bytes]) -> int:
        """Start ``seq_id``'s (empty) table with the published blocks of the longest prefix of
        ``digests``; how many blocks it attached."""
        table = self._tables[seq_id]
        if table:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        for digest in digests:
            block = self._by_digest.get(digest)
            if block is None:
                break
            held = self._holders.get(block, 0)
            if held == 0:
                del self._cached[block]
            self._holders[block] = held + 1
            table.append(block)
        self.query_tokens += len(digests) * self.block_size
        self.hit_tokens += len(table) * self.block_size
        return len(table)

    def publish(self, seq_id: int, digests: Sequence[bytes]) -> None:
        """Publish ``seq_id``'s first ``len(digests)`` blocks (full, their tokens computed or being
        computed by a launched step) under those digests; a digest already published keeps its block."""
        table = self._tables[seq_id]
        for block, digest in zip(table, digests, strict=False):
            if block not in self._digest_of and digest not in self._by_digest:
                self._digest_of[block] = digest
                self._by_digest[digest] = block

    def forget_published(self) -> None:
        """Unpublish every block (a failed step may have left some half written)."""
        self._by_digest.clear()
        self._digest_of.clear()
        self._free.extend(self._cached)
        self._cached.clear()

    def table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def free(self, seq_id: int) -> None:
        """Return a sequence's blocks (unknown ids are ignored)."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        for block in reversed(table):
            held = self._holders.pop(block) - 1
            if held:  # another sequence shares it
                self._holders[block] = held
            elif block in self._digest_of:
                self._cached[block] = None  # kept for a later prompt
            else:
                self._free.append(block)

    def slots(self, seq_id: int, start: int, count: int) -> list[int]:
        """Cache slots of tokens ``start .. start+count-1`` of ``seq_id`` (the table must cover them)."""
        table, size = self._tables[seq_id], self.block_size
        return [table[p // size] * size + p % size for p in range(start, start + count)]


@dataclass(frozen=True)
class KVLayout:
    """What one token leaves in one attention layer's cache.

    ``mla``: one row of ``latent`` (kv_lora_rank) + ``rope`` (qk_rope_head_dim) values; else GQA keys
    and values: ``kv_heads`` × ``head_dim`` each.
    """

    num_layers: int
    mla: bool
    kv_heads: int = 0
    head_dim: int = 0
    latent: int = 0
    rope: int = 0

    def row_shape(self) -> tuple[int, ...]:
        return (self.latent + self.rope,) if self.mla else (2, self.kv_heads, self.head_dim)

    def token_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one token holds over all layers."""
        numel = 1
        for n in self.row_shape():
            numel *= n
        return numel * self.num_layers * torch.empty((), dtype=dtype).element_size()


class PagedKVCache:
    """The device tensors of a rank's KV cache (see the module docstring); which blocks belong to
    whom is the scheduler's :class:`BlockPool`, made with the same ``num_blocks`` and ``block_size``."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.layers = [torch.zeros(num_blocks * block_size, *layout.row_shape(), dtype=dtype, device=device)
                       for _ in range(layout.num_layers)]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)


def num_blocks_for_memory(free_bytes: int, layout: KVLayout, block_size: int, dtype: torch.dtype) -> int:
    """How many blocks ``free_bytes`` of memory hold."""
    return max(0, free_bytes // (layout.token_bytes(dtype) * block_size))
