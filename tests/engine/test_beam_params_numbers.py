"""BeamSearchParams reads numpy's numbers as Python ones, as SamplingParams does: a beam width
computed with numpy (``np.int64(2)``) was refused as "not an int", while the same value in
SamplingParams.max_new_tokens was taken; bools and fractional floats stay refused."""
from __future__ import annotations

import numpy as np
import pytest

from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.errors import BeamSearchParamsError


def test_numpy_numbers_are_read_as_python_numbers():
    params = BeamSearchParams(beam_width=np.int64(2), max_new_tokens=np.int32(4),
                              length_penalty=np.float32(0.5), num_return_beams=np.int64(1),
                              stop_token_ids=[np.int64(3)], temperature=np.float64(0))
    assert params == BeamSearchParams(beam_width=2, max_new_tokens=4, length_penalty=0.5,
                                      num_return_beams=1, stop_token_ids=(3,))
    assert [type(v) for v in (params.beam_width, params.max_new_tokens, params.length_penalty,
                              params.num_return_beams, params.stop_token_ids[0])] == \
        [int, int, float, int, int]


@pytest.mark.parametrize("field, value", [("beam_width", np.float64(2.0)), ("beam_width", True),
                                          ("max_new_tokens", np.bool_(True)),
                                          ("num_return_beams", 1.5)])
def test_bools_and_floats_stay_refused_by_name(field, value):
    with pytest.raises(BeamSearchParamsError) as refused:
        BeamSearchParams(**{"beam_width": 2, field: value})
    assert refused.value.field == field
