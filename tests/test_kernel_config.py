"""Launch choices of the Triton kernels (plain functions: no GPU needed)."""
import pytest

from nanovllm.kernels import pdl
from nanovllm.kernels.triton_attention import decode_split_config, decode_variant_sizes, tile_size
from nanovllm.kernels.triton_skinny import prefetch_lines, split_k_for


def test_decode_splits_follow_the_batch_and_the_longest_context():
    # (num_seqs, num_kv_heads, num_sms, max_model_len) -> (most splits, fewest tokens per split)
    assert decode_split_config(1, 8, 132, 4096) == (16, 64)        # one sequence: fine splits
    assert decode_split_config(16, 8, 132, 4096) == (16, 64)       # 128 programs < 132 SMs
    assert decode_split_config(17, 8, 132, 4096) == (8, 512)
    assert decode_split_config(197, 8, 132, 4096) == (8, 512)
    assert decode_split_config(198, 8, 132, 4096) == (4, 1024)     # >= 12 programs per SM
    assert decode_split_config(256, 8, 132, 4096) == (4, 1024)
    assert decode_split_config(256, 8, 132, 40960) == (16, 1024)   # capped at 16
    assert decode_split_config(256, 8, 132, 512) == (1, 1024)      # never more than one needed
    assert decode_split_config(1, 8, 132, 16) == (1, 64)


def test_start_up_meets_every_decode_kernel_variant_once():
    # A step's size chooses the split configuration, the fused merge (above 16 sequences) and PDL (up to 16, where
    # the GPU has it: not here, where the fused merge draws the same line).
    def h200_split(n):
        return decode_split_config(n, 8, 132, 4096)
    assert decode_variant_sizes(256, h200_split) == [1, 17, 198]
    assert decode_variant_sizes(197, h200_split) == [1, 17]
    assert decode_variant_sizes(16, h200_split) == [1]
    assert decode_variant_sizes(80, lambda n: decode_split_config(n, 2, 132, 1024)) == [1, 17, 66]


def test_tiles_divide_the_page():
    assert [tile_size(64, page) for page in (16, 32, 48, 96, 256, 1024)] == [16, 32, 16, 32, 64, 64]


def test_skinny_splits_only_projections_with_few_output_blocks():
    # (output features, input features, num_sms) -> splits of the input features (blocks of 64 outputs)
    assert split_k_for(1024, 2048, 132) == 8        # 0.6B o_proj: 16 blocks -> 128 programs
    assert split_k_for(1024, 3072, 132) == 8        # 0.6B down_proj
    assert split_k_for(4096, 1024, 132) == 1        # 64 blocks: splitting measured slower
    assert split_k_for(3072, 4096, 132) == 1        # 48 blocks (Qwen3-8B qkv at TP=2)
    assert split_k_for(1024, 512, 132) == 2         # every split at least one 256-wide step
    assert split_k_for(1024, 256, 132) == 1
    assert split_k_for(64, 100_000, 132) == 128     # one block: as many splits as SMs allow


def test_skinny_prefetch_stays_within_half_of_l2():
    # (programs, weight rows a program, lines of its slice a row, num_sms, L2 bytes) -> lines asked for before
    # the PDL wait; an H200: 132 SMs, 50 MiB. A wave may ask for 25 MiB in all.
    h200 = (132, 50 << 20)
    assert prefetch_lines(96, 64, 16, *h200) == 16       # 0.6B gate_up (12.6 MB): all of it, as before
    assert prefetch_lines(80, 64, 32, *h200) == 32       # Qwen3-30B-A3B qkv (21 MB): all of it
    assert prefetch_lines(128, 64, 16, *h200) == 16      # Qwen3-30B-A3B o_proj, split 4 ways (17 MB)
    assert prefetch_lines(96, 64, 64, *h200) == 32       # Qwen3-8B qkv: 50 MB -> 25
    assert prefetch_lines(384, 64, 64, *h200) == 16      # Qwen3-8B gate_up: 69 MB a wave of 132 -> 17
    assert prefetch_lines(64, 64, 256, *h200) == 32      # Qwen3-8B down: 134 MB -> 17
    assert prefetch_lines(132, 64, 16, 132, 1 << 20) == 0   # not one line a row fits: none


