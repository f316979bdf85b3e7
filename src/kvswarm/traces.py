"""Record activation traces of the real model decoding real texts (``python -m kvswarm.traces``).

For each document (chat-wrapped text from the corpus) the model decodes ``steps`` tokens
densely (sampled at ``temperature``; the KV lives in memory, no drives needed) while a
``TraceRecorder`` with the exact oracle stores, per step and layer, the top-``sparsity``
offloaded entries by exact attention mass: the ground-truth activations that co-activation
layouts are fit on and scored against.  Files follow sparse/trace.py's format.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvswarm.model import LoadedModel

log = logging.getLogger(__name__)


def record_trace(lm: LoadedModel, doc, steps: int, *, sparsity: float = 0.1, sinks: int = 4, window: int = 64,
                 temperature: float = 0.7, seed: int = 0):
    """Dense decode of ``doc`` with exact top-k activations recorded; returns the ActivationTrace."""
    from kvswarm.offload import MemorySequence, OffloadedKVCache, decode, prefill
    from kvswarm.sparse import TraceRecorder, budget_for, make_selector

    pf = prefill(lm.model, doc.prompt_ids)
    seq = MemorySequence(pf.kv(), doc.prompt_ids, lm.layout, sinks, window)
    oracle = make_selector("oracle")
    for layer in range(lm.layout.num_layers):
        oracle.build(layer, seq.offloaded_keys(layer), seq.geometry.offloaded)
    budget = budget_for(sparsity, len(seq.geometry.offloaded))
    g = seq.geometry
    meta = {"model_id": lm.model_id, "fingerprint": lm.layout.fingerprint().hex(), "kv_dtype": lm.layout.dtype,
            "selection": "exact-topk-dense", "sparsity": sparsity, "budget": budget,
            "prompt_tokens": g.prompt_len, "sinks": sinks, "window": window, "off_start": g.off_start,
            "off_end": g.off_end, "source": doc.source, "titles": list(doc.titles), "chat": doc.chat,
            "temperature": temperature, "seed": seed, "steps": steps,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    rec = TraceRecorder(lm.layout.num_layers, meta, oracle=oracle, budget=budget)
    cache = OffloadedKVCache(seq, "dense", observers=[rec])
    out = decode(lm.model, cache, pf.logits, steps, temperature=temperature, seed=seed)
    rec.meta["generated_ids"] = out.fed
    return rec.trace()


def record_traces(out_dir: str | Path, *, tokens: int = 4096, steps: int = 128, count: int = 3,
                  sources: Sequence[str] | None = None, sparsity: float = 0.1, sinks: int = 4, window: int = 64,
                  temperature: float = 0.7, seed: int = 0, lm: LoadedModel | None = None) -> list[Path]:
    """One trace file per document (cycling over the corpus sources, which may include
    ``file:PATH`` sources: any UTF-8 text file), written to ``out_dir``."""
    from kvswarm import corpus
    from kvswarm.model import load_default_model

    lm = lm or load_default_model()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, doc in enumerate(corpus.documents(lm.tokenizer, tokens, count, seed, sources, chat=True)):
        t0 = time.perf_counter()
        trace = record_trace(lm, doc, steps, sparsity=sparsity, sinks=sinks, window=window,
                             temperature=temperature, seed=seed + i)
        name = Path(doc.source.removeprefix("file:")).stem if doc.source.startswith("file:") else doc.source
        path = out / f"trace-{name}-{tokens}t-{steps}s-seed{seed + i}.npz"
        trace.save(path)
        log.info("%s: %s in %.1f s", path, doc.titles[:3], time.perf_counter() - t0)
        paths.append(path)
    return paths


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir", nargs="?", default="results/traces")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--count", type=int, default=3, help="documents (cycling over the sources)")
    p.add_argument("--sources", default=None, help="comma-separated: pydoc,man,licenses (default: all present)")
    p.add_argument("--text-file", action="append", default=None,
                   help="a UTF-8 text file to trace instead of the corpus (repeatable)")
    p.add_argument("--sparsity", type=float, default=0.1, help="top share of offloaded entries recorded")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)


def run(a: argparse.Namespace) -> int:
    from kvswarm.corpus import file_source

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sources = a.sources.split(",") if a.sources else None
    count = a.count
    if a.text_file:
        sources = [file_source(f) for f in a.text_file]
        count = len(sources)
    paths = record_traces(a.out_dir, tokens=a.tokens, steps=a.steps, count=count, sources=sources,
                          sparsity=a.sparsity, sinks=a.sinks,
                          window=a.window, temperature=a.temperature, seed=a.seed)
    for path in paths:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvswarm.traces", description=__doc__.strip().splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
