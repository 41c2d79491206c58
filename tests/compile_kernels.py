"""Compile the attention kernels for an H100/H200 (sm_90) on any machine, GPU or not, and report
what decides their speed before a device call is spent on them (a developer tool, not a test):
registers per thread and spills (ptxas), shared memory, how many K/V tiles Triton keeps in
flight (buffers per operand, from the TTGIR), and the programs that fit on one SM.

    PYTHONPATH=. python3 tests/compile_kernels.py

With the GPU machine's Triton (3.6.0; a newer one accepts code 3.6 refuses, and its bundled
ptxas may not read its own PTX): `pip install --no-deps --target /tmp/tr36 triton==3.6.0`, then
PYTHONPATH=/tmp/tr36:. for the command above.

Shapes: Qwen3-0.6B attention (GQA group 2, head_dim 128), block_size 256, bf16 queries, strides
divisible by 16 (as Triton specialises them at run time).
"""
import os
import re
import subprocess

import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanovllm.kernels import triton_attention as ta

PTXAS = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "ptxas")
TARGET = GPUTarget("cuda", 90, 32)
REGISTERS_PER_SM, SHARED_PER_SM, MAX_WARPS_PER_SM = 65536, 228 * 1024, 64
MULTIPLES_OF_16 = {"K", "k_per_split"}   # integer arguments that are multiples of 16 at run time


def signature(names: list[str], types: dict[str, str]) -> dict[str, str]:
    return {n: types.get(n, "i32" if n.startswith("stride") else "constexpr") for n in names}


def compile_kernel(kernel, types: dict[str, str], constants: dict, num_warps: int, num_stages: int,
                   maxnreg: int | None):
    names = kernel.arg_names
    sig = signature(names, types)
    # Pointers and strides are multiples of 16 at run time, except the unspecialised ones.
    aligned = [i for i, n in enumerate(names)
               if (sig[n].startswith("*") or n.startswith("stride") or n in MULTIPLES_OF_16)
               and n not in kernel.do_not_specialize]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(ASTSource(kernel, sig, constants, attrs), target=TARGET, options=options)


