"""A request with a LoRA adapter on an engine a MemoryBudget resizes is judged against the
pool grown to its reach (the share's max, less the other shares' minimums), its adapter's pages
taken out of what the reach leaves, as a request without one is (test_budget_reach_length.py):
one longer than the pool has held so far runs while the pool grows (it was refused as "can
never fit" against the 16 KiB the pool had held), one past the reach is refused naming it, and
the server's limit beside the adapter (/v1/models' max_model_len) is the engine's check (it
was the adapter's tokens at max_cache_bytes, whatever the reach or the engine's check).

tiny-llama, 4 KiB pages interleaved: 512 bytes a token, so 128 KiB hold 256 tokens and the
256 KiB max 512; the adapter (rank 4 on q_proj and v_proj, 7,168 bytes) takes 2 pages, 16
tokens: 240 beside it at 128 KiB, 496 at 256 KiB."""
from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")

from vmemkv.runtime.engine import Engine, SamplingParams  # noqa: E402
from vmemkv.runtime.engine.errors import RequestRejectedError  # noqa: E402
from vmemkv.runtime.serve.completions import ServedModel  # noqa: E402
from vmemkv.scheduler.budget import MemoryBudget  # noqa: E402

from .conftest import model  # noqa: E402
from .test_budget_reach_length import _run, _run_to_end  # noqa: E402

KiB = 1024
OPTS = dict(page_bytes=4096, layout="interleaved", max_batch=4)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> str:
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             init_lora_weights=False)
    folder = tmp_path_factory.mktemp("reach-adapter") / "a"
    peft.get_peft_model(copy.deepcopy(model("tiny-llama")), config).save_pretrained(str(folder))
    return str(folder)


def _engine(adapter_dir: str, budget_kib=None, **sizes) -> Engine:
    """tiny-llama with adapter "a" loaded: on a MemoryBudget of ``budget_kib`` (a 16 KiB pool
    that may grow to 256 KiB), or without one at ``sizes``."""
    if budget_kib is not None:
        sizes = dict(memory_budget=MemoryBudget(budget_kib * KiB, clock=lambda: 0.0),
                     cache_bytes=16 * KiB, max_cache_bytes=256 * KiB)
    engine = Engine(model("tiny-llama"), max_context=1024, **sizes, **OPTS)
    engine.add_lora("a", adapter_dir)
    return engine


def _params(new_tokens: int = 8, lora="a") -> SamplingParams:
    return SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, lora=lora)


def test_a_request_beside_its_adapter_longer_than_the_pool_has_held_runs_as_it_grows(
        adapter_dir):
    """108 tokens beside the adapter on a 16 KiB pool (16 tokens beside it) with 256 KiB in
    reach: accepted, the pool grows, and the tokens are those of an engine built at 256 KiB
    without a budget (and not the base model's). Past the 496 the max holds beside it: "can
    never fit", naming the max."""
    prompt = [(j * 7) % 250 + 1 for j in range(100)]
    with _engine(adapter_dir, budget_kib=1024) as engine:
        status, error, got = _run(engine, prompt, _params())
        assert (status, error) == ("finished", None)
        assert 16 * KiB < engine.cache_bytes <= 256 * KiB
        with pytest.raises(RequestRejectedError, match=(
                r"497 tokens beside adapter 'a' .* can never fit; the cache holds 496 tokens "
                r"of one sequence beside it at its max \(262144 bytes\)")):
            engine.add_request([5] * 489, _params())
        assert not engine.has_unfinished()
    with _engine(adapter_dir, cache_bytes=256 * KiB) as fixed:
        assert _run(fixed, prompt, _params()) == ("finished", None, got)
        assert _run(fixed, prompt, _params(lora=None))[2] != got
    assert len(got) == 8


