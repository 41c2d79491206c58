"""The grouping of a mixture-of-experts layer's assignments by expert (kernels/triton_moe.py), in
its plain-torch form, which runs on the CPU; the routing, placement and product kernels are tested
against it and against the per-expert loop in test_triton_kernels.py."""
import pytest
import torch

from nanovllm.kernels.triton_moe import block_m_for, group_by_expert


def test_group_by_expert_pads_each_experts_run_to_whole_blocks():
    ids = torch.tensor([[0, 3], [3, 1], [0, 3]])     # assignments 0-5, token-major
    sorted_ids, block_expert = group_by_expert(ids, num_experts=5, block_m=2)
    pad = 6
    assert sorted_ids.tolist() == [0, 4, 3, pad, 1, 2, 5, pad] + [pad] * 8   # e0 | e1 | e3 e3 | unused
    assert block_expert.tolist() == [0, 1, 3, 3, 5, 5, 5, 5]                # 5: past the last used block
    assert sorted_ids.dtype == block_expert.dtype == torch.int32


@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m", [(1, 8, 2, 16), (37, 8, 3, 16), (300, 6, 2, 64)])
def test_group_by_expert_places_every_assignment_once_in_a_block_of_its_expert(num_tokens, num_experts, top_k,
                                                                               block_m):
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, -1).indices
    sorted_ids, block_expert = group_by_expert(ids, num_experts, block_m)
    num_assignments = num_tokens * top_k
    assert block_expert.numel() == -(-num_assignments // block_m) + min(num_experts, num_assignments)
    assert sorted_ids.numel() == block_expert.numel() * block_m
    real = sorted_ids < num_assignments
    assert sorted(sorted_ids[real].tolist()) == list(range(num_assignments))
    expert_of_row = block_expert.repeat_interleave(block_m)
    assert torch.equal(expert_of_row[real], ids.flatten()[sorted_ids[real].long()])
    used = block_expert < num_experts                  # used blocks first, each expert's together, in order
    assert used.tolist() == sorted(used.tolist(), reverse=True)
    assert block_expert[used].tolist() == sorted(block_expert[used].tolist())
    assert real.view(-1, block_m).any(1).tolist() == used.tolist()   # no used block is all padding


def test_block_m_grows_with_the_rows_per_expert():
    assert [block_m_for(a, 128) for a in (8, 2048, 4096, 4224, 16384)] == [16, 16, 32, 128, 128]
