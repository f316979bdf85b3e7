"""Prefix reuse for a transformers causal LM: a prompt's cached KV comes back from kvswarm.

:class:`PrefixCache` keys a prompt's full token blocks (:class:`~kvswarm.prefix.PrefixKeyer`),
starts reading the cached prefix from the tiers as soon as the prompt is known, rebuilds
a ``DynamicCache`` from the blocks, and prefills only the rest.  After generation it
stores every new full block of prompt + reply, so the next turn of a chat - whose
prompt starts with this turn's - recomputes only what is new.  :class:`ChatSession` is
that multi-turn chat.

Block KV layout (after the 64-byte block header): per layer, K then V, each
``[kv_heads, tokens_per_block, head_dim]`` in the model's dtype.  The block header names
the key, the model/layout/tenant namespace and the KV size, so KV of another model,
layout or tenant is never served.

Exactness: restored KV is bit-identical to the KV that was stored, and a forward pass
over the rest of the prompt with it is bit-identical to the same pass with the original
in-memory cache.  Against a *from-scratch* prefill of the whole prompt the logits are
bit-identical with one torch thread and differ by float rounding with more (~4e-5 with
two: the prefix is then computed by larger matmuls, blocked differently); greedy tokens
agree.  tests/test_prefix_transformers.py checks both (tolerance 1e-3).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvswarm.errors import LayoutMismatch
from kvswarm.layout import KVLayout
from kvswarm.prefix import HEADER_BYTES, PrefixKeyer, matches, new_block
from kvswarm.tiers.manager import Prefetch, PrefixHit, TierManager
from kvswarm.tiers.prefetch import PrefetchPolicy

if TYPE_CHECKING:
    import torch
    from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase


def _torch_dtype(layout: KVLayout):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[layout.dtype]


@dataclass
class Generation:
    tokens: list[int]  # generated token ids (greedy)
    prompt_tokens: int
    reused_tokens: int  # prompt tokens whose KV came from kvswarm
    ttft_s: float  # from the call (or ``arrival``) to the first token's logits, the sum of:
    load_s: float  # waiting for the cached prefix's reads (lookup included)
    restore_s: float  # rebuilding the DynamicCache from the blocks
    prefill_s: float  # the forward pass over the rest of the prompt
    first_logits: torch.Tensor
    hit_tiers: list  # the tier each reused block was served from


class PrefixCache:
    """Store and restore a model's prompt KV, block by block, in a :class:`TierManager`."""

    def __init__(self, model: PreTrainedModel, layout: KVLayout, tiers: TierManager,
                 tenant: str | bytes | None = None) -> None:
        cfg = model.config
        want = (cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads))
        if (layout.num_layers, layout.num_kv_heads) != want or _torch_dtype(layout) != model.dtype:
            raise LayoutMismatch(f"layout {layout} does not describe this model ({want}, {model.dtype})")
        if tiers.config.block_bytes != HEADER_BYTES + layout.block_bytes:
            raise LayoutMismatch(f"tiers hold {tiers.config.block_bytes} B blocks; this layout needs "
                                 f"{HEADER_BYTES + layout.block_bytes}")
        self.model, self.layout, self.tiers = model, layout, tiers
        self.keyer = PrefixKeyer(layout, tenant)
        self.block_tokens = layout.tokens_per_block

    # ---- blocks <-> KV ---------------------------------------------------------------------
    def reusable_keys(self, token_ids: Sequence[int]) -> list[bytes]:
        """Keys of the blocks a prompt may reuse: full blocks, leaving at least one token to compute."""
        return self.keyer.block_keys(token_ids, max_blocks=(len(token_ids) - 1) // self.block_tokens)

    def prefetch(self, token_ids: Sequence[int], arrival: float | None = None,
                 policy: PrefetchPolicy | None = None) -> Prefetch:
        """Start reading the prompt's cached prefix now (call as soon as the prompt is known)."""
        return self.tiers.prefetch(self.reusable_keys(token_ids), arrival, policy)

    def restore(self, hit: PrefixHit) -> tuple[DynamicCache | None, int]:
        """A DynamicCache holding the hit's blocks, and the number of tokens it covers."""
        import torch
        from transformers import DynamicCache

        lay, B = self.layout, self.block_tokens
        n = 0
        for v in hit.views:  # the tiers checked key and size; check namespace and layout too
            if not matches(v, hit.keys[n], self.keyer.namespace, lay.block_bytes):
                break
            n += 1
        if n == 0:
            return None, 0
        dt = _torch_dtype(lay)
        shape = (lay.num_layers, 2, lay.num_kv_heads, B, lay.head_dim)
        # [layers, K/V, batch, heads, tokens, head_dim]: each layer's K and V is contiguous
        kv = torch.empty((lay.num_layers, 2, 1, lay.num_kv_heads, n * B, lay.head_dim), dtype=dt)
        for i, v in enumerate(hit.views[:n]):
            kv[:, :, 0, :, i * B:(i + 1) * B] = torch.frombuffer(v, dtype=dt, offset=HEADER_BYTES).view(shape)
        cache = DynamicCache(config=self.model.config)
        for layer, dl in enumerate(cache.layers):
            # Hand the tensors over as the layer's state (``update`` would copy them once more).
            dl.lazy_initialization(kv[layer, 0], kv[layer, 1])
            dl.keys, dl.values = kv[layer, 0], kv[layer, 1]
        return cache, n * B

    def save(self, token_ids: Sequence[int], cache: DynamicCache, skip_blocks: int = 0) -> int:
        """Store the full blocks of ``token_ids`` that ``cache`` covers, from block ``skip_blocks`` on."""
        import torch

        lay, B = self.layout, self.block_tokens
        n = min(len(token_ids), cache.get_seq_length()) // B
        if n <= skip_blocks:
            return 0
        keys = self.keyer.block_keys(token_ids, max_blocks=n)
        # [layers, 2, heads, tokens, head_dim] for the new blocks only
        kv = torch.stack([torch.stack([layer.keys[0, :, skip_blocks * B:n * B],
                                       layer.values[0, :, skip_blocks * B:n * B]]) for layer in cache.layers])
        payloads = []
        for i in range(skip_blocks, n):
            buf, body = new_block(keys[i], self.keyer.namespace, B, i, lay.block_bytes)
            blk = kv[:, :, :, (i - skip_blocks) * B:(i - skip_blocks + 1) * B].contiguous()
            body[:] = memoryview(blk.view(torch.uint8).numpy()).cast("B")
            payloads.append(buf)
        self.tiers.insert(keys[skip_blocks:n], payloads)
        return n - skip_blocks

    # ---- inference -------------------------------------------------------------------------
    def generate(self, token_ids: Sequence[int], max_new_tokens: int = 32, eos_token_id: int | None = None,
                 store: bool = True, prefetched: Prefetch | None = None, arrival: float | None = None,
                 policy: PrefetchPolicy | None = None) -> Generation:
        """Greedy generation reusing the prompt's cached prefix; stores the new blocks afterwards.

        Pass ``prefetched`` (and its ``arrival``) when the prefetch was started earlier.
        """
        import torch

        t0 = time.perf_counter() if arrival is None else arrival
        pf = prefetched or self.prefetch(token_ids, t0, policy)
        hit = pf.result()
        t1 = time.perf_counter()
        with torch.inference_mode():
            try:
                cache, reused = self.restore(hit)
                t2 = time.perf_counter()
                ids = torch.tensor([list(token_ids[reused:])], dtype=torch.long)
                out = self.model(input_ids=ids, cache=cache, use_cache=True)
            except BaseException:  # the request failed: its DRAM pins and read buffers go back all the same
                hit.release(promote=False)
                raise
            logits = out.logits[0, -1].clone()
            t3 = time.perf_counter()
            tiers = list(hit.tiers[:reused // self.block_tokens])
            hit.release()  # promotion to DRAM happens after the first token, off its critical path
            cache = out.cache
            tokens = [int(logits.argmax())]
            while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
                out = self.model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
                cache = out.cache
                tokens.append(int(out.logits[0, -1].argmax()))
        if store:
            self.save(list(token_ids) + tokens, cache, skip_blocks=reused // self.block_tokens)
        return Generation(tokens, len(token_ids), reused, t3 - t0, t1 - t0, t2 - t1, t3 - t2, logits, tiers)


class ChatSession:
    """A multi-turn chat whose every turn reuses the KV of the turns before it."""

    def __init__(self, prefix_cache: PrefixCache, tokenizer: PreTrainedTokenizerBase,
                 system: str | None = None) -> None:
        self.pc, self.tokenizer = prefix_cache, tokenizer
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.turns: list[Generation] = []

    def prompt_ids(self) -> list[int]:
        enc = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)

    def say(self, text: str, max_new_tokens: int = 32) -> str:
        self.messages.append({"role": "user", "content": text})
        g = self.pc.generate(self.prompt_ids(), max_new_tokens, self.tokenizer.eos_token_id)
        self.turns.append(g)
        reply = self.tokenizer.decode(g.tokens, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": reply})
        return reply
