"""Decode captures: what a real model's decode steps asked of its KV, recorded once per text.

A capture holds a prompt's prefill KV and, for each decode step, every layer's post-RoPE
query and the new token's K/V, plus the tokens fed and the dense model's argmax.  From it,
any selector can be replayed offline against the *real* queries (its selection, the exact
attention mass that selection captures), activation traces follow (exact top-k of the dense
attention), and the prompt KV is what gets written to the drives.  Recording costs a
prefill and ``steps`` decode steps; captures are cached under ``~/.cache/kvswarm/swarm``
(``KVSWARM_CACHE``) keyed by model, text and sizes.

File (``.npz``, ``allow_pickle=False``): ``meta`` (UTF-8 JSON), ``tokens`` int64 [T],
``k``/``v`` float32 [L, kvh, T, d] (prompt), ``q`` float32 [S, L, qh, d], ``dk``/``dv``
float32 [L, kvh, S, d] (decoded tokens), ``fed`` / ``pred`` int64 [S].
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvswarm.sparse.base import attention_mass, gqa_logits, head_lse

CAPTURE_VERSION = 1
ATTN_NAME = "kvswarm_capture"


@dataclass
class DecodeCapture:
    meta: dict
    tokens: np.ndarray
    k: np.ndarray  # [L, kvh, T, d] prompt keys (post-RoPE)
    v: np.ndarray
    q: np.ndarray  # [S, L, qh, d] decode queries (post-RoPE)
    dk: np.ndarray  # [L, kvh, S, d] decoded tokens' keys
    dv: np.ndarray
    fed: np.ndarray  # [S] token fed at each step
    pred: np.ndarray  # [S] dense argmax after each step

    @property
    def layers(self) -> int:
        return self.k.shape[0]

    @property
    def steps(self) -> int:
        return self.q.shape[0]

    @property
    def prompt_len(self) -> int:
        return self.k.shape[2]

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.k.shape[3])

    def offloaded(self, sinks: int, window: int) -> np.ndarray:
        return np.arange(sinks, self.prompt_len - window, dtype=np.int64)

    def resident_keys(self, layer: int, step: int, sinks: int, window: int) -> torch.Tensor:
        """Keys [kvh, r, d] attention always reads at ``step``: sinks, the prompt window and
        the decoded tokens up to and including this step's."""
        k = self.k[layer]
        return torch.from_numpy(np.concatenate(
            [k[:, :sinks], k[:, self.prompt_len - window:], self.dk[layer, :, :step + 1]], axis=1))

    def query(self, layer: int, step: int) -> torch.Tensor:
        return torch.from_numpy(self.q[step, layer])

    def dense_mass(self, layer: int, step: int, sinks: int, window: int) -> tuple[np.ndarray, float]:
        """Exact attention mass (summed over query heads) of each offloaded entry, and the
        total mass of the offloaded part (the rest sits on resident entries)."""
        off = self.offloaded(sinks, window)
        q = self.query(layer, step)
        lo = gqa_logits(q, torch.from_numpy(self.k[layer][:, off[0]:off[-1] + 1]), self.scale)
        lr = gqa_logits(q, self.resident_keys(layer, step, sinks, window), self.scale)
        m = attention_mass(lo, head_lse(lo, lr)).numpy()
        return m, float(m.sum())

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, meta=np.frombuffer(json.dumps(self.meta).encode(), np.uint8), tokens=self.tokens,
                 k=self.k, v=self.v, q=self.q, dk=self.dk, dv=self.dv, fed=self.fed, pred=self.pred)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> DecodeCapture:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta.get("version") != CAPTURE_VERSION:
                raise ValueError(f"{path}: capture version {meta.get('version')}, need {CAPTURE_VERSION}")
            return cls(meta, z["tokens"], z["k"], z["v"], z["q"], z["dk"], z["dv"], z["fed"], z["pred"])


class _Recorder:
    """Attention function that records single-token steps, then runs transformers' sdpa."""

    def __init__(self) -> None:
        self.q: dict[int, torch.Tensor] = {}
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if query.shape[2] == 1:
            i = module.layer_idx
            self.q[i] = query[0, :, 0].float().clone()
            self.kv[i] = (key[0, :, -1].float().clone(), value[0, :, -1].float().clone())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@torch.inference_mode()
