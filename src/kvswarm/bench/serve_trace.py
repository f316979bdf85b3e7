"""The Mooncake conversation trace, scaled to a small CPU engine, as token-id requests.

Scaling (every factor is stated in the benchmark's output):

- window: the trace's first ``window_s`` seconds;
- conversations: one in ``conversation_sample``, kept whole (a conversation is the requests that share
  the block after the shared system-prompt block 0, as the trace's hash ids are prefix-chained), so every
  kept conversation's turns and their reuse stay as in the trace while the load thins;
- arrivals: trace times divided by ``time_compression`` (the benchmark derives it from the engine's
  measured prefill rate and the offered load it is asked for: :func:`compression_for_load`);
- blocks: each 512-token block id becomes a fixed chunk of ``block_tokens`` tokens of real text (the
  same id, the same tokens: shared prefixes in the trace are shared prefixes here), at most ``max_blocks``
  per request (the prefix: later blocks are dropped);
- outputs: the trace's output length, at most ``max_output`` tokens (generated to that length).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

TRACE = Path(__file__).resolve().parents[4] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
TRACE_BLOCK = 512  # tokens per hash id in the Mooncake traces


@dataclass(frozen=True)
class Scaling:
    window_s: float
    conversation_sample: int
    time_compression: float
    block_tokens: int
    max_blocks: int
    max_output: int

    def describe(self) -> str:
        return (f"Mooncake conversation trace: first {self.window_s:g} s, 1 in {self.conversation_sample} "
                f"conversations, arrivals compressed x{self.time_compression:g}, each {TRACE_BLOCK}-token block id "
                f"-> {self.block_tokens} tokens of real text (same id, same tokens), at most {self.max_blocks} "
                f"blocks per prompt, outputs capped at {self.max_output} tokens")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Request:
    rid: str
    arrival_s: float  # after the replay's start
    prompt: tuple[int, ...]
    max_tokens: int
    blocks: tuple[int, ...]  # the trace's block ids behind the prompt


def select(records: list[dict], s: Scaling) -> list[dict]:
    """The trace records the scaling keeps, in arrival order."""
    out = []
    for i, r in enumerate(records):
        if r["timestamp"] >= s.window_s * 1000:
            break
        ids = r["hash_ids"]
        conversation = ids[1] if len(ids) > 1 else i  # one-block requests: a conversation each
        if conversation % s.conversation_sample == 0:
            out.append(r)
    return out


def load_records(path: str | Path = TRACE) -> list[dict]:
    import json

    from kvswarm.errors import BadInput

    p = Path(path)
    if not p.exists():
        raise BadInput(f"trace {p} does not exist")
    with p.open() as f:
        return sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r["timestamp"])


def text_pool(tokenizer, tokens: int) -> list[int]:
    """``tokens`` token ids of real text (Python's reference prose), the chunks' source."""
    from kvswarm.corpus import make_document

    return list(make_document(tokenizer, tokens, seed=0, source="pydoc").prompt_ids)


def build_requests(records: list[dict], s: Scaling, pool: list[int]) -> list[Request]:
    """Requests for the kept records; block id ``h`` -> ``pool[h * block_tokens mod ...]`` (fixed)."""
    span = len(pool) - s.block_tokens
    t0 = None
    out = []
    for n, r in enumerate(select(records, s)):
        t0 = r["timestamp"] if t0 is None else t0
        ids = tuple(r["hash_ids"][:s.max_blocks])
        prompt: list[int] = []
        for h in ids:
            at = (h * s.block_tokens) % span
            prompt.extend(pool[at:at + s.block_tokens])
        out.append(Request(f"r{n:04d}", (r["timestamp"] - t0) / 1000 / s.time_compression, tuple(prompt),
                           max(1, min(s.max_output, int(r["output_length"]))), ids))
    return out


def compression_for_load(requests: list[Request], load: float, prefill_tokens_per_s: float) -> float:
    """The arrival compression at which ``requests`` (built at the trace's own pace, compression 1)
    offer their prompt tokens at ``load`` times the engine's prefill rate."""
    span = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
    tokens = sum(len(r.prompt) for r in requests)
    if span <= 0 or tokens == 0:
        return 1.0  # nothing to spread: one arrival time
    return load * prefill_tokens_per_s * span / tokens


def reuse(requests: list[Request]) -> float:
    """Share of block references whose block an earlier request had (what an unbounded cache could hit)."""
    seen: set[int] = set()
    hits = total = 0
    for r in requests:
        for b in r.blocks:
            hits += b in seen
            total += 1
            seen.add(b)
    return hits / total if total else 0.0
