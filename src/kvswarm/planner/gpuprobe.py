"""Measure a GPU's figures for the hardware catalog: host<->GPU copy bandwidth and prefill throughput.

    python -m kvswarm.planner.gpuprobe --model Llama-3.1-8B --json gpu.json

Host -> GPU and GPU -> host copies of pinned and pageable buffers (the catalog's
``pcie_*`` link: a KV block loaded from DRAM or a drive crosses it), and the bf16 matrix
products of one transformer layer's prefill at several prompt lengths, plus causal
attention (``scaled_dot_product_attention``), whose FLOPs over the datasheet peak give the
catalog's ``mfu``.  Needs torch with CUDA; timings use CUDA events after warm-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _time_cuda(torch, fn, reps: int) -> float:
    """Mean seconds per call (CUDA events), after two warm-up calls."""
    fn()
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def copy_bandwidth(torch, nbytes: int = 1 << 30, reps: int = 10) -> dict[str, float]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for pinned in (True, False):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        host.fill_(1)
        name = "pinned" if pinned else "pageable"
        h2d = _time_cuda(torch, lambda h=host, p=pinned: dev.copy_(h, non_blocking=p), reps)
        d2h = _time_cuda(torch, lambda h=host, p=pinned: h.copy_(dev, non_blocking=p), reps)
        out[f"h2d_{name}_gbps"], out[f"d2h_{name}_gbps"] = nbytes / h2d / 1e9, nbytes / d2h / 1e9
    return out


def prefill_throughput(torch, spec, lengths: list[int], reps: int = 5) -> dict[str, float]:
    """Achieved TFLOP/s of one layer's prefill (QKV, output, gated MLP, causal attention) per length."""
    import torch.nn.functional as F

    hidden = spec.num_q_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    # MLP width from the parameter count: P ~ L * (2*h*h + 2*h*kv + 3*h*ffn) (embeddings ignored)
    # rounded to a multiple of 256, as real models' widths are (odd shapes run slow kernels).
    ffn = max(hidden, int((spec.params_b * 1e9 / spec.num_layers - 2 * hidden * hidden - 2 * hidden * kv)
                          / (3 * hidden)) // 256 * 256)
    bf = torch.bfloat16
    w_qkv = torch.randn(hidden, hidden + 2 * kv, dtype=bf, device="cuda")
    w_o = torch.randn(hidden, hidden, dtype=bf, device="cuda")
    w_up = torch.randn(hidden, 2 * ffn, dtype=bf, device="cuda")
    w_down = torch.randn(ffn, hidden, dtype=bf, device="cuda")
    out = {"ffn": ffn}
    for n in lengths:
        x = torch.randn(n, hidden, dtype=bf, device="cuda")
        q = torch.randn(1, spec.num_q_heads, n, spec.head_dim, dtype=bf, device="cuda")
        k = torch.randn(1, spec.num_q_heads, n, spec.head_dim, dtype=bf, device="cuda")

        def layer(x=x, q=q, k=k, n=n):
            y = x @ w_qkv
            a = F.scaled_dot_product_attention(q, k, k, is_causal=True)
            z = a.transpose(1, 2).reshape(n, hidden) @ w_o
            u = z @ w_up
            return (u[:, :ffn] * u[:, ffn:]) @ w_down, y

        s = _time_cuda(torch, layer, reps)
        flops = 2 * n * (hidden * (hidden + 2 * kv) + hidden * hidden + hidden * 2 * ffn + ffn * hidden) \
            + 4 * n * (n + 1) / 2 * hidden
        out[f"prefill_{n}_tflops"] = flops / s / 1e12
        out[f"prefill_{n}_layer_ms"] = s * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvswarm.planner.gpuprobe", description=__doc__.strip().split("\n")[0])
    ap.add_argument("--model", default="Llama-3.1-8B", help="model preset whose layer shapes are timed")
    ap.add_argument("--lengths", default="1024,4096,16384", help="prompt lengths (tokens)")
    ap.add_argument("--peak-tflops", type=float, help="datasheet dense bf16 peak, to report MFU")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("error: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: no CUDA device: the GPU probe needs one", file=sys.stderr)
        return 2
    from kvswarm.planner.models import resolve_model

    spec = resolve_model(args.model)
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "model": spec.name,
           **copy_bandwidth(torch), **prefill_throughput(torch, spec, [int(x) for x in args.lengths.split(",")])}
    if args.peak_tflops:
        res |= {k.replace("_tflops", "_mfu"): v / args.peak_tflops for k, v in list(res.items())
                if k.endswith("_tflops")}
    res["seconds"] = time.time() - t0
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
