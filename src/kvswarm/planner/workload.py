"""Workloads for the planner: a request trace from a file, or one generated from a few parameters.

A workload is a list of requests, each with an arrival time, input and output lengths
and the prefix-chained ids of its input's token blocks (equal id = reusable KV block).

Trace formats:
- Mooncake JSONL (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``).
- Azure LLM 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``): lengths only, so
  every block is unique (no reuse can be derived; the planner says so).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np


class WorkloadError(ValueError):
    """A trace or workload parameters the planner cannot use."""


@dataclass
class Workload:
    name: str
    block_tokens: int
    t: np.ndarray  # arrival, s from the first request
    input_len: np.ndarray
    output_len: np.ndarray
    blocks: list[np.ndarray]  # per request: prefix-chained block ids
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.t) == 0:
            raise WorkloadError(f"workload {self.name!r} has no requests")
        if self.block_tokens <= 0:
            raise WorkloadError("block_tokens must be positive")
        if (self.input_len < 0).any() or (self.output_len < 0).any():
            raise WorkloadError(f"workload {self.name!r} has negative token counts")
        if not any(len(b) for b in self.blocks):
            raise WorkloadError(f"workload {self.name!r} has no request with a KV block (every input is empty "
                                "or has no hash_ids): there is nothing to cache")

    @property
    def requests(self) -> int:
        return len(self.t)

    @property
    def duration(self) -> float:
        return float(self.t[-1] - self.t[0]) if len(self.t) > 1 else 0.0

    def refs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All block references in order: (block id, request index, position in request)."""
        lens = np.array([len(b) for b in self.blocks])
        ids = np.concatenate(self.blocks) if lens.sum() else np.zeros(0, np.int64)
        req = np.repeat(np.arange(len(self.blocks)), lens)
        pos = np.arange(len(ids)) - np.repeat(np.cumsum(lens) - lens, lens)
        return ids.astype(np.int64), req, pos

    def ideal_hit_rate(self) -> float:
        """Share of block references whose id was seen before (an infinite cache)."""
        ids, _, _ = self.refs()
        if not len(ids):
            return 0.0
        _, first = np.unique(ids, return_index=True)
        return 1.0 - len(first) / len(ids)

    def distinct_blocks(self) -> int:
        return int(len(np.unique(self.refs()[0])))

    def stats(self) -> dict:
        ids, _, _ = self.refs()
        return {"name": self.name, "requests": self.requests, "duration_s": self.duration,
                "rate_rps": self.requests / self.duration if self.duration else float("nan"),
                "block_tokens": self.block_tokens, "block_refs": int(len(ids)),
                "distinct_blocks": self.distinct_blocks(), "ideal_hit_rate": self.ideal_hit_rate(),
                "input_tokens_mean": float(self.input_len.mean()), "output_tokens_mean": float(self.output_len.mean())}

    def share(self, k: int, every: int) -> Workload:
        """Requests ``k``, ``k + every``, ``k + 2 every``, ...: what node ``k`` of ``every`` nodes serves when
        requests are spread round-robin over them."""
        if not 0 <= k < every:
            raise WorkloadError(f"node {k} of {every} does not exist")
        if every == 1:
            return self
        return Workload(f"{self.name} [{k}/{every}]", self.block_tokens, self.t[k::every], self.input_len[k::every],
                        self.output_len[k::every], self.blocks[k::every], list(self.notes))

    def scaled(self, copies: int) -> Workload:
        """``copies`` independent tenants replaying this trace at once (disjoint block ids)."""
        if copies < 1:
            raise WorkloadError("workload scale must be >= 1")
        if copies == 1:
            return self
        span = int(max(int(b.max()) for b in self.blocks if len(b)) + 1)
        order = np.argsort(np.tile(self.t, copies), kind="stable")
        blocks = [b + c * span for c in range(copies) for b in self.blocks]
        return Workload(f"{self.name} x{copies}", self.block_tokens, np.tile(self.t, copies)[order],
                        np.tile(self.input_len, copies)[order], np.tile(self.output_len, copies)[order],
                        [blocks[i] for i in order], self.notes + [f"{copies} tenants replay the trace at once"])


def load_trace(path: str | Path, block_tokens: int = 512, limit: int | None = None) -> Workload:
    """Read a Mooncake JSONL or Azure CSV trace."""
    p = Path(path)
    if not p.exists():
        raise WorkloadError(f"trace file {p} does not exist")
    if p.stat().st_size == 0:
        raise WorkloadError(f"trace file {p} is empty")
    if p.suffix == ".csv":
        return _load_azure(p, block_tokens, limit)
    return _load_jsonl(p, block_tokens, limit)


