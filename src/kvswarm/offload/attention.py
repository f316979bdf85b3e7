"""The attention hook that lets an offloaded cache choose what a decode step attends to.

transformers' attention layers call a function looked up by name in ``AttentionInterface``.
kvswarm registers ``"kvswarm"``: when the forward call carries ``kvswarm=<OffloadedKVCache>``
the cache gets the query and returns the keys/values attention must read (sinks + selected
offloaded entries + window, fetched from the drives); everything else, prefill included, goes
to transformers' own sdpa function unchanged, so outputs stay bit-identical to plain sdpa.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvswarm.model import UnsupportedModel

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTN_NAME = "kvswarm"
_registered = False


def kvswarm_attention_forward(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cache = kwargs.pop("kvswarm", None)
    if cache is not None:
        key, value, attention_mask = cache.attend(module.layer_idx, query, key, value, attention_mask,
                                                  kwargs.get("scaling"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(ATTN_NAME, kvswarm_attention_forward)
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
        _registered = True


def check_supported(model: PreTrainedModel) -> None:
    """Refuse models whose attention kvswarm cannot intercept (clear error, not wrong output)."""
    impl = model.config._attn_implementation
    if impl not in ("sdpa", ATTN_NAME):
        raise UnsupportedModel(f"{type(model).__name__} runs {impl!r} attention; kvswarm decodes through sdpa "
                               "(load the model with attn_implementation='sdpa')")
    if not model._can_set_attn_implementation():
        raise UnsupportedModel(f"{type(model).__name__} does not dispatch attention through transformers' "
                               "AttentionInterface, so its KV reads cannot be redirected")


@contextmanager
def kvswarm_attention(model: PreTrainedModel) -> Iterator[None]:
    """Route ``model``'s attention through kvswarm's hook for the duration of the block."""
    check_supported(model)
    register()
    before = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
