"""A batch refused part-way gives back the request ids of the requests it withdrew, as it gives
back their seeds ("as if never added"): a beam search whose second prompt's beam group never
fits left the id counter past the withdrawn first, so the next request was numbered 1, not 0."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.errors import RequestRejectedError

from .conftest import model


def test_a_refused_beam_batch_leaves_the_next_request_id_as_it_was():
    with Engine(model("tiny-llama"), cache="paged", block_size=16, cache_bytes=6 * 1024,
                kv_cache_dtype="fp8_e4m3", max_batch=4, max_context=64) as engine:
        with pytest.raises(RequestRejectedError, match="beam search of 3 beams"):
            engine.beam_search([[1, 2, 3], list(range(3, 32))],
                               [BeamSearchParams(2, max_new_tokens=8),
                                BeamSearchParams(3, max_new_tokens=8)])
        assert engine.add_request([1, 2], SamplingParams(max_new_tokens=2)) == 0
