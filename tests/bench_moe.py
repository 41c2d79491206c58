"""A mixture-of-experts layer's kernels (kernels/triton_moe.py) on the GPU, for the Qwen3-30B-A3B
shape (128 experts, top 8, hidden 2,048, intermediate 768), at decode and prompt token counts: the
routing and placement kernels (two kernels; "single": one program, up to ROUTE_TOKENS tokens) against
the torch routing and grouping, the whole layer, and with --sweep
each product over a range of tiles (a developer tool, not a test).

Each figure is the time per call inside a CUDA graph (as in the decode graphs), the calls cycling
through several routings, so that the experts' weights are read from HBM as in a model's step.
GB/s counts the weights of the experts that a call's routing uses.

    PYTHONPATH=. python3 tests/bench_moe.py [--tokens 1,8,64] [--sweep]
"""
import argparse
import itertools

import torch

from gpu_timing import us_per_call_in_graph
from nanovllm.kernels.compile_ahead import dry_run
from nanovllm.kernels.triton_moe import (ROUTE_TOKENS, TILES, Tiles, block_m_for, fused_moe, group_by_expert,
                                         moe_product, route_and_group)
from nanovllm.layers.moe import route

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 128, 2048, 768, 8
ROUTINGS = 8   # the calls of a graph cycle through these


def candidate_tiles(block_m: int) -> list[Tiles]:
    """Narrow, deep tiles on 4 warps for the few rows an expert gets in decode steps; wider ones,
    and 8 warps, for the many it gets in prompt steps."""
    if block_m == 16:
        space = itertools.product((32, 64, 128), (64, 128, 256), (4,), (2, 3, 4, 5))
    else:
        space = itertools.product((64, 128, 256), (64, 128), (4, 8), (3, 4))
    return [Tiles(*t) for t in space]


def block_ms(num_tokens: int) -> list[int]:
    """block_m_for's choice and the other sizes TILES has, where an expert's rows make them sensible."""
    chosen = block_m_for(num_tokens * TOP_K, EXPERTS)
    per_expert = num_tokens * TOP_K / EXPERTS
    return sorted({chosen} | {m for m in TILES if m <= 2 * max(per_expert, 8)})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,8,64,256,1024,4096,16384")
    p.add_argument("--sweep", action="store_true", help="time each product over candidate_tiles")
    p.add_argument("--ncu", action="store_true", help="no timing: the layer 5 times at each token count, for "
                   "Nsight Compute to profile (e.g. ncu -k regex:moe_product --launch-skip 4 --launch-count 2)")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = dict(device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen, **dev) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=gen, **dev) * 0.02
    gate = torch.randn(EXPERTS, HIDDEN, generator=gen, **dev) * 0.02
    if args.ncu:
        for num_tokens in map(int, args.tokens.split(",")):
            for _ in range(5):
                x = torch.randn(num_tokens, HIDDEN, generator=gen, **dev)
                fused_moe(x, x @ gate.T, w13, w2, TOP_K, True)
        return torch.cuda.synchronize()
    print("us per call in a CUDA graph; GB/s of the experts' weights a call reads")
    print(f"{'tokens':>6} {'route+place':>11} {'single':>8} {'torch':>8} {'layer':>8} {'gate_up':>8} {'down':>8} "
          f"{'GB/s gate_up':>12} {'GB/s down':>10} {'TFLOP/s':>8}")
    sweeps = []
    for num_tokens in map(int, args.tokens.split(",")):
        xs = [torch.randn(num_tokens, HIDDEN, generator=gen, **dev) for _ in range(ROUTINGS)]
        logits = [torch.randn(num_tokens, EXPERTS, generator=gen, **dev) for _ in range(ROUTINGS)]
        used = sum(len(route(lg, TOP_K, True)[1].unique()) for lg in logits) / ROUTINGS
        bytes13, bytes2 = used * w13[0].nbytes, used * w2[0].nbytes
        flops = 2 * num_tokens * TOP_K * 3 * INTERMEDIATE * HIDDEN
        block_m = block_m_for(num_tokens * TOP_K, EXPERTS)

        def torch_grouping(lg):
            _, ids = route(lg, TOP_K, True)
            return group_by_expert(ids, EXPERTS, block_m)

        ours = us_per_call_in_graph([lambda lg=lg: route_and_group(lg, TOP_K, True, block_m, single_program=False)
                                     for lg in logits])
        single = (us_per_call_in_graph([lambda lg=lg: route_and_group(lg, TOP_K, True, block_m, single_program=True)
                                        for lg in logits]) if num_tokens <= ROUTE_TOKENS else float("nan"))
        theirs = us_per_call_in_graph([lambda lg=lg: torch_grouping(lg) for lg in logits])
        layer = us_per_call_in_graph([lambda x=x: fused_moe(x, x @ gate.T, w13, w2, TOP_K, True) for x in xs])
        products = {}
        for bm in block_ms(num_tokens):
            groups = [route_and_group(lg, TOP_K, True, bm) for lg in logits]
            acts = [moe_product(x, w13, s, b, num_tokens * TOP_K, TOP_K, bm, silu_mul=True)
                    for x, (_, _, s, b) in zip(xs, groups)]

            def first(tiles, i):
                return moe_product(xs[i], w13, *groups[i][2:], num_tokens * TOP_K, TOP_K, bm, silu_mul=True,
                                   tiles=tiles)

            def second(tiles, i):
                return moe_product(acts[i], w2, *groups[i][2:], num_tokens * TOP_K, 1, bm,
                                   scale=groups[i][0].view(-1), tiles=tiles)

            tiles = [None] + (candidate_tiles(bm) if args.sweep else [])   # None: TILES's

            def launch_each():
                for t in tiles:
                    first(t, 0)
                    second(t, 0)

            dry_run(launch_each)   # every variant's compile queued at once, so they compile side by side
            for name, f in (("gate_up", first), ("down", second)):
                reference = f(None, 0).float()
                for t in tiles:
                    try:
                        out = f(t, 0).float()
                        us = us_per_call_in_graph([lambda i=i: f(t, i) for i in range(ROUTINGS)])
                    except Exception as e:   # e.g. out of shared memory
                        print(f"  {name} block_m {bm} {t} failed: {type(e).__name__}")
                        continue
                    if not torch.allclose(out, reference, rtol=2e-2, atol=2e-2):
                        print(f"  {name} block_m {bm} {t}: output differs by {(out - reference).abs().max():.3g}")
                    products.setdefault(name, []).append((us, bm, t))
        default = {name: next(us for us, bm, t in results if bm == block_m and t is None)
                   for name, results in products.items()}
        first_us, second_us = default["gate_up"], default["down"]
        print(f"{num_tokens:6} {ours:11.1f} {single:8.1f} {theirs:8.1f} {layer:8.1f} {first_us:8.1f} {second_us:8.1f} "
              f"{bytes13 / first_us / 1e3:12.0f} {bytes2 / second_us / 1e3:10.0f} "
              f"{flops / (first_us + second_us) / 1e6:8.1f}")
        sweeps.append((num_tokens, products, default))
    for num_tokens, products, default in sweeps if args.sweep else []:
        block_m = block_m_for(num_tokens * TOP_K, EXPERTS)
        print(f"\n{num_tokens} tokens: the five fastest tiles of each product (TILES's for block_m {block_m}: "
              f"{TILES[block_m]})")
        for name, results in products.items():
            for us, bm, t in sorted(results, key=lambda r: r[0])[:5]:
                print(f"  {name:8} {us:8.1f} us ({default[name] / us:.2f}x)  block_m {bm:3}  {t or 'TILES'}")


if __name__ == "__main__":
    main()