def test_a_request_beside_its_adapter_past_the_reach_is_refused_naming_it(adapter_dir):
    """A neighbour reserving 192 KiB of 320 leaves 128 KiB: 240 tokens beside the adapter.
    241 are refused naming that reach and the 496 of the max, nothing changes; 240 run."""
    with _engine(adapter_dir, budget_kib=320) as engine:
        budget = engine.memory_share.budget
        budget.register("neighbour", 192 * KiB, 192 * KiB)
        held, gauges = budget.held_bytes, engine.scheduler.gauges()
        with pytest.raises(RequestRejectedError, match=(
                r"241 tokens beside adapter 'a' \(\w+, 7168 bytes\) do not fit the 240 tokens "
                r"of one sequence its cache holds beside it grown to the 131072 bytes its "
                r"MemoryBudget share can reach now \(the budget's 327680 less the other "
                r"shares' minimums; at its max, 262144 bytes, it would hold 496\)")) as refused:
            engine.add_request([5] * 233, _params())
        assert refused.value.field == "max_new_tokens"
        assert not engine.has_unfinished()
        assert (budget.held_bytes, engine.cache_bytes) == (held, 16 * KiB)
        assert engine.scheduler.gauges() == gauges
        status, error, got = _run(engine, [5] * 232, _params())
        assert (status, error, len(got)) == ("finished", None, 8)


def test_the_servers_limit_beside_an_adapter_is_the_engines_check(adapter_dir):
    """/v1/models' max_model_len of the adapter and its per-request limit are what the engine
    accepts, read when asked: 496 with the whole max in reach (the engine refused all but 16,
    what the pool had held), 240 once a neighbour reserves 192 KiB of 320 (it said 496); a
    request of that many tokens is accepted, one more refused."""
    with _engine(adapter_dir, budget_kib=320) as engine:
        served = ServedModel.of(engine, "tiny-llama")
        for limit in (496, 240):
            if limit == 240:
                engine.memory_share.budget.register("neighbour", 192 * KiB, 192 * KiB)
            assert (served.adapter_limits(), served.limit_for(100, "a")) == ({"a": limit}, limit)
            with pytest.raises(RequestRejectedError, match=f"{limit + 1} tokens beside adapter"):
                engine.add_request([5] * (limit - 7), _params())
            rid = engine.add_request([5] * (limit - 8), _params())
            assert engine.abort(rid).status == "aborted"
            assert not engine.has_unfinished()


@pytest.mark.parametrize("lora, holds, at_max", [("a", 240, 496), (None, 256, 512)])
def test_a_request_the_reach_shrank_under_ends_failed_naming_the_reach_not_the_max(
        adapter_dir, lora, holds, at_max):
    """400 tokens (beside the adapter, or without one) accepted with 256 KiB in reach; a
    neighbour then reserves 192 KiB of 320: the request ends failed once it cannot grow past
    the 128 KiB reach, its message naming that reach, the max and what each holds beside the
    adapter (it said "(its max)" of a pool stopped at 128 KiB, and 256 tokens beside it)."""
    with _engine(adapter_dir, budget_kib=320) as engine:
        rid = engine.add_request([5] * 100, _params(300, lora))
        engine.memory_share.budget.register("neighbour", 192 * KiB, 192 * KiB)
        status, error, got = _run_to_end(engine, rid)
        assert (status, error.type) == ("failed", "RequestTooLargeError")
        beside = "" if lora is None else f" beside adapter {engine.adapters.ref(lora)}"
        assert error.message == (
            f"sequence 0 ({holds + 1} tokens) cannot grow in a cache of {holds} tokens of one "
            f"sequence{beside} grown to the 131072 bytes its MemoryBudget share can reach now "
            f"(the budget's 327680 less the other shares' minimums; at its max, 262144 bytes, "
            f"it would hold {at_max}) under policy 'vmem'")
        assert len(got) == holds + 1 - 100    # (the last, sampled, has no room to be written)
        assert engine.scheduler.manager.stats().live_tokens == 0
