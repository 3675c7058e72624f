"""Arguments of VMemCache's transformers hooks, refused before anything changes: a wrong one
would corrupt every layer's rows or lengths silently (CacheStateError names what was expected)."""
from __future__ import annotations

import torch

from ..errors import CacheStateError


def check_crop_count(tokens_to_remove) -> None:
    """``crop``'s count: a plain int, 0 or less (transformers passes ints; a float or a tensor
    would become the rows' stored lengths)."""
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) \
            or tokens_to_remove > 0:
        raise CacheStateError(f"crop takes a negative count of tokens to remove (a plain int, "
                              f"0 or less), got {tokens_to_remove!r}")


def check_beam_index(beam_idx, batch: int) -> None:
    """``reorder_cache``'s index: a 1-D int64 or int32 tensor (transformers' beam search passes
    int32) of one row in ``[0, batch)`` per row held; a shorter one would broadcast a row over
    the others. The range check reads the index once (one small sync on a GPU)."""
    if not (isinstance(beam_idx, torch.Tensor) and beam_idx.dtype in (torch.int64, torch.int32)
            and beam_idx.shape == (batch,)
            and bool(((beam_idx >= 0) & (beam_idx < batch)).all())):
        raise CacheStateError(f"reorder_cache takes a 1-D int64 or int32 tensor of one row in "
                              f"[0, {batch}) for each of the {batch} rows held, got {beam_idx!r}")
