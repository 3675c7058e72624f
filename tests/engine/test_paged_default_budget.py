"""The default cache (``cache_bytes=None``: room for every slot at full length) on the paged
layout holds ``max_context`` in whole blocks: before, a ``max_context`` that is not a multiple of
the block size left each slot up to a block short (a request of max_context tokens "can never
fit", max_batch full-length requests preempted)."""
import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.kv import full_length_tokens
from vmemkv.runtime.models import build_model


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-llama", seed=0)


@pytest.mark.parametrize("max_batch", [1, 3])
def test_max_batch_requests_of_max_context_tokens_run_together_without_preemption(model, max_batch):
    with Engine(model, cache="paged", block_size=16, max_batch=max_batch, max_context=53) as engine:
        outputs = engine.generate([[5] * 41] * max_batch,
                                  SamplingParams(max_new_tokens=12, ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in outputs] == [12] * max_batch
        assert engine.last_stats.num_preemptions == 0
        assert engine.cache_bytes == max_batch * 64 * engine.cache_config.bytes_per_token


def test_full_length_tokens_rounds_paged_slots_to_whole_blocks_only():
    assert full_length_tokens(53, "paged", 16) == 64
    assert full_length_tokens(64, "paged", 16) == 64
    assert full_length_tokens(53, "vmem", 16) == 53      # vmem: rounded to pages by its caller
