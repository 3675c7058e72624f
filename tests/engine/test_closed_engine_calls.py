"""Calls on a closed engine are refused (EngineClosedError), run_until_done included: it
returned silently (``has_unfinished()`` is False once closed), as if every request had ended."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import EngineClosedError

from .conftest import model


@pytest.mark.parametrize("with_request", [False, True])
def test_run_until_done_after_close_raises_engine_closed_error(with_request):
    engine = Engine(model(), max_batch=2, max_context=128, self_check=False)
    rid = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=5)) if with_request else None
    engine.close()
    with pytest.raises(EngineClosedError, match="run_until_done after close"):
        engine.run_until_done()
    if with_request:   # a user's close() still ends a live request "aborted", tokens kept
        output = engine.output(rid)
        assert (output.status, output.error) == ("aborted", None)
        assert [c.finish_reason for c in output.outputs] == ["abort"]
