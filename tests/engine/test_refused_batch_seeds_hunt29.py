"""A batch the scheduler refuses part-way (a later prompt's LoRA adapter never fits beside it)
withdraws the prompts queued before it, and now also gives back the seeds those drew from the
engine's generator: an unseeded sampled request drew its seed when it was queued, so after
the refused call the next unseeded request drew another one and sampled other tokens than on
an engine that never saw the refused call (found by hunt 29)."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.errors import RequestRejectedError

from ..lora.adapters import MLP, save_adapter
from .conftest import model

PROMPT = [3, 1, 4, 1, 5]
SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)   # no seed
# 16 blocks of 16 tokens: the adapter takes 7, so a 200-token prompt never fits beside it
ENGINE = dict(cache="paged", block_size=16, cache_bytes=16 * 16 * 512, max_batch=4,
              max_context=256)


def test_a_batch_refused_part_way_leaves_the_engines_seeds_as_they_were(tmp_path):
    with Engine(model(), **ENGINE) as engine:
        want = engine.generate([PROMPT], SAMPLED)[0].outputs[0].token_ids
    adapter = save_adapter(model(), tmp_path / "mlp", seed=1, r=8,
                           target_modules=("q_proj", "o_proj") + MLP)
    with Engine(model(), **ENGINE) as engine:
        engine.add_lora("big", adapter)
        with pytest.raises(RequestRejectedError, match="beside adapter 'big'") as refused:
            engine.generate([PROMPT, [7] * 200], [SAMPLED, SamplingParams(max_new_tokens=4,
                                                                          lora="big")])
        assert refused.value.index == 1 and not engine.has_unfinished()
        assert engine.generate([PROMPT], SAMPLED)[0].outputs[0].token_ids == want
