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
