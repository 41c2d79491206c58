"""Attention kernel timings on the GPU for a few configurations (a developer tool, not a test).
Qwen3-0.6B attention shape: 16 query heads, 8 KV heads, head_dim 128, bf16 queries, a bf16 or
fp8 cache, block_size 256, pages scattered at random over a large cache (so reads come from HBM,
not L2).

    PYTHONPATH=. python3 tests/bench_kernels.py [--layout | --splits | --order | --ncu [--fp8]]

--layout: only the table of cache layouts ([block, token, KV head, dim], the engine's, against
[block, KV head, token, dim], whose pages hold each head's tokens back to back; the kernels read
either through the cache's strides). --splits: only the table of decode splits at mid-size
batches of mixed lengths, where the engine's choice (decode_split_config) changes. --order: what
memory reads can reach (a contiguous read and the decode kernel's own paged reads without the
attention arithmetic), and the decode kernel on large mixed batches with the sequences in the
order given, longest first and shortest first (programs start in sequence order).
--ncu: no timing; each kernel of the --order comparison launched twice, eagerly, on 256 and 128
mixed sequences (the decode kernel with the engine's configuration and with 32-token tiles and
three stages, its read-only twin, on both cache layouts; then the contiguous read; with --fp8 on an
fp8 cache, without the 32-token variant), for Nsight Compute to profile the second launches (the
H200 machine has ncu; leave its clocks alone):

    ncu --clock-control none -k regex:"_decode_split_kernel|_read_kernel" --set full \
        --import-source yes -o decode python3 tests/bench_kernels.py --ncu
    ncu --import decode.ncu-rep --page source --csv --print-source sass > source.csv
    python3 tests/ncu_stalls.py source.csv          # where each kernel's warps wait
"""
import argparse
import random

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from gpu_timing import us_per_call_in_graph
from nanovllm.kernels import triton_attention as ta

H, KV, D, PAGE = 16, 8, 128, 256


