"""Launch choices of the Triton attention kernels (plain functions: no GPU needed)."""
from nanovllm.kernels.triton_attention import decode_split_config, tile_size


def test_decode_splits_follow_the_batch_and_the_longest_context():
    # (num_seqs, num_kv_heads, num_sms, max_model_len) -> (most splits, fewest tokens per split)
    assert decode_split_config(1, 8, 132, 4096) == (16, 64)        # one sequence: fine splits
    assert decode_split_config(16, 8, 132, 4096) == (16, 64)       # 128 programs < 132 SMs
    assert decode_split_config(17, 8, 132, 4096) == (16, 256)
    assert decode_split_config(66, 8, 132, 4096) == (4, 1024)      # >= 4 programs per SM
    assert decode_split_config(256, 8, 132, 4096) == (4, 1024)
    assert decode_split_config(256, 8, 132, 40960) == (16, 1024)   # capped at 16
    assert decode_split_config(256, 8, 132, 512) == (1, 1024)      # never more than one needed
    assert decode_split_config(1, 8, 132, 16) == (1, 64)


def test_tiles_divide_the_page():
    assert [tile_size(64, page) for page in (16, 32, 48, 96, 256, 1024)] == [16, 32, 16, 32, 64, 64]
