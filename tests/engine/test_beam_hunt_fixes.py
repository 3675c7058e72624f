"""Beam search as a neighbour of another, and its text (hunt_beam's reproductions).

- A beam group recomputed after a neighbour preempted it comes back holding what it held while
  it ran: a vmem pool whose page groups are backed by their bytes (tiny-gemma3 interleaved, 4 KiB
  pages: a 16-token group spans 3 pages of each member) holds each beam's partial newest group in
  the pages its tokens need. Re-admission sized every beam's tail as a whole 16-token group (17
  shared + 4 x 16 = 80 tokens in a 42-token pool), so the group that finished alone failed in the
  batch ("cannot be admitted to an empty cache"); alone it holds the shared group once and two
  pages a beam (14 of the pool's 16 pages).
- ``BeamSearchParams.skip_special_tokens`` (default True, as SamplingParams'): a beam's text
  keeps special tokens when it is False; it was always decoded with True.
"""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from vmemkv.runtime.engine import Engine
from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.errors import BeamSearchParamsError

from ..serve.conftest import assert_memory_at_baseline
from .byte_tokenizer import _byte_chars
from .conftest import model

BYTES_BACKED = dict(cache="vmem", layout="interleaved", page_bytes=4096, cache_bytes=64 * 1024,
                    max_batch=16, max_context=64, check_integrity=True)
PARAMS = BeamSearchParams(4, max_new_tokens=2, ignore_eos=True)


def _search(batch, preemption: str):
    swap = dict(swap_bytes=256 * 1024) if preemption == "swap" else {}
    with Engine(model("tiny-gemma3"), preemption=preemption, **BYTES_BACKED, **swap) as engine:
        assert engine.kv.manager.stats().total_tokens == 42
        out = engine.beam_search(batch, PARAMS)
        assert_memory_at_baseline(engine)
        return out, engine.last_stats.num_preemptions


def special_byte_tokenizer() -> PreTrainedTokenizerFast:
    """byte_tokenizer's ids (id == byte), every byte >= 128 a special token."""
    chars = _byte_chars()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"additional_special_tokens": [chars[b] for b in range(128, 256)]})
    assert len(fast) == 256
    return fast


def _beams(output):
    return [(c.token_ids, round(c.beam_score, 4)) for c in output.outputs]


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_beam_group_preempted_by_a_neighbour_comes_back_as_it_ran_alone(preemption):
    rng = random.Random(5)
    batch = [[rng.randrange(256) for _ in range(17)] for _ in range(2)]
    together, preemptions = _search(batch, preemption)
    assert preemptions == 4                       # the second group, preempted whole
    assert [o.status for o in together] == ["finished", "finished"]    # the second had failed
    alone = [_search([prompt], preemption)[0][0] for prompt in batch]
    assert [_beams(o) for o in together] == [_beams(o) for o in alone]
    assert all(len(o.outputs) == 4 for o in together)


@pytest.mark.parametrize("skip", [True, False])
def test_a_beams_text_skips_special_tokens_as_its_params_say(skip):
    tokenizer = special_byte_tokenizer()          # every byte >= 128 a special token
    params = BeamSearchParams(2, max_new_tokens=8, ignore_eos=True, skip_special_tokens=skip)
    with Engine(model(), tokenizer, cache="vmem", page_bytes=4096, max_batch=8,
                max_context=64) as engine:
        (out,) = engine.beam_search([tokenizer.encode("hello")], params)
    for beam in out.outputs:
        assert any(t >= 128 for t in beam.token_ids)      # special tokens to keep or skip
        assert beam.text == tokenizer.decode(beam.token_ids, skip_special_tokens=skip)
    kept = tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=False)
    assert (out.outputs[0].text == kept) is not skip


def test_skip_special_tokens_defaults_to_true_and_must_be_a_bool():
    assert BeamSearchParams(2).skip_special_tokens is True
    with pytest.raises(BeamSearchParamsError) as refused:
        BeamSearchParams(2, skip_special_tokens="no")
    assert refused.value.field == "skip_special_tokens"
    assert str(refused.value) == "BeamSearchParams.skip_special_tokens must be a bool, got 'no'"
