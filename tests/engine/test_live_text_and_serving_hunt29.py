"""Found by a user's-eye hunt of the engine API (hunt 29):

- a live request's output (``Engine.output`` between steps, or what a raising ``generate``
  leaves) had ``text`` None on every sample though its tokens were there and its TokenEvents
  had shown their text ("with a tokenizer every sample has text", docs/usage.md); it now
  carries what the events showed so far ("" before the first token);
- ``EngineStats.serving`` counted an aborted request as "completed", with its tokens and
  latencies, while ``requests`` and ``prompt_tokens`` beside it left it out (vLLM's benchmark
  counts only successful requests)."""
from __future__ import annotations

from vmemkv.runtime.engine import Engine, SamplingParams

from .byte_tokenizer import byte_tokenizer
from .conftest import model

A = ord("a")
ALL_A = dict(max_new_tokens=6, ignore_eos=True, logit_bias={A: 100.0})   # every token is "a"


def test_a_live_samples_output_carries_the_text_its_events_showed():
    with Engine(model(), byte_tokenizer(), max_batch=4, max_context=64) as engine:
        plain = engine.add_request("hi", SamplingParams(**ALL_A))
        held = engine.add_request("hi", SamplingParams(stop=["zzz"], **ALL_A))
        assert [engine.output(r).outputs[0].text for r in (plain, held)] == ["", ""]
        events = engine.step() + engine.step() + engine.step()
        shown = {r: "".join(e.text for e in events if e.request_id == r) for r in (plain, held)}
        assert shown == {plain: "aaa", held: "a"}       # "zzz" holds the last 2 characters back
        live = {r: engine.output(r) for r in (plain, held)}
        assert all(out.status == "unfinished" for out in live.values())
        assert {r: out.outputs[0].text for r, out in live.items()} == shown
        engine.run_until_done()
        assert [engine.output(r).outputs[0].text for r in (plain, held)] == ["a" * 6] * 2


def test_the_serving_report_counts_only_the_requests_that_finished():
    prompt_kept, prompt_cut = [3, 1, 4, 1, 5], [2, 7, 1]
    with Engine(model(), max_batch=4, max_context=64) as engine:
        def abort_after_two(event):
            out = engine.output(event.request_id)
            if out.prompt_token_ids == tuple(prompt_cut) and len(out.outputs[0].token_ids) == 2:
                engine.abort(event.request_id)

        kept, cut = engine.generate([prompt_kept, prompt_cut],
                                    SamplingParams(max_new_tokens=6, ignore_eos=True),
                                    on_token=abort_after_two)
        stats = engine.last_stats
    assert (kept.status, cut.status, len(cut.outputs[0].token_ids)) == ("finished", "aborted", 2)
    assert stats.requests == stats.serving["completed"] == 1
    assert stats.prompt_tokens == stats.serving["total_input_tokens"] == len(prompt_kept)
    assert stats.serving["total_output_tokens"] == len(kept.outputs[0].token_ids) == 6
