"""Beam search parameters: one beam is greedy decoding, whatever ``early_stopping`` says
(transformers' generate(num_beams=1)); bad parameters are refused by field before anything is
queued."""
from __future__ import annotations

import pytest

from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.engine.beam_params import BeamSearchParams
from vmemkv.runtime.engine.errors import BeamSearchParamsError

from .conftest import model, prompts
from .test_beam_search import run


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_one_beam_is_greedy_decoding_whatever_early_stopping_says(early_stopping):
    # transformers' generate(num_beams=1) is greedy; with "never" and a positive length
    # penalty one beam went on past its end-of-sequence token (20 tokens against greedy's 1)
    batch = [[9, 2, 6]] + prompts(2, 3, 20, seed=11)   # the first's greedy token is the EOS
    params = BeamSearchParams(1, max_new_tokens=20, early_stopping=early_stopping)
    out, _ = run("tiny-llama", batch, params, cache="paged", block_size=4)
    with Engine(model("tiny-llama"), max_context=128, cache="paged", block_size=4) as engine:
        greedy = engine.generate(batch, SamplingParams(max_new_tokens=20))
    assert [o.outputs[0].token_ids for o in out] == [g.outputs[0].token_ids for g in greedy]
    assert len(greedy[0].outputs[0].token_ids) == 1


@pytest.mark.parametrize("fields,field", [
    (dict(beam_width=0), "beam_width"), (dict(beam_width=2, num_return_beams=3), "num_return_beams"),
    (dict(beam_width=2, temperature=0.8), "temperature"),
    (dict(beam_width=2, early_stopping="sometimes"), "early_stopping"),
    (dict(beam_width=2, max_new_tokens=0), "max_new_tokens"),
    (dict(beam_width=2, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, cache_salt=3), "cache_salt")])
def test_bad_params_raise_naming_the_field(fields, field):
    with pytest.raises(BeamSearchParamsError) as error:
        BeamSearchParams(**fields)
    assert error.value.field == field


def test_beam_width_past_max_batch_is_refused_before_anything_is_queued():
    with Engine(model(), max_batch=4, max_context=64) as engine:
        with pytest.raises(BeamSearchParamsError, match="max_batch") as error:
            engine.beam_search([[1, 2, 3], [4, 5]], BeamSearchParams(5, max_new_tokens=4))
        assert error.value.field == "beam_width"
        assert not engine.has_unfinished() and engine.kv.manager.stats().live_tokens == 0


def test_beam_searches_with_different_cache_salts_never_share_a_prefix():
    # the salt was dropped: a beam search hit every cached unit of another tenant's prompt
    prompt = list(range(10, 58))
    with Engine(model(), cache="paged", block_size=4, max_batch=8, max_context=128,
                prefix_sharing=True) as engine:
        def hits(salt):
            engine.beam_search([prompt], BeamSearchParams(2, max_new_tokens=2, cache_salt=salt))
            return engine.last_stats.prefix_cache_hits
        assert hits("tenant-a") == 0
        assert hits("tenant-b") == 0 and hits(None) == 0
        assert hits("tenant-a") >= len(prompt) - 4        # the same salt still shares


@pytest.mark.parametrize("max_new_tokens", [1, 3])
def test_a_beam_searchs_stats_count_every_beams_tokens(max_new_tokens):
    # the tokens that end hypotheses are never appended to a sequence: output_tokens missed
    # them (0 for one-token beams, 16 of 24 for three-token ones), and the serving report
    # skipped beam outputs, which had no token times ('completed': 0)
    params = BeamSearchParams(4, max_new_tokens=max_new_tokens, ignore_eos=True)
    out, stats = run("tiny-llama", [[1, 2, 3], [4, 5, 6]], params)
    tokens = sum(len(c.token_ids) for o in out for c in o.outputs)
    assert tokens == 2 * 4 * max_new_tokens == stats.output_tokens
    # a request counts once, every beam's tokens in the throughputs (as the simulator counts)
    assert stats.serving["completed"] == 2 and stats.serving["total_output_tokens"] == tokens
    for o in out:      # outputs arrive whole: every token at the step its group is done
        times = {t for c in o.outputs for t in c.token_times_s}
        assert len(times) == 1 and times.pop() >= o.arrival_s
