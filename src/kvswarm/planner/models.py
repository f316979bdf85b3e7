"""Model presets: KV layout and prefill cost of public models (from their published configs)."""

from __future__ import annotations

from dataclasses import dataclass

from kvswarm.layout import KVLayout


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs of a model: KV bytes per token and prefill FLOPs."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_q_heads: int
    params_b: float  # parameters, billions (dense)
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_kv_heads", "head_dim", "num_q_heads"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model {self.name!r}: {f} must be positive, got {getattr(self, f)}")
        if self.params_b <= 0:
            raise ValueError(f"model {self.name!r}: params_b must be positive, got {self.params_b}")

    def layout(self, tokens_per_block: int = 16) -> KVLayout:
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, tokens_per_block, self.name)

    @property
    def token_bytes(self) -> int:
        return self.layout().token_bytes

    def prefill_flops(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        """FLOPs to prefill ``new_tokens`` after ``cached_tokens`` already in the KV cache.

        2 x params per token for the weights, plus attention scores and values:
        4 x layers x q_dim per (query, key) pair, causal over the new tokens.
        """
        q_dim = self.num_q_heads * self.head_dim
        pairs = new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2
        return 2 * self.params_b * 1e9 * new_tokens + 4 * self.num_layers * q_dim * pairs


# Published configs (config.json on each model's Hugging Face page / technical report).
PRESETS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("Llama-3.1-405B", 126, 8, 128, 128, 405.0),
    ModelSpec("Llama-3.1-70B", 80, 8, 128, 64, 70.6),
    ModelSpec("Llama-3.1-8B", 32, 8, 128, 32, 8.03),
    ModelSpec("Llama-3-8B", 32, 8, 128, 32, 8.03),
    ModelSpec("Qwen3-32B", 64, 8, 128, 64, 32.8),
    ModelSpec("Qwen3-8B", 36, 8, 128, 32, 8.19),
    ModelSpec("Mistral-7B", 32, 8, 128, 32, 7.24),
    ModelSpec("SmolLM2-135M", 30, 3, 64, 9, 0.135),
)}


def resolve_model(name: str | None, *, layers: int | None = None, kv_heads: int | None = None,
                  head_dim: int | None = None, q_heads: int | None = None, params_b: float | None = None,
                  dtype: str | None = None) -> ModelSpec:
    """A preset by name (case-insensitive), with any field overridden; or a custom model from fields."""
    base = None
    if name:
        match = {k.lower(): v for k, v in PRESETS.items()}.get(name.lower())
        if match is None:
            raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)} "
                             "(or give --layers/--kv-heads/--head-dim/--q-heads/--params-b)")
        base = match
    fields = {"num_layers": layers, "num_kv_heads": kv_heads, "head_dim": head_dim, "num_q_heads": q_heads,
              "params_b": params_b, "dtype": dtype}
    if base is None:
        missing = [k for k, v in fields.items() if v is None and k != "dtype"]
        if missing:
            raise ValueError(f"no model preset given and custom model is missing {', '.join(missing)}")
        return ModelSpec("custom", **{k: v for k, v in fields.items() if v is not None})
    changes = {k: v for k, v in fields.items() if v is not None}
    if not changes:
        return base
    spec = ModelSpec(base.name + "*", **({f: getattr(base, f) for f in fields} | changes))
    spec.layout()  # validates dtype
    return spec
