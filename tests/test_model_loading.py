"""mpitp.replica.loading's TP checkpoint reads: strided shards through safetensors' pread, contiguous reads from the
mapping."""

import pytest
import torch
from safetensors.torch import save_file

from mpitp.replica.loading import _one_byte_range, strided_shards_with_pread


@pytest.fixture()
def checkpoint(tmp_path):
    tensors = {"w": torch.arange(6 * 10, dtype=torch.float32).reshape(6, 10), "b": torch.arange(4.0)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return str(path), tensors


@pytest.mark.parametrize("index,expected", [
    (Ellipsis, True),
    (slice(1, 3), True),
    ((slice(1, 3), slice(0, 10)), True),
    ((slice(2, 4), slice(None)), True),
    ((slice(0, 6), slice(0, 5)), False),
    ((slice(0, 6), slice(5, 10)), False),
    ((slice(0, 6, 2), slice(0, 10)), False),
    ((1, slice(0, 10)), False),
    ((slice(0, 6), slice(0, 10), slice(0, 1)), False),
])
def test_one_byte_range(index, expected):
    assert _one_byte_range(index, [6, 10]) is expected


def test_reads_match_and_strided_ones_use_pread(checkpoint):
    import transformers.modeling_utils as mu

    path, tensors = checkpoint
    original = mu.safe_open
    with strided_shards_with_pread():
        assert mu.safe_open is not original
        with mu.safe_open(path, framework="pt", device="cpu", backend="mmap") as f:
            assert sorted(f.keys()) == ["b", "w"]
            assert f.metadata() == {"format": "pt"}
            w = f.get_slice("w")
            assert w.get_shape() == [6, 10] and w.get_dtype() == "F32"
            assert torch.equal(w[...], tensors["w"])
            assert torch.equal(w[2:4, 0:10], tensors["w"][2:4])
            assert torch.equal(f.get_slice("b")[...], tensors["b"])
            right = w[0:6, 5:10]
            assert torch.equal(right, tensors["w"][:, 5:10])
            assert right.is_contiguous()  # read with pread; a view of the mapping would be strided
            assert torch.equal(f.get_tensor("w"), tensors["w"])
    assert mu.safe_open is original


def test_restored_after_an_error():
    import transformers.modeling_utils as mu

    original = mu.safe_open
    with pytest.raises(RuntimeError, match="boom"):
        with strided_shards_with_pread():
            raise RuntimeError("boom")
    assert mu.safe_open is original
