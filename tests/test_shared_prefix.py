"""The decode step's plan of shared prefixes (engine/shared_prefix.py): which runs of sequences share
which pages, in what tiles. Pages of 16 tokens."""
import numpy as np

from nanovllm.engine.shared_prefix import max_tiles, plan_arrays, plan_shared_prefixes


def plan(tables, seq_lens, seqs_per_tile=8, min_saved_share=0.0):
    width = max(len(t) for t in tables)
    padded = np.array([t + [0] * (width - len(t)) for t in tables], np.int32)
    return plan_shared_prefixes(padded, seq_lens, 16, seqs_per_tile, min_saved_share)


def test_runs_of_sequences_that_begin_with_the_same_pages():
    tables = [[5, 6, 7, 8], [5, 6, 7, 9, 10], [5, 6, 7, 11], [1, 2]]       # the module docstring's example
    p = plan(tables, [3 * 16 + 5, 4 * 16 + 2, 3 * 16 + 1, 20])
    assert p.prefix_lens.tolist() == [48, 48, 48, 0]
    assert p.tiles.tolist() == [[0, 3, 48]]
    assert p.prefix_lens.dtype == p.tiles.dtype == np.int32


def test_the_page_holding_a_sequences_newest_token_is_never_shared():
    tables = [[5, 6, 7, 8], [5, 6, 7, 9, 10]]
    assert plan(tables, [3 * 16, 4 * 16 + 2]).prefix_lens.tolist() == [32, 32]      # token 47 is in page 7
    assert plan(tables, [16, 4 * 16 + 2]) is None                                  # page 5 holds token 15


def test_padding_pages_are_not_shared():
    assert plan([[3], [4]], [9, 12]) is None      # both tables padded with page 0


def test_a_run_ends_where_the_next_sequence_shares_fewer_pages():
    tables = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7], [1, 2, 8, 9], [9]]
    p = plan(tables, [60, 60, 60, 60, 5])
    assert p.prefix_lens.tolist() == [48, 48, 32, 32, 0]
    assert p.tiles.tolist() == [[0, 2, 48], [2, 2, 32]]


def test_long_runs_are_cut_into_tiles():
    p = plan([[1, 2, 3]] * 7, [40] * 7, seqs_per_tile=3)
    assert p.prefix_lens.tolist() == [32] * 7
    assert p.tiles.tolist() == [[0, 3, 32], [3, 3, 32], [6, 1, 32]]


def test_no_plan_where_sharing_saves_too_little():
    tables = [[1, 2, 3], [1, 4, 5]]             # one page of 16 shared: 16 of 80 context tokens saved
    assert plan(tables, [40, 40], min_saved_share=0.25) is None
    assert plan(tables, [40, 40], min_saved_share=0.2).prefix_lens.tolist() == [16, 16]
    assert plan([[1, 2]], [20]) is None          # one sequence


def test_plans_fit_the_tiles_a_graph_is_captured_for():
    """max_tiles bounds every plan of that many sequences (runs of random lengths, tiles of 1-5)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        num_seqs, seqs_per_tile = int(rng.integers(2, 40)), int(rng.integers(1, 6))
        tables, page = [], 100
        while len(tables) < num_seqs:       # runs of 1-7 sequences sharing 1-3 pages
            run, shared = int(rng.integers(1, 8)), [page + i for i in range(int(rng.integers(1, 4)))]
            page += 10
            tables += [shared + [page + i] for i in range(run)]
            page += 10
        tables = tables[:num_seqs]
        p = plan(tables, [16 * len(t) - 3 for t in tables], seqs_per_tile)
        if p is not None:
            assert len(p.tiles) <= max_tiles(num_seqs, seqs_per_tile)
    assert [max_tiles(n, 32) for n in (2, 3, 16, 256, 512)] == [2, 2, 9, 136, 272]


def test_plan_arrays_pad_with_rows_and_tiles_that_read_nothing():
    """What the kernels read: the plan's prefix lengths and tiles, then zeros up to the sizes asked
    for (a graph bucket's rows, its most tiles), and the count of tiles in use; no plan: zeros."""
    p = plan([[5, 6, 7, 8], [5, 6, 7, 9, 10], [5, 6, 7, 11], [1, 2]], [60, 70, 60, 20])
    prefix_lens, tiles, count = plan_arrays(p, 6, 3)
    assert prefix_lens.tolist() == [48, 48, 48, 0, 0, 0] and prefix_lens.dtype == np.int32
    assert tiles.tolist() == [[0, 3, 48], [0, 0, 0], [0, 0, 0]] and tiles.dtype == np.int32
    assert count.tolist() == [1] and count.dtype == np.int32
    exact = plan_arrays(p, 4, 1)
    assert [a.tolist() for a in exact] == [[48, 48, 48, 0], [[0, 3, 48]], [1]]
    assert [a.tolist() for a in plan_arrays(None, 2, 1)] == [[0, 0], [[0, 0, 0]], [0]]
