"""The split-K decode kernel's tile rules (plain Python: the kernel itself is tested on a GPU)."""

import pytest

from tandem.shared.kvcache.triton_decode import choose_partition, choose_warps, triton_cdiv

H200_SMS = 132


@pytest.mark.parametrize("num_seqs, max_context_len, expected", [
    (256, 2048, 1024),  # measured best at batch 256 (0.96 of HBM against 0.85 with 512)
    (64, 2048, 1024),
    (32, 2048, 512),
    (1, 2048, 64),  # batch 1 spreads its context over the most splits
    (1, 16, 64),
])
def test_partition_shrinks_until_the_grid_fills_the_gpu(num_seqs: int, max_context_len: int, expected: int):
    partition = choose_partition(num_seqs, 8, max_context_len, H200_SMS)
    assert partition == expected, f"batch {num_seqs}, bound {max_context_len}: {partition} keys per split"
    programs = num_seqs * 8 * triton_cdiv(max_context_len, partition)
    assert partition == 64 or programs >= 4 * H200_SMS, f"{programs} programs leave SMs idle"


@pytest.mark.parametrize("num_seqs, expected", [
    (256, (2, 3)),
    (32, (2, 3)),  # 256 (sequence, kv head) pairs: measured 43.1 us a layer against 47.8 with four warps
    (17, (2, 3)),  # 136 pairs: one per SM
    (16, (4, None)),
    (1, (4, None)),
])
def test_a_pair_per_sm_takes_two_warps(num_seqs: int, expected: tuple):
    assert choose_warps(num_seqs, 8, H200_SMS) == expected
