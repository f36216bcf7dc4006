"""Batched attention over a paged KV cache: one call per layer per iteration for all of a rank's sequences.

An iteration runs ``T`` new tokens of ``B`` sequences, flattened in batch order (sequence ``b``'s
tokens are ``T_b`` consecutive rows). :func:`build_metadata` turns the scheduler's work and the block
tables into :class:`AttentionMetadata`, once per iteration, shared by every layer:

* ``slot_mapping [T]``: the cache slot each new token writes (:mod:`.kv_cache`);
* ``block_tables [B, W]``, and per token ``token_seq [T]`` and ``context_lens [T]``: what each query
  reads (its sequence's tokens up to and including itself), the layout of the GPU kernels
  (:mod:`.attention_kernels`), which attend decodes and prompt chunks alike;
* for the torch path, :class:`PaddedGroup`\\ s: the sequences padded to ``[B, Q]`` queries and
  ``[B, W]`` context blocks with an additive mask (causal and, where the model has one, sliding window),
  one SDPA call per group — decodes (Q = 1) in one group, prompt chunks in another, so a long chunk
  does not pad every decode to its length.

Two cache layouts (:class:`~.kv_cache.KVLayout`):

* GQA (Qwen3-MoE, Qwen2-MoE): rows ``[2, kv_heads, head_dim]`` of rotated keys and values.
* MLA (DeepSeek-V3) decodes in latent space, as DeepSeek, SGLang and vLLM do: the cache holds the
  normalised compressed latent ``c`` (kv_lora_rank) and the rotated shared key ``k_pe``; the query's
  non-rotary part is absorbed into the latent space through kv_b_proj's key half
  (``q_c = q_nope · W_UK``) and the output leaves it through the value half (``o = (p · c) · W_UVᵀ``),
  so attention is one "head" of width kv_lora_rank + rope over every query head. Exact in real
  arithmetic (q_nope·(W_UK c) = (W_UKᵀ q_nope)·c); the sums run in another order than transformers'.

Shapes: ``T`` tokens, ``B`` sequences, ``Q``/``K`` padded queries / context per sequence, ``nh`` query
heads, ``nkv`` KV heads, ``d`` head dim, ``C`` latent width, ``R`` rotary width.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vexpert_runtime.serve.kv_cache import FP8_DTYPES, blocks_for
from vexpert_runtime.serve.step import SequenceWork


@dataclass(frozen=True)
class PaddedGroup:
    """Sequences attended in one padded SDPA call.

    ``query_index [B, Q]``: the rows of the iteration's tokens that are the queries (padding: 0);
    ``query_valid [B, Q]``; ``context_blocks [B, W]``: each sequence's block table (padding: block 0),
    so its context is the ``K = W·block_size`` slots of those blocks, gathered a block at a time (one
    contiguous copy per block instead of one per token: the gather is most of a CPU decode's attention);
    ``masks [B, 1, Q, K]``: additive, 0 where the query may attend the key (causal, inside the
    sequence's length and, per sliding window, the window), −inf elsewhere (one per window).
    """

    query_index: torch.Tensor
    query_valid: torch.Tensor
    context_blocks: torch.Tensor
    masks: dict[int | None, torch.Tensor]
    token_rows: torch.Tensor  # [n_valid] rows of the valid queries, in query_index[query_valid] order


@dataclass(frozen=True)
class AttentionMetadata:
    """One iteration's attention inputs, shared by all layers (see the module docstring).

    The kernel layout is per token: token ``t`` of sequence ``token_seq[t]`` attends to the first
    ``context_lens[t]`` tokens of that sequence (its position + 1: causal by construction, also
    inside a prompt chunk, because a layer writes the chunk's rows before it attends) through
    ``block_tables[token_seq[t]]``. ``groups`` (the torch path) are empty where a kernel attends.
    """

    slot_mapping: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, W]
    context_lens: torch.Tensor  # [T]: tokens each query attends to
    token_seq: torch.Tensor  # [T]: the row of block_tables each query reads
    groups: tuple[PaddedGroup, ...]
    block_size: int  # tokens per cache block
    # the most splits a decode kernel may cut a query's context into (split-KV for long contexts,
    # :func:`~.attention_kernels.kv_splits`); 1: one pass. A host choice a CUDA graph is captured with.
    kv_splits: int = 1


def build_metadata(work: Sequence[SequenceWork], block_size: int, windows: Iterable[int | None],
                   device: torch.device | str, padded_groups: bool = True,
                   dtype: torch.dtype = torch.float32) -> AttentionMetadata:
    """Metadata of an iteration (each item's ``blocks`` must cover ``position + len(tokens)``);
    ``windows``: the sliding windows the model's layers use (None: full attention);
    ``padded_groups``: also build the torch path's groups (not needed where a kernel attends), with
    their additive masks in ``dtype`` (the queries')."""
    slots: list[int] = []
    positions: list[int] = []
    seqs: list[int] = []
    rows: list[range] = []
    for b, item in enumerate(work):
        new = len(item.tokens)
        rows.append(range(len(slots), len(slots) + new))
        slots.extend(_slots(item.blocks, item.position, new, block_size))
        positions.extend(range(item.position, item.position + new))
        seqs.extend([b] * new)
    width = max((len(item.blocks) for item in work), default=1)
    tables = torch.zeros(len(work), max(width, 1), dtype=torch.int64)
    for b, item in enumerate(work):
        tables[b, : len(item.blocks)] = torch.tensor(item.blocks, dtype=torch.int64)
    groups: tuple[PaddedGroup, ...] = ()
    if padded_groups:
        decode = [b for b, item in enumerate(work) if len(item.tokens) == 1]
        prefill = [b for b, item in enumerate(work) if len(item.tokens) > 1]
        window_set = set(windows)
        groups = tuple(_group(work, rows, members, window_set, block_size, device, dtype)
                       for members in (decode, prefill) if members)
    position = torch.tensor(positions, dtype=torch.int64)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        positions=position.to(device),
        block_tables=tables.to(device),
        context_lens=(position + 1).to(device),
        token_seq=torch.tensor(seqs, dtype=torch.int64).to(device),
        groups=groups,
        block_size=block_size,
    )


def _slots(blocks: Sequence[int], start: int, count: int, size: int) -> list[int]:
    """Cache slots of tokens start .. start+count−1 of a sequence with block table ``blocks``."""
    return [blocks[p // size] * size + p % size for p in range(start, start + count)]


def _group(work: Sequence[SequenceWork], rows: Sequence[range], members: list[int], windows: set[int | None],
           size: int, device: torch.device | str, dtype: torch.dtype) -> PaddedGroup:
    q = max(len(work[b].tokens) for b in members)
    width = max(blocks_for(work[b].position + len(work[b].tokens), size) for b in members)
    k = width * size
    query_index = torch.zeros(len(members), q, dtype=torch.int64)
    query_valid = torch.zeros(len(members), q, dtype=torch.bool)
    context = torch.zeros(len(members), width, dtype=torch.int64)
    query_pos = torch.full((len(members), q), -1, dtype=torch.int64)
    context_len = torch.zeros(len(members), 1, dtype=torch.int64)
    for i, b in enumerate(members):
        item = work[b]
        new, total = len(item.tokens), item.position + len(item.tokens)
        query_index[i, :new] = torch.arange(rows[b].start, rows[b].stop)
        query_valid[i, :new] = True
        query_pos[i, :new] = torch.arange(item.position, total)
        used = blocks_for(total, size)
        context[i, :used] = torch.tensor(item.blocks[:used], dtype=torch.int64)
        context_len[i] = total
    key_pos = torch.arange(k).view(1, 1, k)
    qp = query_pos.unsqueeze(-1)  # [B, Q, 1]
    causal = (key_pos <= qp) & (key_pos < context_len.unsqueeze(-1))
    masks = {}
    for window in windows:
        allowed = causal if window is None else causal & (qp - key_pos < window)
        additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
        masks[window] = additive.unsqueeze(1).to(device)
    return PaddedGroup(query_index.to(device), query_valid.to(device), context.to(device), masks,
                       query_index[query_valid].to(device))


def _gather_context(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache rows of each sequence's blocks: cache [slots, ...] → [B, W·block_size, ...] for
    block tables ``blocks`` [B, W] (whole blocks: one contiguous copy each)."""
    stored = cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache  # FP8: moved as bytes (any device)
    by_block = stored.view(-1, block_size, *cache.shape[1:])
    gathered = by_block.index_select(0, blocks.reshape(-1)).view(cache.dtype)
    return gathered.view(blocks.shape[0], blocks.shape[1] * block_size, *cache.shape[1:])


# ---------------------------------------------------------------------------------------------
# The torch path: padded SDPA per group (CPU, and GPU prefill)
# ---------------------------------------------------------------------------------------------


def gqa_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                  window: int | None) -> torch.Tensor:
    """Queries q [T, nh, d] over a GQA cache [slots, 2, nkv, d] (this iteration's rows already
    written) → [T, nh, d]."""
    out = q.new_zeros(q.shape)
    for group in meta.groups:
        query = q[group.query_index].transpose(1, 2)  # [B, nh, Q, d]
        context = _gather_context(cache, group.context_blocks, meta.block_size).to(q.dtype)  # [B, K, 2, nkv, d]
        key = context[:, :, 0].transpose(1, 2)  # [B, nkv, K, d]
        value = context[:, :, 1].transpose(1, 2)
        result = F.scaled_dot_product_attention(query, key, value, attn_mask=group.masks[window], scale=scale,
                                                enable_gqa=True)  # [B, nh, Q, d]
        out[group.token_rows] = result.transpose(1, 2)[group.query_valid]
    return out


def mla_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float) -> torch.Tensor:
    """Absorbed MLA: queries q_latent [T, nh, C] and q_rope [T, nh, R] over a latent cache
    [slots, C + R] → p·c [T, nh, C] (still in latent space)."""
    latent = q_latent.shape[-1]
    query = torch.cat([q_latent, q_rope], dim=-1)
    out = q_latent.new_zeros(q_latent.shape)
    for group in meta.groups:
        padded = query[group.query_index].transpose(1, 2)  # [B, nh, Q, C+R]
        context = _gather_context(cache, group.context_blocks, meta.block_size).to(query.dtype).unsqueeze(1)  # [B, 1, K, C+R]
        result = F.scaled_dot_product_attention(padded, context, context[..., :latent],
                                                attn_mask=group.masks[None], scale=scale, enable_gqa=True)
        out[group.token_rows] = result.transpose(1, 2)[group.query_valid]
    return out
