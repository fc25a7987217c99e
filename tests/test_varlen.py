"""cu_seqlens validation and the derived per-token maps."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flamia_pack.errors import MetadataError
from flamia_pack.varlen import (
    doc_index_per_token,
    max_seqlen,
    position_ids_from_cu_seqlens,
    validate_cu_seqlens,
)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_valid_numpy_and_torch(dtype):
    cu = np.array([0, 3, 5, 9], dtype=dtype)
    assert validate_cu_seqlens(cu, 9).tolist() == [0, 3, 5, 9]
    assert validate_cu_seqlens(torch.from_numpy(cu), 9).tolist() == [0, 3, 5, 9]
    assert max_seqlen(torch.from_numpy(cu)) == 4
    assert validate_cu_seqlens(np.array([0], dtype=dtype), 0).tolist() == [0]


@pytest.mark.parametrize(
    "cu, total, msg",
    [
        (np.array([1, 3], np.int32), None, r"\[0\] must be 0"),
        (np.array([0, 5, 3], np.int32), None, "non-decreasing|strictly increasing"),
        (np.array([0, 3, 3], np.int32), None, "zero-length segment"),
        (np.array([0, 3], np.int32), 4, "must equal the number of tokens T=4"),
        (np.array([0.0, 3.0]), None, "int32 or int64"),
        (torch.tensor([0, 3], dtype=torch.int16), None, "int32 or int64"),
        (np.zeros((2, 2), np.int32), None, "1-D"),
        (np.array([], np.int32), None, "at least one element"),
    ],
)
def test_invalid(cu, total, msg):
    with pytest.raises(MetadataError, match=msg):
        validate_cu_seqlens(cu, total)


def test_empty_segments_allowed_when_asked():
    assert validate_cu_seqlens(np.array([0, 3, 3], np.int64), allow_empty_segments=True).tolist() == [0, 3, 3]


def test_per_token_maps_with_padding():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert doc_index_per_token(cu, 7).tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert position_ids_from_cu_seqlens(cu, 7).tolist() == [0, 1, 2, 0, 1, 0, 1]


@pytest.mark.parametrize(
    "cu, total, msg",
    [
        (torch.tensor([2, 5, 8], dtype=torch.int32), 8, r"\[0\] must be 0"),  # was [-8, -7, 0, ...]
        (torch.tensor([0, 5, 3], dtype=torch.int32), 8, "non-decreasing"),
        (torch.tensor([0.0, 5.0, 8.0]), 8, "int32 or int64"),
        (torch.tensor([0, 5, 8], dtype=torch.int32), 6, "exceeds total_tokens=6"),
        (torch.tensor([[0, 5]], dtype=torch.int32), 5, "1-D"),
        (np.array([0, 5], np.int32), 5, "torch.Tensor"),
        (torch.tensor([0, 5], dtype=torch.int32), -1, "total_tokens must be an integer >= 0"),
        (torch.tensor([0, 5], dtype=torch.int32), 5.0, "total_tokens must be an integer >= 0"),
    ],
)
def test_position_ids_rejects_bad_cu_seqlens(cu, total, msg):
    with pytest.raises(MetadataError, match=msg):
        position_ids_from_cu_seqlens(cu, total)


def test_position_ids_padding_empty_segments_and_validate_false():
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int64)  # an empty segment owns no token
    assert position_ids_from_cu_seqlens(cu, 5).tolist() == [0, 1, 2, 0, 1]
    assert position_ids_from_cu_seqlens(cu, 8).tolist() == [0, 1, 2, 0, 1, 0, 1, 2]  # padding counts on
    # validate=False skips the value checks (no host sync), not the cheap type checks
    assert position_ids_from_cu_seqlens(torch.tensor([0, 3], dtype=torch.int32), 3, validate=False).tolist() == [0, 1, 2]
    with pytest.raises(MetadataError, match="int32 or int64"):
        position_ids_from_cu_seqlens(torch.tensor([0.0, 3.0]), 3, validate=False)


def test_max_seqlen_accepts_lists_and_rejects_floats():
    assert max_seqlen([0, 5, 7]) == 5
    assert max_seqlen((0, 2, 9)) == 7
    assert max_seqlen([0]) == 0
    assert max_seqlen(np.array([0, 4], np.int32)) == 4
    with pytest.raises(MetadataError, match="int32 or int64.*float64"):
        max_seqlen(np.array([0, 2.5, 7.9]))  # was silently truncated to 5
    with pytest.raises(MetadataError, match="int32 or int64"):
        max_seqlen([0, 2.5])
    with pytest.raises(MetadataError, match="int32 or int64"):
        max_seqlen(torch.tensor([0.0, 3.0]))
    with pytest.raises(MetadataError, match="1-D"):
        max_seqlen([[0, 3]])