def record(model, token_ids: list[int], steps: int, *, temperature: float = 0.7, seed: int = 0,
           meta: dict | None = None, on_step: Callable[[int], None] | None = None) -> DecodeCapture:
    """Prefill ``token_ids`` and decode ``steps`` tokens (sampled at ``temperature``), recording
    every layer's query and new K/V per step."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    rec = _Recorder()
    AttentionInterface.register(ATTN_NAME, rec)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    before = model.config._attn_implementation
    t0 = time.perf_counter()
    out = model(torch.tensor([token_ids]), use_cache=True, logits_to_keep=1)
    prefill_s = time.perf_counter() - t0
    cache = out.cache
    k = np.stack([lay.keys[0].float().numpy() for lay in cache.layers])
    v = np.stack([lay.values[0].float().numpy() for lay in cache.layers])
    logits = out.logits[0, -1].float()
    gen = torch.Generator().manual_seed(seed)
    qs, dks, dvs, fed, pred, step_s = [], [], [], [], [], []
    model.set_attn_implementation(ATTN_NAME)
    try:
        for s in range(steps):
            tok = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)) \
                if temperature > 0 else int(torch.argmax(logits))
            t1 = time.perf_counter()
            out = model(torch.tensor([[tok]]), cache=cache, use_cache=True)
            step_s.append(time.perf_counter() - t1)
            logits = out.logits[0, -1].float()
            layers = sorted(rec.q)
            qs.append(torch.stack([rec.q[i] for i in layers]).numpy())
            dks.append(torch.stack([rec.kv[i][0] for i in layers]).numpy())
            dvs.append(torch.stack([rec.kv[i][1] for i in layers]).numpy())
            fed.append(tok)
            pred.append(int(torch.argmax(logits)))
            rec.q.clear()
            rec.kv.clear()
            if on_step is not None:
                on_step(s)
    finally:
        model.set_attn_implementation(before)
    m = dict(meta or {})
    m.update(version=CAPTURE_VERSION, prompt_len=len(token_ids), steps=steps, temperature=temperature, seed=seed,
             prefill_s=prefill_s, decode_step_s=float(np.median(step_s)) if step_s else 0.0)
    return DecodeCapture(m, np.asarray(token_ids, np.int64), k, v, np.stack(qs),
                         np.stack(dks, axis=2), np.stack(dvs, axis=2), np.asarray(fed, np.int64),
                         np.asarray(pred, np.int64))


@dataclass(frozen=True)
class TextSpec:
    """A real text of the corpus: source, seed, prompt length (chat-framed, like a user's request)."""

    source: str
    seed: int
    tokens: int

    @property
    def label(self) -> str:
        if self.source.startswith("file:"):
            return f"{Path(self.source.removeprefix('file:')).name}@{self.tokens}"
        return f"{self.source}#{self.seed}@{self.tokens}"

    @property
    def key(self) -> str:
        """File-name-safe identity of the text: a text file by its content's hash."""
        if self.source.startswith("file:"):
            import xxhash

            from kvswarm.corpus import file_text

            return f"file-{xxhash.xxh3_64_hexdigest(file_text(Path(self.source.removeprefix('file:'))).encode())}"
        return f"{self.source}-{self.seed}"


def capture_dir() -> Path:
    from kvswarm.model import cache_root

    d = cache_root() / "swarm"
    d.mkdir(parents=True, exist_ok=True)
    return d


def cached_capture(text: TextSpec, steps: int, lm_loader: Callable[[], object], *, seed: int = 0,
                   log: Callable[[str], None] = lambda s: None) -> DecodeCapture:
    """The capture of ``text`` (recorded once, then loaded from the cache)."""
    from kvswarm.corpus import make_document
    from kvswarm.model import DEFAULT_MODEL_ID

    path = capture_dir() / f"{DEFAULT_MODEL_ID}-{text.key}-{text.tokens}-{steps}-{seed}.npz"
    if path.exists():
        try:
            cap = DecodeCapture.load(path)
            cap.meta["cache_key"] = path.stem
            return cap
        except (ValueError, OSError, KeyError) as e:
            log(f"re-recording {path.name}: {e}")
    lm = lm_loader()
    doc = make_document(lm.tokenizer, text.tokens, seed=text.seed, source=text.source, chat=True)
    log(f"recording {text.label}: prefill {text.tokens} tokens + {steps} decode steps (one time)")
    cap = record(lm.model, list(doc.prompt_ids), steps, seed=seed,
                 meta={"model_id": lm.model_id, "layout": lm.layout.fingerprint().hex(), "source": text.source,
                       "text_seed": text.seed, "titles": list(doc.titles[:8])})
    cap.save(path)
    cap.meta["cache_key"] = path.stem
    return cap