def report(label: str, compiled, num_warps: int) -> str:
    ptx_file = "/tmp/nanovllm_compile_kernels.ptx"
    with open(ptx_file, "w") as f:
        f.write(compiled.asm["ptx"])
    ptxas = subprocess.run([PTXAS, "-arch=sm_90a", "-v", ptx_file, "-o", os.devnull],
                           capture_output=True, text=True).stderr
    registers = int(re.search(r"Used (\d+) registers", ptxas).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", ptxas).group(1))
    buffers = sorted({int(b) for b in re.findall(r"memdesc<(\d+)x\d+x\d+x", compiled.asm["ttgir"])})
    shared = compiled.metadata.shared
    fits = min(REGISTERS_PER_SM // (-(-registers // 8) * 8 * 32 * num_warps), MAX_WARPS_PER_SM // num_warps,
               SHARED_PER_SM // (shared + 1024))
    return (f"  {label:44} {registers:4} regs {spills:5} B spilled {shared // 1024:4} KB shared "
            f"{buffers or '-'!s:8} tile buffers {fits} programs/SM")


def main():
    prefix_types = {"q_ptr": "*bf16", "block_tables_ptr": "*i32", "tiles_ptr": "*i32", "tile_count_ptr": "*i32",
                    "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "scale": "fp32", "splits": "i32", "slots": "i32"}
    prefix_constants = dict(NUM_KV_HEADS=8, GROUP=2, HEAD_DIM=128, PAGE=256, BLOCK_M=ta.SHARED_PREFIX_ROWS, BLOCK_N=64,
                            MIN_SPLIT=ta.MIN_PREFIX_SPLIT)
    print("decode (block_n, stages, warps, max registers):")
    for cache in ("bf16", "fp8e4nv"):
        types = {"q_ptr": "*bf16", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}",
                 "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "prefix_lens_ptr": "*i32", "out_ptr": "*bf16",
                 "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "count_ptr": "*i32", "scale": "fp32",
                 "prefix_splits": "i32"}
        for block_n, stages, warps, maxnreg in ((64, 2, 4, None), (64, 3, 4, None), (64, 3, 4, 128),
                                                (128, 3, 8, None), (32, 4, 2, None)):
            constants = dict(NUM_SPLITS=4, MIN_SPLIT=1024, GROUP=2, BLOCK_G=16, HEAD_DIM=128, PAGE=256,
                             BLOCK_N=block_n, FUSE_MERGE=False, SHARED_PREFIX=False,
                             MIN_PREFIX_SPLIT=ta.MIN_PREFIX_SPLIT, PDL=False)
            compiled = compile_kernel(ta._decode_split_kernel, types, constants, warps, stages, maxnreg)
            print(report(f"{cache} {(block_n, stages, warps, maxnreg)}", compiled, warps))
        for stages, maxnreg in ((2, None), (3, 128)):   # the defaults per cache dtype, merge fused
            compiled = compile_kernel(ta._decode_split_kernel, types, constants | dict(BLOCK_N=64, FUSE_MERGE=True),
                                      4, stages, maxnreg)
            print(report(f"{cache} (64, {stages}, 4, {maxnreg}) fused merge", compiled, 4))
            shared = constants | dict(BLOCK_N=64, FUSE_MERGE=True, SHARED_PREFIX=True)
            compiled = compile_kernel(ta._decode_split_kernel, types, shared, 4, stages, maxnreg)
            print(report(f"{cache} (64, {stages}, 4, {maxnreg}) fused merge, shared prefixes", compiled, 4))
            compiled = compile_kernel(ta._shared_prefix_kernel, prefix_types | {"k_cache_ptr": f"*{cache}",
                                      "v_cache_ptr": f"*{cache}"}, prefix_constants, 4, stages, None)
            print(report(f"{cache} shared-prefix kernel (64 rows, 64, {stages}, 4)", compiled, 4))
        constants |= dict(BLOCK_N=64, PDL=True)   # programmatic dependent launch (kernels/pdl.py)
        compiled = compile_kernel(ta._decode_split_kernel, types, constants, 4, 2, None)
        ptx = compiled.asm["ptx"]
        print(report(f"{cache} (64, 2, 4, None) PDL", compiled, 4) +
              f"  griddepcontrol: wait {ptx.count('griddepcontrol.wait')}, "
              f"launch_dependents {ptx.count('griddepcontrol.launch_dependents')}")
    print("prefill (block_m, block_n, warps, stages):")
    for cache in ("bf16", "fp8e4nv"):
        types = {"q_ptr": "*bf16", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}",
                 "block_tables_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
                 "out_ptr": "*bf16", "scale": "fp32", "min_q_len": "i32"}
        for block_m, block_n, warps, stages in ((64, 64, 4, 2), (64, 64, 4, 3), (128, 128, 8, 3)):
            constants = dict(GROUP=2, HEAD_DIM=128, PAGE=256, BLOCK_M=block_m, BLOCK_N=block_n)
            compiled = compile_kernel(ta._prefill_kernel, types, constants, warps, stages, None)
            print(report(f"{cache} {(block_m, block_n, warps, stages)}", compiled, warps))
    print("skinny linear, 1-16 rows (split_k, block_n, block_k, stages, warps):")
    from nanovllm.kernels import triton_skinny as ts
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
             "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32"}
    for split_k, block_n, block_k, stages, warps in ((1, 64, 256, 4, 4), (8, 64, 256, 4, 4), (1, 32, 128, 6, 4)):
        constants = dict(HAS_BIAS=False, SILU_MUL=False, EVEN_K=True, SPLIT_K=split_k, BLOCK_M=ts.MAX_ROWS,
                         BLOCK_N=block_n, BLOCK_K=block_k, LINE=64, PREFETCH_LINES=16, PDL=False)
        compiled = compile_kernel(ts._skinny_linear_kernel, types, constants, warps, stages, None)
        ptx = compiled.asm["ptx"]
        print(report(f"{(split_k, block_n, block_k, stages, warps)}", compiled, warps) +
              f"  cp.async {ptx.count('cp.async.cg')}, atom {ptx.count('atom.')}")
    constants |= dict(PDL=True)   # weight prefetched into L2 before the wait for the kernel before
    compiled = compile_kernel(ts._skinny_linear_kernel, types, constants, 4, 4, None)
    ptx = compiled.asm["ptx"]
    print(report("(1, 32, 128, 6, 4) PDL", compiled, 4) + f"  prefetch.global.L2 {ptx.count('prefetch.global.L2')}, "
          f"griddepcontrol.wait {ptx.count('griddepcontrol.wait')}")
    ptx = compile_kernel(ts._skinny_linear_kernel, types, constants | dict(PREFETCH_LINES=0), 4, 4, None).asm["ptx"]
    print(f"(1, 32, 128, 6, 4) PDL, no prefetch: prefetch.global.L2 {ptx.count('prefetch.global.L2')}, "
          f"griddepcontrol.wait {ptx.count('griddepcontrol.wait')}")
    constants = dict(HAS_BIAS=False, SILU_MUL=True, EVEN_K=True, SPLIT_K=1, BLOCK_M=ts.MAX_ROWS, BLOCK_N=64,
                     BLOCK_K=256, LINE=64, PREFETCH_LINES=16, PDL=True)   # gate_up_proj, writing SiLU x up
    print(report("(1, 64, 256, 4, 4) PDL, SiLU x up", compile_kernel(ts._skinny_linear_kernel, types, constants,
                                                                   4, 4, None), 4))

    print("q/k norm + RoPE + KV store (Qwen3-0.6B heads, bf16 and fp8 caches), PDL on:")
    from nanovllm.kernels import triton_fused as tf
    for cache in ("bf16", "fp8e4nv"):
        types = {"qkv_ptr": "*bf16", "pos_ptr": "*i64", "cos_sin_ptr": "*fp32", "qw_ptr": "*bf16", "kw_ptr": "*bf16",
                 "q_out_ptr": "*bf16", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}", "slot_ptr": "*i64",
                 "eps": "fp32"}
        constants = dict(NUM_Q_HEADS=16, NUM_KV_HEADS=8, HALF=64, HAS_NORM=True, HEADS=tf.QK_HEADS_PER_PROGRAM, PDL=True)
        print(report(f"{cache} cache", compile_kernel(tf._qk_norm_rope_store_kernel, types, constants, 2, 1, None), 2))

    print("sampler top-k/top-p cut (bf16 logits; top_k 20 with top_p, so K_CAP 32 and CAP 256):")
    from nanovllm.kernels import triton_top_k as tk
    types = {"logits_ptr": "*bf16", "top_k_ptr": "*i64", "top_p_ptr": "*fp32", "temps_ptr": "*fp32",
             "min_p_ptr": "*fp32", "counts_ptr": "*i32", "num_above_ptr": "*i32", "best_ptr": "*fp32",
             "cut_ptr": "*fp32",
             "maxima_ptr": "*fp32", "floor_ptr": "*fp32", "candidates_ptr": "*fp32", "num_candidates_ptr": "*i32",
             "vocab_size": "i32", "chunk_size": "i32", "num_sub": "i32"}
    kernels = [("sub-block maxima", tk._sub_block_maxima_kernel,
                dict(NUM_SUB_PAD=2048, BLOCK=tk.BLOCK, SUB=tk.SUB)),
               ("candidate floor", tk._candidate_floor_kernel, dict(NUM_SUB_PAD=2048)),
               ("gather candidates", tk._gather_candidates_kernel, dict(CAP=256, BLOCK=tk.BLOCK)),
               ("cut from candidates (8 warps)", tk._cut_from_candidates_kernel, dict(HAS_TOP_P=True, CAP=256)),
               ("radix histogram, pass 0", tk._histogram_kernel, dict(PASS=0, CAP=256, BLOCK=tk.BLOCK)),
               ("radix gather above", tk._gather_above_kernel, dict(NUM_PASSES=2, K_CAP=32, CAP=256, BLOCK=tk.BLOCK)),
               ("radix cut", tk._radix_cut_kernel, dict(HAS_TOP_P=True, NUM_PASSES=2, K_CAP=32, CAP=256))]
    for label, kernel, constants in kernels:
        warps = 8 if kernel is tk._cut_from_candidates_kernel else 4     # as top_k_top_p_cut launches them
        print(report(label, compile_kernel(kernel, types, constants, warps, 3, None), warps))

    print("sampler top-p cut without top-k (bf16 logits):")
    from nanovllm.kernels import triton_top_p as tp
    types = {"logits_ptr": "*bf16", "cand_ptr": "*bf16", "count_ptr": "*i32", "top_p_ptr": "*fp32",
             "temps_ptr": "*fp32", "min_p_ptr": "*fp32", "stats_ptr": "*fp32", "kept_ptr": "*fp32",
             "masses_ptr": "*fp32", "cut_ptr": "*fp32", "stride": "i32",
             "vocab_size": "i32", "chunk_size": "i32", "num_chunks": "i32"}
    print(report("chunk stats", compile_kernel(tp._stats_kernel, types, dict(BLOCK=2048), 4, 3, None), 4))
    print(report("gather candidates", compile_kernel(tp._gather_kernel, types, dict(BLOCK=2048), 4, 3, None), 4))
    for block, warps in ((512, 4), (512, 8), (256, 4)):
        compiled = compile_kernel(tp._mass_kernel, types, dict(PASS=1, BLOCK=block), warps, 3, None)
        print(report(f"mass pass 1 (block {block}, {warps} warps)", compiled, warps))
    print(report("cut", compile_kernel(tp._cut_kernel, types, dict(NUM_PASSES=4), 4, 3, None), 4))

    print("sampler: group stats and the draw over bf16 logits, without and with a top-k/top-p cut:")
    from nanovllm.kernels import triton_sampler as tsm
    types = {"logits_ptr": "*bf16", "temps_ptr": "*fp32", "greedy_ptr": "*i1", "seeds_ptr": "*i64", "cut_ptr": "*fp32",
             "top_ptr": "*fp32", "mass_ptr": "*fp32", "arg_ptr": "*i32", "token_ptr": "*i64", "stride": "i32",
             "vocab_size": "i32", "num_groups": "i32"}
    for has_cut in (False, True):
        constants = dict(HAS_CUT=has_cut, GROUP=tsm.GROUP)
        print(report(f"group stats, cut {has_cut}", compile_kernel(tsm._group_stats_kernel, types, constants, 2, 3,
                                                                    None), 2))
        constants["GROUPS"] = 256
        print(report(f"draw, cut {has_cut}", compile_kernel(tsm._draw_kernel, types, constants, 4, 3, None), 4))


if __name__ == "__main__":
    main()