def _load_jsonl(p: Path, block_tokens: int, limit: int | None) -> Workload:
    t, inp, out, blocks = [], [], [], []
    with p.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                ts, il, ol, ids = float(r["timestamp"]), int(r["input_length"]), int(r["output_length"]), \
                    r["hash_ids"]
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise WorkloadError(f"{p}:{n}: not a Mooncake trace record "
                                    f"(need timestamp, input_length, output_length, hash_ids): {e}") from None
            if il < 0 or ol < 0:
                raise WorkloadError(f"{p}:{n}: negative token count")
            t.append(ts / 1000.0)
            inp.append(il)
            out.append(ol)
            blocks.append(np.asarray(ids, dtype=np.int64))
            if limit and len(t) >= limit:
                break
    if not t:
        raise WorkloadError(f"trace file {p} holds no requests")
    ta = np.asarray(t)
    return Workload(p.stem, block_tokens, ta - ta.min(), np.asarray(inp), np.asarray(out), blocks)


def _load_azure(p: Path, block_tokens: int, limit: int | None) -> Workload:
    t, inp, out = [], [], []
    with p.open(newline="") as f:
        for n, row in enumerate(csv.DictReader(f), 2):
            try:
                t.append(datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp())
                inp.append(int(row["ContextTokens"]))
                out.append(int(row["GeneratedTokens"]))
            except (KeyError, TypeError, ValueError) as e:
                raise WorkloadError(f"{p}:{n}: not an Azure trace row "
                                    f"(need TIMESTAMP, ContextTokens, GeneratedTokens): {e}") from None
            if limit and len(t) >= limit:
                break
    if not t:
        raise WorkloadError(f"trace file {p} holds no requests")
    ta = np.asarray(t)
    inp_a = np.asarray(inp)
    nblk = -(-inp_a // block_tokens)
    starts = np.concatenate([[0], np.cumsum(nblk)[:-1]])
    blocks = [np.arange(s, s + k, dtype=np.int64) for s, k in zip(starts, nblk)]
    return Workload(p.stem, block_tokens, ta - ta.min(), inp_a, np.asarray(out), blocks,
                    ["trace has no prefix hashes: every block is unique, no reuse is possible"])


def synthesize(users: int, context: int, turns: int, reuse: float, session_s: float, duration_s: float,
               turn_tokens: int | None = None, output_tokens: int = 300, block_tokens: int = 512,
               seed: int = 0) -> Workload:
    """Multi-turn chat sessions, ``users`` of them active at any time.

    Each session's first request has ``context`` input tokens, of which the first
    ``reuse`` share is a prefix common to all sessions (system prompt, shared documents);
    each later turn resends the whole conversation so far plus ``turn_tokens`` new ones.
    A session's ``turns`` requests are spread evenly over ``session_s`` seconds.
    """
    if users <= 0 or context <= 0 or turns <= 0 or session_s <= 0 or duration_s <= 0 or output_tokens < 0:
        raise WorkloadError("users, context, turns, session length and duration must be positive")
    if not 0 <= reuse <= 1:
        raise WorkloadError(f"reuse must be a share between 0 and 1, got {reuse}")
    rng = np.random.default_rng(seed)
    turn_tokens = turn_tokens if turn_tokens is not None else max(1, context // 4)
    if turn_tokens <= 0:
        raise WorkloadError("turn_tokens must be positive")
    shared_blocks = int(reuse * context) // block_tokens
    gap = session_s / turns
    next_id = shared_blocks
    reqs: list[tuple[float, int, int, np.ndarray]] = []
    for _ in range(users):
        start = -rng.uniform(0, session_s)  # sessions already in progress at t=0
        while start < duration_s:
            own: list[int] = []
            length = context
            for k in range(turns):
                at = start + k * gap + rng.uniform(0, gap * 0.1)
                nblk = -(-length // block_tokens)
                while shared_blocks + len(own) < nblk:
                    own.append(next_id)
                    next_id += 1
                if 0 <= at < duration_s:
                    ids = np.concatenate([np.arange(shared_blocks), own])[:nblk].astype(np.int64)
                    reqs.append((at, length, output_tokens, ids))
                length += output_tokens + turn_tokens
            start += session_s
    if not reqs:
        raise WorkloadError("the workload parameters produce no request within the duration")
    reqs.sort(key=lambda r: r[0])
    return Workload(f"synthetic ({users} users, {context} tok, {turns} turns, reuse {reuse:g})", block_tokens,
                    np.array([r[0] for r in reqs]), np.array([r[1] for r in reqs]),
                    np.array([r[2] for r in reqs]), [r[3] for r in reqs])
