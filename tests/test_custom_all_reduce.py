"""The symmetric-memory all-reduce's start-up self-check, on the CPU with stand-in reducers: a sum
added in bf16 rank by rank (as the kernels add) passes at 2, 4 and 8 ranks; a wrong sum fails."""
import pytest
import torch

from nanovllm.custom_all_reduce import _sums_correctly


def part(rank: int, numel: int) -> torch.Tensor:   # the self-check's own inputs
    gen = torch.Generator().manual_seed(1234 + rank)
    return torch.randn(numel, generator=gen).to(torch.bfloat16)


class Bf16Sum:
    def __init__(self, ranks: list[int]):
        self.ranks = ranks

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        total = part(self.ranks[0], x.numel())
        for rank in self.ranks[1:]:
            total = total + part(rank, x.numel())        # rounded to bf16 after every addition
        return x.copy_(total)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_bf16_sums_pass(size):
    assert _sums_correctly(Bf16Sum(list(range(size))), 0, size, torch.device("cpu"))


@pytest.mark.parametrize("size", [2, 4, 8])
def test_wrong_sums_fail(size):
    assert not _sums_correctly(Bf16Sum(list(range(size - 1))), 0, size, torch.device("cpu"))   # a rank missing
    assert not _sums_correctly(Bf16Sum([0] + list(range(size))), 0, size, torch.device("cpu"))  # one counted twice
