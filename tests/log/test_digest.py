"""`digest.span_hashes` hashes many spans in one compiled call: XXH64 with a seed as the
xxHash library computes it (its Python twin), for every length path of the hash and for
seeds with every bit set; and `sums_by_code` sums them per code mod 2**64 exactly, as
Python's integers do."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from wbmerge.log import digest

# seed 0, xxHash's default; one with the top bit set (where a signed C type would
# differ); every bit set
SEEDS = [0, 0x9E3779B97F4A7C15, (1 << 64) - 1]


@pytest.mark.parametrize("seed", SEEDS)
def test_the_hashers_give_the_xxhash_librarys_numbers(seed):
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 20_000, np.uint8).tobytes()
    # every length from 0 to 130 (the 32-byte stripes, the 8-, 4- and 1-byte tails), at
    # every alignment, and some long spans
    starts = np.concatenate([np.arange(131) * 97 % 7000, rng.integers(0, 9000, 200)])
    ends = starts + np.concatenate([np.arange(131), rng.integers(0, 11_000, 200)])
    expected = [xxhash.xxh64_intdigest(data[a:b], seed) for a, b in zip(starts, ends, strict=True)]
    assert len(set(expected)) == len(expected)
    for hasher in digest.HASHERS:
        found = digest.span_hashes(data, starts, ends, seed, hasher)
        assert found.dtype == np.uint64 and found.tolist() == expected, hasher
    assert digest.hash_of(data[starts[40] : ends[40]], seed) == expected[40]
    assert digest.hash_of(b"", seed) == xxhash.xxh64_intdigest(b"", seed)


def test_another_seed_gives_other_hashes():
    data = b"0.1250.250" * 10
    starts, ends = np.array([0, 0, 5, 3]), np.array([5, 100, 10, 64])
    for hasher in digest.HASHERS:
        by_seed = [digest.span_hashes(data, starts, ends, seed, hasher).tolist() for seed in SEEDS]
        assert all(not set(a) & set(b) for a in by_seed for b in by_seed if a is not b)


def test_random_seeds_are_64_bits_and_differ():
    seeds = {digest.random_seed() for _ in range(64)}
    assert len(seeds) == 64 and all(0 <= seed < 1 << 64 for seed in seeds)
    assert max(seeds) >= 1 << 60  # (not a small number: 2**-4 odds each)


def test_the_compiled_hashes_are_built_here():
    """(The suite runs with the kernels built, so the tests above compare both.)"""
    assert "compiled" in digest.HASHERS


@pytest.mark.parametrize("hasher", sorted(digest.HASHERS))
def test_a_span_outside_the_data_is_refused(hasher):
    for starts, ends in (([0], [11]), ([-1], [3]), ([5], [4])):
        with pytest.raises(ValueError, match="outside"):
            digest.span_hashes(b"0123456789", np.array(starts), np.array(ends), hasher=hasher)
    assert digest.span_hashes(b"", np.array([0]), np.array([0]), hasher=hasher).tolist() == [
        xxhash.xxh64_intdigest(b"")
    ]


@pytest.mark.parametrize("seed", [-1, 1 << 64])
def test_a_seed_that_is_not_64_bits_is_refused(seed):
    with pytest.raises(ValueError, match="64 bits"):
        digest.span_hashes(b"0", np.array([0]), np.array([1]), seed)
    with pytest.raises(ValueError, match="64 bits"):
        digest.hash_of(b"0", seed)


def test_sums_by_code_are_exact_mod_2_64():
    rng = np.random.default_rng(3)
    count = (1 << 20) + 12_345  # (more than one of the float halves' parts)
    hashes = rng.integers(0, 1 << 64, count, np.uint64, endpoint=False)
    hashes[:1000] = np.uint64((1 << 64) - 1)  # (the largest, where a sum wraps around)
    codes = rng.integers(0, 5, count)
    codes[:1000] = 2
    sums = digest.sums_by_code(codes, hashes, 7)
    expected = [0] * 7
    for code, value in zip(codes.tolist(), hashes.tolist(), strict=True):
        expected[code] = (expected[code] + value) % (1 << 64)
    assert sums.dtype == np.uint64 and sums.tolist() == expected
    assert sums[5:].tolist() == [0, 0]
