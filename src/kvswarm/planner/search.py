"""Recommendation search: screen every mix, simulate the finalists, rank, explain, Pareto front."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvswarm.planner.cost import Mix
from kvswarm.planner.project import Planner, Projection

TIE = 0.005  # costs within 0.5% count as equal; then lower TTFT p90 wins


@dataclass
class SearchResult:
    screened: list[Projection]
    finalists: list[Projection]  # simulated, best first
    front: list[Projection]  # Pareto front (cost per Mtok vs mean TTFT) of the screened mixes
    recommended: Projection | None
    runners_up: list[tuple[Projection, str]] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)  # why screened mixes were dropped, counts


def pareto_front(projs: Sequence[Projection]) -> list[Projection]:
    """Mixes no other mix beats on both cost per million tokens and mean TTFT."""
    front: list[Projection] = []
    best_ttft = float("inf")
    for p in sorted(projs, key=lambda p: (p.cost_per_mtok_usd, p.ttft_mean_s)):
        if p.ttft_mean_s < best_ttft:
            front.append(p)
            best_ttft = p.ttft_mean_s
    return front


def _rank(projs: Sequence[Projection]) -> list[Projection]:
    """Best first: mixes within TIE of the lowest cost per Mtok by TTFT p90, then the rest by cost."""
    if not projs:
        return []
    best = min(p.cost_per_mtok_usd for p in projs)
    tied = [p for p in projs if p.cost_per_mtok_usd <= best * (1 + TIE)]
    rest = [p for p in projs if p.cost_per_mtok_usd > best * (1 + TIE)]
    return sorted(tied, key=lambda p: (p.ttft_p90_s, p.cost_per_mtok_usd)) + \
        sorted(rest, key=lambda p: (p.cost_per_mtok_usd, p.ttft_p90_s))


def _fails(p: Projection, budget: float | None, ttft_target: float | None) -> str | None:
    if p.saturated:
        return f"saturates {', '.join(p.saturated)}"
    if budget is not None and p.storage_capex_usd > budget:
        return f"KV tier costs ${p.storage_capex_usd:,.0f}, over the ${budget:,.0f} budget"
    if ttft_target is not None and p.ttft_p90_s > ttft_target:
        return f"TTFT p90 {p.ttft_p90_s:.2f} s misses the {ttft_target:g} s target"
    return None


def _why_lost(p: Projection, win: Projection) -> str:
    reasons = []
    dc = p.cost_per_mtok_usd / win.cost_per_mtok_usd - 1
    if abs(dc) >= 5e-5:  # mixes above the cheapest + TIE lose on cost even when the gap to the winner is small
        reasons.append(f"{dc:+.2%} cost per Mtok")
    if p.gpus != win.gpus:
        reasons.append(f"needs {p.gpus} GPUs vs {win.gpus}")
    dt = p.ttft_p90_s - win.ttft_p90_s
    if abs(dt) >= 0.005:
        reasons.append(f"TTFT p90 {p.ttft_p90_s:.2f} s vs {win.ttft_p90_s:.2f} s")
    ds = p.storage_capex_usd - win.storage_capex_usd
    if abs(ds) >= 1:
        reasons.append(f"KV tier ${abs(ds):,.0f} {'dearer' if ds > 0 else 'cheaper'}")
    dh = (1 - p.hit_rates["miss"]) - (1 - win.hit_rates["miss"])
    if abs(dh) >= 0.001:
        reasons.append(f"hit rate {1 - p.hit_rates['miss']:.1%} vs {1 - win.hit_rates['miss']:.1%}")
    return "; ".join(reasons) or "equal on every figure (tie broken by order)"


def search(planner: Planner, mixes: Sequence[Mix], budget: float | None = None, ttft_target: float | None = None,
           finalists: int = 4, sim_requests: int | None = 2000,
           progress: Callable[[str], None] | None = None) -> SearchResult:
    """Screen ``mixes`` in closed form, simulate the best ``finalists`` (and front members among
    them), and recommend the cheapest per million tokens that meets budget and target."""
    if not mixes:
        raise ValueError("no hardware mix to evaluate")
    tick = progress or (lambda _msg: None)
    screened = []
    for m in mixes:
        screened.append(planner.screen(m))
        tick("screen")
    rejected: dict[str, int] = {}
    ok = []
    for p in screened:
        why = _fails(p, budget, None)  # the TTFT target is judged on simulated figures
        if why:
            key = why.split(",")[0] if why.startswith("saturates") else why.split(" ")[0] + " budget"
            rejected[key] = rejected.get(key, 0) + 1
        else:
            ok.append(p)
    front = pareto_front(ok)
    if not ok:
        return SearchResult(screened, [], front, None, [], rejected)
    ranked = _rank(ok)
    if ttft_target is not None:
        # Candidates likely to meet the target first (the analytic TTFT has no queueing: optimistic).
        ranked.sort(key=lambda p: p.ttft_p90_s > ttft_target)
    chosen = ranked[:max(1, finalists)]
    sims = []
    for p in chosen:
        sims.append(planner.simulate(p, sim_requests))
        tick("simulate")
    fails = {id(p): _fails(p, budget, ttft_target) for p in sims}
    passing = _rank([p for p in sims if fails[id(p)] is None])
    sims = passing + _rank([p for p in sims if fails[id(p)] is not None])
    rec = passing[0] if passing else None
    runners = []
    for p in sims[1:]:
        why = fails[id(p)]
        runners.append((p, why if why else (_why_lost(p, rec) if rec else "")))
    return SearchResult(screened, sims, front, rec, runners, rejected)
