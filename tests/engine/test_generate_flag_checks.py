"""``vmemkv generate`` / ``serve`` flag checks (runtime/generate_checks.py): a flag that does
nothing for the chosen cache is refused by name, not ignored; the flags the engine would refuse
after the model is built are refused before it loads, naming the flag; --page-bytes is checked
against the model's pages before the engine is built; --max-batch above the engine's default
step budget raises the budget instead of being refused."""
from __future__ import annotations

import pytest

from vmemkv.cli import build_parser
from vmemkv.runtime import generate_checks, generate_cli, memory
from vmemkv.runtime.engine import EngineConfig
from vmemkv.runtime.errors import CacheTooLargeError
from vmemkv.runtime.generate_io import GenerateUsageError
from vmemkv.scheduler.managers.eviction import DEFAULT_EVICTION


def _checked(argv, command="generate"):
    args = build_parser().parse_args([command, *argv])
    generate_checks.check_flags(args)
    return args


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("argv, flag", [
    (["--cache", "paged", "--background-mapper"], "--background-mapper applies to --cache vmem only"),
    (["--cache", "paged", "--layout", "interleaved"], "--layout applies to --cache vmem only"),
    (["--cache", "paged", "--page-bytes", "64KiB"], "--page-bytes applies to --cache vmem only"),
    (["--cache", "paged", "--max-cache-bytes", "1MiB"], "--max-cache-bytes applies to --cache vmem"),
    (["--cache", "vmem", "--block-size", "32"], "--block-size 32 sets a paged cache's blocks"),
    (["--prefix-eviction", "hits"], "--prefix-eviction hits applies with --prefix-sharing only"),
    (["--preemption", "swap"], "--preemption swap moves preempted sequences to host swap space"),
    (["--swap-bytes", "1GiB"], "--swap-bytes 1073741824 is the host swap space of --preemption "
                               "swap; with --preemption recompute no sequence swaps"),
    (["--tp", "2", "--background-mapper"], "--background-mapper is not supported with --tp 2"),
    (["--max-context", str(2**24 + 1)], f"--max-context {2**24 + 1} is outside what the engine takes"),
])
def test_a_flag_that_does_not_apply_is_refused_by_name(command, argv, flag):
    with pytest.raises(GenerateUsageError, match="^" + flag):
        _checked(argv, command)


def test_generate_refuses_more_samples_than_a_request_forks():
    with pytest.raises(GenerateUsageError, match="^--n 1025 samples per prompt is more than the 1024"):
        _checked(["--n", "1025"])
    assert _checked(["--n", "1024"]).n == 1024


def test_flags_not_given_take_their_defaults_and_apply_where_they_do():
    args = _checked([])
    assert (args.layout, args.block_size, args.background_mapper, args.prefix_eviction) == \
        ("per-layer", 16, False, DEFAULT_EVICTION)
    assert _checked(["--max-context", str(2**24)]).max_context == 2**24
    assert _checked(["--cache", "paged", "--block-size", "32"]).block_size == 32
    shared = _checked(["--prefix-sharing", "--block-size", "32", "--prefix-eviction", "hits"])
    assert (shared.block_size, shared.prefix_eviction) == (32, "hits")
    vmem = _checked(["--layout", "interleaved", "--page-bytes", "64KiB", "--background-mapper"])
    assert (vmem.layout, vmem.page_bytes, vmem.background_mapper) == ("interleaved", 65536, True)


class RecordedEngine:
    def __init__(self, model, tokenizer, **options) -> None:
        self.options = options


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_max_batch_above_the_step_budget_raises_the_budget(command):
    def steps(max_batch):
        args = _checked(["--max-batch", str(max_batch)], command)
        return generate_cli._engine(RecordedEngine, None, None, args).options["max_tokens_per_step"]
    default = EngineConfig.max_tokens_per_step
    assert steps(8) == default
    assert steps(default + 952) == default + 952
    EngineConfig(max_batch=default + 952, max_tokens_per_step=default + 952)   # accepted


@pytest.fixture(scope="module")
def tiny_model():
    from vmemkv.runtime.models import build_model
    return build_model("tiny-llama", seed=0)


def test_a_page_past_the_caches_context_limit_names_page_bytes(tiny_model):
    args = _checked(["--max-batch", "2", "--max-context", "64", "--page-bytes", "64GiB"])
    with pytest.raises(GenerateUsageError, match=r"^--page-bytes 68719476736 rounds each slot's "
                       r"--max-context 64 tokens up to 536870912 .*give a smaller --page-bytes$"):
        generate_checks.check_page_bytes(args, tiny_model)


def test_a_default_budget_of_whole_pages_past_memory_names_page_bytes(tiny_model, monkeypatch):
    gib = 2**30   # the host faked to 1 GiB: 8 slots of one 1 GiB page per layer need 32 GiB
    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: gib)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: gib)
    args = _checked(["--max-context", "64", "--page-bytes", "1GiB"])
    with pytest.raises(CacheTooLargeError, match=r"--page-bytes 1073741824 rounds each slot's "
                       r"--max-context 64 tokens up to 8388608 .* --max-batch 8 slots needs "
                       r"34359738368 bytes .*give a smaller --page-bytes, or --cache-bytes$"):
        generate_checks.check_page_bytes(args, tiny_model)
    # the user's own budget (or a page that rounds nothing) is the engine's to check
    generate_checks.check_page_bytes(_checked(["--max-context", "64", "--page-bytes", "1GiB",
                                               "--cache-bytes", "1MiB"]), tiny_model)
    generate_checks.check_page_bytes(_checked(["--max-context", "64"]), tiny_model)
