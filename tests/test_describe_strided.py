"""fingerprint.describe names strided per-lane sums as strided (issue 25 item 6).

The Metal gemv order: lane l of 32 sums k = 128i + 4l + j (i outer, j = 0..3 inner), then a shuffle-down
ladder over the lanes (lane l adds lane l + off, off = 16, 8, 4, 2, 1). Before, describe called that
"sequential in 32 blocks of 16, blocks combined pairwise", as if each lane summed 16 contiguous terms.
"""

from __future__ import annotations

from gemmdrift import fingerprint as fp


def _gemv_tree(K: int = 512, lanes: int = 32, w: int = 4):
    """The tree built here from the formula, independently of the replay module and of recovery."""
    stride = lanes * w
    chains = [fp.chain([stride * i + w * l + j for i in range(K // stride) for j in range(w)]) for l in range(lanes)]
    acc, off = chains, lanes // 2
    while off:  # shuffle-down: lane l < off takes lane l + off
        acc = [(acc[l], acc[l + off]) for l in range(off)]
        off //= 2
    return fp.canonical(acc[0]), chains


def test_metal_gemv_lanes_are_described_as_strided_with_their_shuffle_down():
    t, _ = _gemv_tree()
    assert fp.describe(t) == ("32 lanes, each sequential over runs of 4 at stride 128, lanes combined pairwise "
                              "(shuffle-down 16, 8, 4, 2, 1)")


def test_strided_lanes_combined_as_neighbours_are_not_called_a_shuffle_down():
    _, chains = _gemv_tree()
    # ((l0 + l1) + (l2 + l3)) ...: pairwise, but lane l meets lane l + 1 first, not lane l + 16
    assert fp.describe(fp.canonical(fp.pairwise(chains))) == (
        "32 lanes, each sequential over runs of 4 at stride 128, lanes combined pairwise")


def test_other_run_widths_and_strides_are_read_off_the_tree():
    t, _ = _gemv_tree(K=256, lanes=8, w=2)  # runs of 2 at stride 16, 16 runs per lane
    assert fp.describe(t) == ("8 lanes, each sequential over runs of 2 at stride 16, lanes combined pairwise "
                              "(shuffle-down 4, 2, 1)")


def test_one_pass_of_contiguous_lanes_stays_blocks():
    """K = 128: each lane sums 4 contiguous terms once; those are blocks, not strided lanes."""
    t, _ = _gemv_tree(K=128)
    assert fp.describe(t) == "sequential in 32 blocks of 4, blocks combined pairwise"


def test_the_replayed_metal_gemv_at_t1_reads_as_strided():
    """gemmdrift's replay of mlx's Metal gemv (kernels/replay_dense.metal_gemv, K=512 < 16N: one simdgroup
    per row), recovered by probing, gets the same description as the tree built above."""
    r = fp.measure(["replay:M3:matmul:bfloat16"], K=512, ts=[1], N=64, draw_k=0, workers=1)
    t = r.tables["fingerprints"]
    row = t[(t["T"] == 1) & (t["status"] == "recovered")].iloc[0]
    assert row["description"] == fp.describe(_gemv_tree()[0])
    assert row["fingerprint"] == fp.fingerprint(_gemv_tree()[0])  # the same tree, not only the same words


def _gemv_groups_tree(K: int, groups: int = 8, lanes: int = 32, w: int = 4):
    """K >= 16N: lane l of simdgroup s adds k = B*i + 4*32*s + 4l + j (B = 1024), each simdgroup a shuffle-down,
    then simdgroup 0 adds the others in order."""
    block = groups * lanes * w
    trees = []
    for s in range(groups):
        acc = [fp.chain([block * i + lanes * w * s + w * l + j for i in range(K // block) for j in range(w)])
               for l in range(lanes)]
        off = lanes // 2
        while off:
            acc = [(acc[l], acc[l + off]) for l in range(off)]
            off //= 2
        trees.append(acc[0])
    return fp.canonical(fp.chain(trees))


def test_simdgroups_added_in_order_are_described_as_groups_of_lanes():
    assert fp.describe(_gemv_groups_tree(1024)) == (
        "8 groups of 32 lanes added one after another; in each group, lanes of 4 contiguous terms combined "
        "pairwise (shuffle-down 16, 8, 4, 2, 1)")
    assert fp.describe(_gemv_groups_tree(2048)) == (
        "8 groups of 32 lanes added one after another; in each group, lanes of runs of 4 at stride 1024 combined "
        "pairwise (shuffle-down 16, 8, 4, 2, 1)")


def test_the_replayed_metal_gemv_with_eight_simdgroups_is_that_tree():
    r = fp.measure(["replay:M3:matmul:bfloat16"], K=1024, ts=[1], N=64, draw_k=0, workers=1)
    row = r.tables["fingerprints"].iloc[0]
    assert row["fingerprint"] == fp.fingerprint(_gemv_groups_tree(1024))
    assert row["description"] == fp.describe(_gemv_groups_tree(1024))