def paged(seq_lens, num_blocks=6000, cache_dtype=torch.bfloat16, heads_first=False, page=PAGE):
    """Random K/V caches (shape [block, token, KV head, dim]; with heads_first a view of
    [block, KV head, token, dim] memory), block tables of scattered pages, seq_lens."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (num_blocks, KV, page, D) if heads_first else (num_blocks, page, KV, D)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).to(cache_dtype)
    v = torch.randn_like(k, dtype=torch.bfloat16).to(cache_dtype)
    if heads_first:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    width = max(-(-n // page) for n in seq_lens)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen)
    tables = perm[:len(seq_lens) * width].view(len(seq_lens), width).to(torch.int32)
    return k, v, tables, torch.tensor(seq_lens, dtype=torch.int32, device="cuda")


def layouts(mixed):
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("decode and prefill by cache layout: us per call in a CUDA graph of 20 calls, GB/s of K/V "
          "(decode: the engine's splits for max_model_len 4096)")
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for name, lens in (("256 mixed", mixed), ("256 x 1024", [1024] * 256), ("64 x 2048", [2048] * 64),
                           ("16 x 1024", [1024] * 16), ("1 x 1024", [1024])):
            q = torch.randn(len(lens), H, D, device="cuda", dtype=torch.bfloat16)
            splits = ta.decode_split_config(len(lens), KV, num_sms, 4096)
            kv_bytes = 2 * sum(lens) * KV * D * cache_dtype.itemsize
            for heads_first in (False, True):
                k, v, tables, seq_lens = paged(lens, cache_dtype=cache_dtype, heads_first=heads_first)
                us = us_per_call_in_graph([lambda: ta.decode_attention(q, k, v, tables, seq_lens, D ** -0.5,
                                                                       *splits)] * 20)
                layout = "[block, head, token, dim]" if heads_first else "[block, token, head, dim]"
                print(f"  decode  {str(cache_dtype)[6:]:13} {name:10} {splits} {layout}: {us:8.1f} us "
                      f"{kv_bytes / us / 1e3:7.0f} GB/s")
        lens = [1024] * 16
        q = torch.randn(sum(lens), H, D, device="cuda", dtype=torch.bfloat16)
        qsl = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device="cuda")
        for heads_first in (False, True):
            k, v, tables, seq_lens = paged(lens, cache_dtype=cache_dtype, heads_first=heads_first)
            us = us_per_call_in_graph([lambda: ta.prefill_attention(q, k, v, tables, qsl, seq_lens, 1024,
                                                                    D ** -0.5)] * 20)
            layout = "[block, head, token, dim]" if heads_first else "[block, token, head, dim]"
            print(f"  prefill {str(cache_dtype)[6:]:13} 16 x 1024  {layout}: {us:8.1f} us")


@triton.jit
def _read_kernel(x_ptr, out_ptr, per_program, BLOCK: tl.constexpr):
    """Sums per_program contiguous values: a pure read of x at the rate the memory allows."""
    base = tl.program_id(0).to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, per_program, BLOCK):
        acc += tl.load(x_ptr + base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_read_kernel(k_ptr, v_ptr, tables_ptr, seq_lens_ptr, out_ptr, stride_bt, stride_cb, stride_cr,
                       stride_ch, SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """The decode kernel's reads (one program per sequence, KV head and split of SPLIT tokens, the
    next tile's page looked up one iteration ahead) without its arithmetic: K + V summed."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * SPLIT
    if start >= seq_len:
        return
    end = tl.minimum(start + SPLIT, seq_len)
    offs_d = tl.arange(0, HEAD_DIM)
    table = tables_ptr + seq * stride_bt
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    page = tl.load(table + start // PAGE)
    for n_start in range(start, end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        rows = ta._tile_rows(page, offs_n, kv_head, stride_cb, stride_cr, stride_ch, PAGE)
        acc += ta._load_tile(k_ptr, rows, offs_d, n_mask, MASKED=True).to(tl.float32)
        acc += ta._load_tile(v_ptr, rows, offs_d, n_mask, MASKED=True).to(tl.float32)
        page = ta._next_page(table, n_start, end, PAGE, BLOCK_N)
    tl.store(out_ptr + (seq * tl.num_programs(1) + kv_head) * tl.num_programs(2) + split, tl.sum(tl.sum(acc, 1), 0))


def paged_read(k, v, tables, seq_lens, split, block_n=64, warps=4):
    """-> a call of _paged_read_kernel over every (sequence, KV head, split of `split` tokens) of
    contexts up to 4,096 tokens."""
    grid = (len(seq_lens), KV, 4096 // split)
    out = torch.empty(grid[0] * grid[1] * grid[2], device="cuda")
    return lambda: _paged_read_kernel[grid](
        k, v, tables, seq_lens, out, tables.stride(0), k.stride(0), k.stride(1), k.stride(2),
        SPLIT=split, HEAD_DIM=D, PAGE=PAGE, BLOCK_N=block_n, num_warps=warps, num_stages=2)


def read_ceilings_and_order():
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("reads: GB/s (median of do_bench)")
    x = torch.randn(4 << 30 >> 1, device="cuda", dtype=torch.bfloat16)     # 4 GiB
    y = torch.empty_like(x[: x.numel() // 2])
    ms = do_bench(lambda: y.copy_(x[: y.numel()]), return_mode="median")
    print(f"  copy 2 GiB -> 2 GiB (read + write):            {2 * y.nbytes / ms / 1e6:7.0f} GB/s")
    for programs, block, warps, stages in ((num_sms * 4, 4096, 8, 3), (num_sms * 8, 2048, 4, 3),
                                           (num_sms * 16, 2048, 4, 2), (num_sms * 32, 1024, 4, 3)):
        out = torch.empty(programs, device="cuda")
        per = x.numel() // programs // block * block
        call = lambda: _read_kernel[(programs,)](x, out, per, BLOCK=block, num_warps=warps, num_stages=stages)
        ms = do_bench(call, return_mode="median")
        print(f"  contiguous read, {programs} programs x {block} x {warps} warps x {stages} stages: "
              f"{programs * per * 2 / ms / 1e6:7.0f} GB/s")
    x = y = None   # (4 GiB freed before the paged caches)
    random.seed(1)
    for batch in (256, 192, 128):
        lens = [random.randint(100, 2048) for _ in range(batch)]
        kv_bytes = 2 * sum(lens) * KV * D * 2
        chosen = ta.decode_split_config(batch, KV, num_sms, 4096)
        for order in ("given", "longest first", "shortest first"):
            ordered = {"given": lens, "longest first": sorted(lens, reverse=True), "shortest first": sorted(lens)}[order]
            k, v, tables, seq_lens = paged(ordered)
            q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
            for splits in (chosen, (8, 512)):
                us = us_per_call_in_graph([lambda: ta.decode_attention(q, k, v, tables, seq_lens, D ** -0.5,
                                                                       *splits)] * 20)
                print(f"  decode {batch} mixed, {order:14} {str(splits):10}: {us:7.1f} us {kv_bytes / us / 1e3:6.0f} GB/s")
            for split, block_n, warps in ((1024, 64, 4), (1024, 128, 8), (512, 64, 4)):
                us = us_per_call_in_graph([paged_read(k, v, tables, seq_lens, split, block_n, warps)] * 20)
                print(f"  paged read only {batch} mixed, {order:14} split {split} tile {block_n} "
                      f"{warps} warps: {us:7.1f} us {kv_bytes / us / 1e3:6.0f} GB/s")
            k = v = None   # (the cache freed before the next one is made)


def splits_at_mid_batches():
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("decode splits at mid-size batches, contexts of 100-2,048 tokens (bf16 cache): us per call in a "
          "CUDA graph of 20 calls; * the engine's choice; splits under 256 tokens only up to 64 sequences")
    for batch in (16, 32, 64, 128, 192, 224, 256):
        lens = [random.randint(100, 2048) for _ in range(batch)]
        k, v, tables, seq_lens = paged(lens)
        q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
        chosen = ta.decode_split_config(batch, KV, num_sms, 4096)
        for splits in sorted({(1, 64), (4, 1024), (8, 512), (16, 256), (16, 64), chosen}):
            if batch > 64 and splits[1] < 256:
                continue
            us = us_per_call_in_graph([lambda: ta.decode_attention(q, k, v, tables, seq_lens, D ** -0.5, *splits)] * 20)
            print(f"  {batch:3} mixed {str(splits):11}{'*' if splits == chosen else ' '} {us:8.1f} us")


def launches_for_ncu(cache_dtype):
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    random.seed(1)
    for batch in (256, 128):
        lens = [random.randint(100, 2048) for _ in range(batch)]
        q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
        num_splits, split = ta.decode_split_config(batch, KV, num_sms, 4096)
        for heads_first in (False, True):
            k, v, tables, seq_lens = paged(lens, cache_dtype=cache_dtype, heads_first=heads_first)
            read = paged_read(k, v, tables, seq_lens, split)
            for _ in range(2):
                ta.decode_attention(q, k, v, tables, seq_lens, D ** -0.5, num_splits, split)
                if cache_dtype == torch.bfloat16:
                    ta.decode_attention(q, k, v, tables, seq_lens, D ** -0.5, num_splits, split, block_n=32,
                                        num_stages=3)
                read()
            print(f"launched: {batch} mixed, splits {(num_splits, split)}, "
                  f"{'[block, head, token, dim]' if heads_first else '[block, token, head, dim]'}")
            k = v = None   # (the cache freed before the next one is made)
    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    programs = num_sms * 32
    out = torch.empty(programs, device="cuda")
    for _ in range(2):
        _read_kernel[(programs,)](x, out, x.numel() // programs // 1024 * 1024, BLOCK=1024, num_warps=4, num_stages=3)
    torch.cuda.synchronize()
    print("launched: contiguous read of 2 GiB")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layout", action="store_true", help="only the cache-layout table")
    p.add_argument("--splits", action="store_true", help="only the table of decode splits at mid-size batches")
    p.add_argument("--order", action="store_true", help="only the read ceilings and the sequence-order table")
    p.add_argument("--ncu", action="store_true", help="no timing: launches for Nsight Compute to profile")
    p.add_argument("--fp8", action="store_true", help="with --ncu: an fp8 (e4m3) cache, the engine's configuration")
    args = p.parse_args()
    if args.ncu:
        return launches_for_ncu(torch.float8_e4m3fn if args.fp8 else torch.bfloat16)
    random.seed(0)
    mixed = [random.randint(100, 2048) for _ in range(256)]     # the default workload's spread
    if args.layout:
        return layouts(mixed)
    if args.splits:
        return splits_at_mid_batches()
    if args.order:
        return read_ceilings_and_order()
    print("decode: cache dtype, batch, config (splits, min_split, block_n, stages, warps, max registers)"
          " -> us, GB/s of K/V; stages None: the kernel's per-dtype default")
    configs = [(4, 1024, 64, None, 4, None), (4, 1024, 64, 2, 4, None), (4, 1024, 64, 3, 4, 128),
               (1, 64, 64, None, 4, None), (16, 256, 64, None, 4, None), (16, 64, 64, None, 4, None),
               (4, 1024, 128, 3, 8, None), (4, 1024, 128, 3, 8, 80), (4, 1024, 32, 4, 2, None),
               (4, 1024, 64, 3, 4, 96), (4, 1024, 64, 2, 8, None), (4, 1024, 64, 2, 2, None),
               (4, 1024, 32, 2, 2, None), (4, 1024, 32, 3, 4, None), (4, 1024, 128, 2, 8, None)]
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for name, lens in (("256 x 1024", [1024] * 256), ("256 mixed", mixed), ("64 x 2048", [2048] * 64),
                           ("1 x 1024", [1024])):
            k, v, tables, seq_lens = paged(lens, cache_dtype=cache_dtype)
            q = torch.randn(len(lens), H, D, device="cuda", dtype=torch.bfloat16)
            kv_bytes = 2 * sum(lens) * KV * D * cache_dtype.itemsize
            for *cfg, max_registers in configs:
                ms = do_bench(lambda: ta.decode_attention(q, k, v, tables, seq_lens, D ** -0.5, *cfg,
                                                          max_registers=max_registers), return_mode="median")
                print(f"  {str(cache_dtype)[6:]:13} {name:10}  {(*cfg, max_registers)}: {ms * 1000:8.1f} us  "
                      f"{kv_bytes / ms / 1e6:7.0f} GB/s")
            k = v = None   # (the cache freed before the next one is made)
    print("decode, merge of the splits fused into the split kernel or a second kernel: us per call in a "
          "CUDA graph of 20 calls (bf16 cache)")
    for name, lens, splits in (("1 x 1024", [1024], (16, 64)), ("1 x 512", [512], (16, 64)),
                               ("16 x 1024", [1024] * 16, (16, 256)), ("256 mixed", mixed, (4, 1024))):
        k, v, tables, seq_lens = paged(lens)
        q = torch.randn(len(lens), H, D, device="cuda", dtype=torch.bfloat16)
        for fuse_merge in (False, True):
            call = lambda: ta.decode_attention(q, k, v, tables, seq_lens, D ** -0.5, *splits, fuse_merge=fuse_merge)
            print(f"  {name:10} {splits} fuse_merge={fuse_merge!s:5}: {us_per_call_in_graph([call] * 20):8.1f} us")
        k = v = None   # (the cache freed before the next one is made)
    print("prefill: 16 x 1024 new tokens, config (block_m, block_n, warps, stages) -> us, TFLOP/s")
    lens = [1024] * 16
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        k, v, tables, seq_lens = paged(lens, cache_dtype=cache_dtype)
        q = torch.randn(sum(lens), H, D, device="cuda", dtype=torch.bfloat16)
        qsl = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device="cuda")
        flops = 2 * 2 * H * D * sum(n * n / 2 for n in lens)
        for cfg in ((64, 64, 4, 3), (64, 64, 4, 2), (128, 128, 8, 3), (64, 32, 4, 3)):
            ms = do_bench(lambda: ta.prefill_attention(q, k, v, tables, qsl, seq_lens, 1024, D ** -0.5, *cfg),
                          return_mode="median")
            print(f"  {str(cache_dtype)[6:]:13} {cfg}: {ms * 1000:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s")


if __name__ == "__main__":
    main()
