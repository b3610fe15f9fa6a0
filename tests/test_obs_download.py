"""kit.storage.obs_download's CRC-32 combination (no OBS SDK needed): the part CRCs of a parallel download give the whole
file's CRC-32, as zlib computes it over the bytes in one pass."""

from __future__ import annotations

import random
import zlib

import pytest

from kit.storage.obs_download import crc32_combine


@pytest.mark.parametrize("sizes", [[0], [1, 0, 7], [9 << 20, 9 << 20, 2 << 20], [4099, 65536, 1, 300000]])
def test_part_crcs_combine_into_the_crc_of_the_whole(sizes):
    rng = random.Random(sum(sizes))
    parts = [rng.randbytes(n) for n in sizes]
    crc = 0
    for part in parts:
        crc = crc32_combine(crc, zlib.crc32(part), len(part))
    assert crc == zlib.crc32(b"".join(parts))
    if sum(sizes):  # and one flipped bit anywhere changes it
        whole = bytearray(b"".join(parts))
        whole[rng.randrange(len(whole))] ^= 1 << rng.randrange(8)
        assert crc != zlib.crc32(bytes(whole))