def test_pdl_only_for_launches_over_few_rows(monkeypatch):
    """The decode steps of small batches (and eager steps of as few tokens) launch with PDL; larger
    launches, where it cost the default workload ~2%, do not."""
    monkeypatch.setattr(pdl, "enabled", lambda: True)
    assert pdl.launch_options(1) == pdl.launch_options(pdl.MAX_ROWS) == dict(PDL=True, launch_pdl=True)
    assert pdl.launch_options(pdl.MAX_ROWS + 1) == pdl.launch_options(16384) == dict(PDL=False)
    monkeypatch.setattr(pdl, "enabled", lambda: False)              # NANOVLLM_PDL=0, or no Hopper GPU
    assert pdl.launch_options(1) == dict(PDL=False)


def test_fused_merge_only_above_the_small_decode_graphs():
    from nanovllm.kernels.triton_attention import fused_merge_for
    assert [fused_merge_for(n) for n in (1, 16, 17, 256)] == [False, False, True, True]
    assert fused_merge_for(pdl.MAX_ROWS) is False    # the PDL graphs keep the separate merge kernel


def test_row_parallel_products_split_only_at_decode_batch_sizes():
    from nanovllm.layers.linear import split_k_before_norm
    # (rows, input features, output features) -> splits of the input features
    assert split_k_before_norm(16, 2048, 1024) == 1     # the skinny kernel's rows
    assert split_k_before_norm(17, 2048, 1024) == 8     # 0.6B o_proj
    assert split_k_before_norm(64, 3072, 1024) == 8     # 0.6B down_proj
    assert split_k_before_norm(65, 2048, 1024) == 4
    assert split_k_before_norm(256, 3072, 1024) == 4
    assert split_k_before_norm(257, 3072, 1024) == 1    # prompt steps: cuBLAS as it is
    assert split_k_before_norm(32, 4096, 2048) == 1     # wider outputs: not measured
    assert split_k_before_norm(32, 1000, 1024) == 2     # 1,000 / 4 < 256 features a split
    assert split_k_before_norm(32, 384, 1024) == 1


def test_gate_up_projection_with_silu_mul_gives_the_activation():
    """MergedColumnParallelLinear(x, silu_mul=True), as GatedMLP calls it, is silu(gate) * up of
    its two parts (on the CPU through silu_and_mul after the product; on CUDA at small batches
    inside the product's kernel)."""
    import torch
    from nanovllm.layers.activation import silu_and_mul
    from nanovllm.layers.linear import MergedColumnParallelLinear
    gen = torch.Generator().manual_seed(0)
    gate_up = MergedColumnParallelLinear(4, [6, 6])
    gate_up.weight.data = torch.randn(12, 4, generator=gen)
    x = torch.randn(3, 4, generator=gen)
    gate, up = x @ gate_up.weight[:6].T, x @ gate_up.weight[6:].T
    assert torch.allclose(gate_up(x, silu_mul=True), torch.nn.functional.silu(gate) * up, atol=1e-6)
    assert torch.equal(gate_up(x, silu_mul=True), silu_and_mul(gate_up(x)))


def test_compile_ahead_tells_launches_apart_by_what_triton_specialises_on():
    import torch
    from nanovllm.kernels.compile_ahead import _specialized_on
    x = torch.zeros(8)
    assert _specialized_on(x) == _specialized_on(torch.ones(8)) == (torch.float32, True)
    assert _specialized_on(x[1:]) == (torch.float32, False)             # 4 bytes past a 16-byte boundary
    assert _specialized_on(x.bfloat16()) == (torch.bfloat16, True)
    # ints: equal to 1, divisible by 16, within 32 bits
    assert [_specialized_on(n) for n in (1, 7, 9, 32, 48, 2**40)] == [
        (True, False, True), (False, False, True), (False, False, True), (False, True, True), (False, True, True),
        (False, True, False)]
    assert [_specialized_on(v) for v in (True, 1e-6, None)] == [True, 1e-6, None]   # other values as they are
    # TMA descriptors (the Gluon kernel's): by dtype, box and layout, not by the tensor they describe
    gluon = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl
    layout = gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    a, b = (torch.zeros(n, 128, dtype=torch.bfloat16) for n in (256, 512))
    desc_a, desc_b = (gluon.TensorDescriptor.from_tensor(t, [64, 128], layout) for t in (a, b))
    assert _specialized_on(desc_a) == _specialized_on(desc_b) == (torch.bfloat16, (64, 128), layout)


def test_dry_run_calls_its_forwards_in_a_dry_pass_or_not_at_all(monkeypatch):
    """-> the seconds it took where Triton compiles asynchronously; else None and nothing called."""
    from nanovllm.kernels import compile_ahead
    calls = []
    forwards = lambda: calls.append(compile_ahead._queued is not None)   # in the dry pass?
    if compile_ahead.AsyncCompileMode is not None:
        assert compile_ahead.dry_run(forwards) >= 0 and calls == [True]
        assert compile_ahead._queued is None                            # left again
    monkeypatch.setattr(compile_ahead, "AsyncCompileMode", None)
    calls.clear()
    assert compile_ahead.dry_run(forwards) is None and calls == []


