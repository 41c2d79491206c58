"""The piecewise CUDA graphs' plain parts (no GPU needed): their buckets and the cut at attention.
Their capture and replay are GPU tests (test_gpu.py: every engine test runs its prompt steps
through them)."""
import pytest
import torch

from nanovllm.engine.piecewise_graphs import MAX_TOKENS, piecewise_buckets
from nanovllm.layers import attention
from nanovllm.layers.attention import Attention, split_at_attention


def test_buckets_pad_a_step_above_512_tokens_by_at_most_a_quarter():
    assert piecewise_buckets(MAX_TOKENS) == [16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792,
                                             2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192, 10240, 12288,
                                             14336, 16384]
    buckets = piecewise_buckets(MAX_TOKENS)
    for below, bucket in zip(buckets[6:], buckets[7:]):
        assert bucket - below <= below / 4   # a step of below + 1 tokens replays bucket


def test_buckets_end_at_the_largest_step():
    assert piecewise_buckets(300) == [16, 32, 64, 128, 256, 300]
    assert piecewise_buckets(256) == [16, 32, 64, 128, 256]
    assert piecewise_buckets(8) == [8]


def test_attention_inside_a_split_hands_its_query_to_the_cut():
    layer = Attention(num_heads=2, head_dim=4, scale=0.5, num_kv_heads=1)
    q = torch.randn(3, 2, 4)
    seen = []
    with split_at_attention(lambda cut_layer, cut_q: seen.append((cut_layer, cut_q)) or cut_q * 2, torch.zeros(8, 8)):
        out = layer(q, None, None, meta=None)
    assert len(seen) == 1 and seen[0][0] is layer and seen[0][1] is q
    assert torch.equal(out, q * 2)
    assert attention._cut is None


def test_the_cut_is_gone_after_an_error_inside_the_split():
    with pytest.raises(RuntimeError):
        with split_at_attention(lambda cut_layer, cut_q: cut_q, torch.zeros(8, 8)):
            raise RuntimeError("capture failed")
    assert attention._cut is None and attention._query_buffer is None


def test_a_split_takes_only_layers_whose_kv_is_stored():
    layer = Attention(num_heads=2, head_dim=4, scale=0.5, num_kv_heads=1)
    q, kv = torch.randn(3, 2, 4), torch.randn(3, 1, 4)
    with split_at_attention(lambda cut_layer, cut_q: cut_q, torch.zeros(8, 8)), pytest.raises(AssertionError):
        layer(q, kv, kv, meta=None)


def test_inside_a_split_a_layer_asks_for_its_query_in_the_static_buffer():
    layer = Attention(num_heads=2, head_dim=4, scale=0.5, num_kv_heads=1)
    assert layer.query_out(3) is None                                   # outside: anywhere
    static = torch.zeros(8, 8)
    with split_at_attention(lambda cut_layer, cut_q: cut_q, static):
        q = layer.query_out(3)
        assert q.shape == (3, 2, 4) and q.data_ptr() == static.data_ptr()
        q.fill_(1.0)
    assert static[:3].eq(1).all() and not static[3:].any()
    assert layer.query_out(3) is None
