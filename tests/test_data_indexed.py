"""Megatron .bin/.idx: byte-identical to megatron-core's IndexedDatasetBuilder and read back by its IndexedDataset."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kit.data.indexed import IndexedReader, IndexedWriter, token_dtype

try:  # megatron-core needs Python >= 3.10 and torch >= 2.6: the compat stacks run only the kit-only tests here
    from megatron.core.datasets import indexed_dataset as mcore_indexed
except ImportError:
    mcore_indexed = None
needs_mcore = pytest.mark.skipif(
    mcore_indexed is None,
    reason="megatron-core needs Python >= 3.10 and torch >= 2.6 (not in the compat stacks)",
)


def _docs(seed: int, n: int, high: int):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=int(rng.integers(1, 40))).astype(np.int64) for _ in range(n)]


@needs_mcore
@pytest.mark.parametrize("dtype,high", [(np.uint16, 65_000), (np.int32, 150_000)])
def test_bytes_equal_megatron_builder(tmp_path, dtype, high):
    docs = _docs(1, 57, high)
    kit = IndexedWriter(tmp_path / "kit", dtype)
    ref = mcore_indexed.IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype)
    for i, d in enumerate(docs):
        if i % 5 == 0 and d.size > 3:  # some documents made of several sequences
            lengths = [2, d.size - 2]
            kit.add_document(d, lengths)
            ref.add_document(torch.from_numpy(d), lengths)
        else:
            kit.add_document(d)
            ref.add_item(torch.from_numpy(d))
            ref.end_document()
    kit.finalize()
    ref.finalize(str(tmp_path / "ref.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"kit{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes(), ext


def test_bulk_documents_equal_one_by_one(tmp_path):
    docs = _docs(2, 30, 2000)
    a = IndexedWriter(tmp_path / "a", np.uint16)
    for d in docs:
        a.add_document(d)
    a.finalize()
    b = IndexedWriter(tmp_path / "b", np.uint16)
    b.add_documents(np.concatenate(docs[:10]), [d.size for d in docs[:10]])
    b.add_documents(np.concatenate(docs[10:]), [d.size for d in docs[10:]])
    b.finalize()
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"a{ext}").read_bytes() == (tmp_path / f"b{ext}").read_bytes()


@needs_mcore
def test_megatron_reads_kit_files_exactly(tmp_path):
    docs = _docs(3, 40, 70_000)
    w = IndexedWriter(tmp_path / "kit", np.int32)
    for d in docs:
        w.add_document(d)
    w.finalize()
    ds = mcore_indexed.IndexedDataset(str(tmp_path / "kit"))
    assert len(ds) == len(docs)
    assert list(ds.document_indices) == list(range(len(docs) + 1))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    ours = IndexedReader(tmp_path / "kit")
    assert ours.num_documents == len(docs) and ours.num_tokens == sum(d.size for d in docs)
    np.testing.assert_array_equal(ours[7], docs[7])


@needs_mcore
def test_signed_labels_round_trip(tmp_path):
    labels = np.array([-100, -100, 5, 6, 7, -100], dtype=np.int32)
    w = IndexedWriter(tmp_path / "lab", np.int32)
    w.add_document(labels)
    w.finalize()
    ds = mcore_indexed.IndexedDataset(str(tmp_path / "lab"))  # keep it alive: its items view its mmap
    np.testing.assert_array_equal(ds[0], labels)


def test_uint16_rejects_out_of_range(tmp_path):
    w = IndexedWriter(tmp_path / "x", np.uint16)
    with pytest.raises(ValueError, match="uint16"):
        w.add_document(np.array([1, 70_000]))
    w.abort()
    assert not (tmp_path / "x.bin").exists()


@needs_mcore
def test_token_dtype_follows_megatron():
    assert token_dtype(2522) is np.uint16 and token_dtype(65_499) is np.uint16
    assert token_dtype(65_500) is np.int32 and token_dtype(151_936) is np.int32
    for v in (2522, 65_500):
        assert token_dtype(v) is mcore_indexed.DType.optimal_dtype(v)


def test_reader_rejects_mismatched_pair(tmp_path):
    w = IndexedWriter(tmp_path / "p", np.int32)
    w.add_document(np.arange(10))
    w.finalize()
    with open(tmp_path / "p.bin", "ab") as fh:
        fh.write(b"\0\0\0\0")
    with pytest.raises(ValueError, match="mismatched"):
        IndexedReader(tmp_path / "p")