def test_sizing_step_holds_a_decode_and_the_longest_context_the_budget_allows():
    from nanovllm.engine.kv_cache import sizing_lens
    assert sizing_lens(16384, 256, 4096) == [1] + [49] * 95 + [48] * 159 + [4096]
    assert sizing_lens(16384, 512, 40960) == [1] * 511 + [15873]
    assert sizing_lens(8192, 3, 4096) == [1, 4095, 4096]
    assert sizing_lens(8192, 2, 4096) == [4096, 4096]   # no room for a one-token row: even, as before
    assert sizing_lens(100, 2, 4096) == [1, 99]
    assert sizing_lens(100, 1, 4096) == [100]
    for args in ((16384, 256, 4096), (16384, 512, 40960), (300, 7, 64), (7, 7, 64), (16384, 5, 4096)):
        lens = sizing_lens(*args)
        assert sum(lens) == args[0] and len(lens) == args[1] and 1 == lens[0] <= min(lens)
        assert max(lens) <= args[2]


def test_mixed_step_decodes():
    """A mixed step's one-token sequences go to the decode kernel; the prefill kernel's configuration
    follows the longest of the others, not a long decode's context."""
    from nanovllm.engine.step_inputs import mixed_step_decodes
    assert mixed_step_decodes([0, 77, 78, 111, 112], [77, 5000, 81, 3000]) == ([1, 3], 81)
    assert mixed_step_decodes([0, 1, 9], [7, 8]) == ([0], 8)
    assert mixed_step_decodes([0, 4, 9], [4, 6000]) == ([], 6000)


@pytest.mark.parametrize("num_decodes, first", [(0, 0), (3, 0), (4, 4), (5, 4), (11, 8)])
def test_a_mixed_step_with_decodes_first_launches_the_prefill_kernel_from_an_aligned_sequence(num_decodes, first):
    """Decodes first (the usual order): the prefill kernel gets the sequences from the last multiple of 4 at
    or before the first prompt (the decodes before it return at once), as views that keep the 16-byte
    alignment of the uploaded int32 arrays, so that no kernel variant compiles after start-up."""
    import numpy as np
    import torch
    from nanovllm.engine.upload import packed, views
    from nanovllm.layers.attention import AttentionMetadata, MixedDecodes, TritonBackend
    q_lens = [1] * num_decodes + [40, 7]
    seq_lens = [300 + i for i in range(num_decodes)] + [40, 90]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    arrays = [np.arange(len(q_lens) * 3, dtype=np.int32).reshape(len(q_lens), 3), qsl, np.asarray(seq_lens, np.int32)]
    # as upload() lays a step's arrays out: each at a 16-byte boundary of one buffer
    tables, starts, lens = views(packed(arrays, pin_memory=False), arrays)
    launched = {}

    class Kernels:
        def prefill_attention(self, q, k_cache, v_cache, tables, starts, lens, max_query_len, scale, skip_decodes,
                              out):
            launched.update(tables=tables, starts=starts, lens=lens, skip_decodes=skip_decodes)
            return out

        def decode_attention(self, q, k_cache, v_cache, tables, lens, scale, *split, out):
            return out

    backend = TritonBackend()
    backend.kernels, backend.gluon_prefill = Kernels(), None
    decodes = None if num_decodes == 0 else MixedDecodes(
        rows=slice(0, num_decodes), block_tables=tables[:num_decodes], seq_lens=lens[:num_decodes], split=(1, 64),
        max_prefill_seq_len=90)
    meta = AttentionMetadata(slot_mapping=None, block_tables=tables, query_start_loc=starts, seq_lens=lens,
                             query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens, max_query_len=40,
                             max_seq_len=max(seq_lens), decodes=decodes)
    q = torch.zeros(int(qsl[-1]), 2, 16)
    backend(q, None, None, None, None, meta, 1.0, out=torch.empty_like(q))
    assert launched["skip_decodes"] == (num_decodes > 0)
    assert launched["lens"].tolist() == seq_lens[first:]
    assert launched["starts"].tolist() == qsl[first:].tolist()
    assert launched["tables"].tolist() == arrays[0][first:].tolist()
    assert all(t.data_ptr() % 16 == 0 for t in (launched["tables"], launched["starts"], launched["lens"]))
