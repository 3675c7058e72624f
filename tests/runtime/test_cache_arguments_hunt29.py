"""``write`` and ``read`` refuse arguments they cannot honour exactly, by CacheStateError.

``write`` takes exactly this step's ``[new_tokens, kv_heads, head_dim]`` K and V: anything
else is refused with CacheStateError before a byte is stored or a scale fixed. The vmem cache
broadcast one token (or one head, or one dim) over the whole step, silently, and a V of the
wrong length failed untyped after K was already stored; the paged cache failed untyped.

``read`` takes a layer and a count in [0, tokens held]: a negative count sliced ``[:-n]``, up
to the slot's end through unmapped memory (SIGSEGV on the host driver, so that case runs in a
forked child); a bad layer was StopIteration (vmem) or read the last layer (paged, ``-1``)."""
import os

import pytest
import torch

from vmemkv.runtime.config import CacheConfig
from vmemkv.runtime.errors import CacheStateError
from vmemkv.runtime.kv import make_kv

TOKENS, HEADS, DIM = 5, 2, 16
KINDS = [pytest.param("vmem", dict(page_bytes=4096), id="vmem"),
         pytest.param("vmem", dict(page_bytes=8192, layout="interleaved"), id="interleaved"),
         pytest.param("paged", dict(block_size=8), id="paged")]
BAD = {"one token": ((1, HEADS, DIM), (TOKENS, HEADS, DIM)),
       "one head": ((TOKENS, 1, DIM), (TOKENS, 1, DIM)),
       "one dim": ((TOKENS, HEADS, 1), (TOKENS, HEADS, 1)),
       "flat": ((HEADS, DIM), (HEADS, DIM)),
       "short v": ((TOKENS, HEADS, DIM), (TOKENS - 1, HEADS, DIM))}


def stepped_kv(kind, options, kv_cache_dtype="auto", swap_bytes=0):
    cfg = CacheConfig(num_layers=2, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32,
                      max_batch=2, max_context=64, kv_cache_dtype=kv_cache_dtype)
    kv = make_kv(cfg, kind, swap_bytes=swap_bytes, **options)
    kv.manager.allocate(0, TOKENS)
    kv.execute(kv.manager.take_ops())
    kv.begin_step([(0, 0, TOKENS)])
    return kv


@pytest.mark.parametrize("kind,options", KINDS)
@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_wrong_shaped_write_is_refused_and_stores_nothing(kind, options, bad):
    torch.manual_seed(0)
    with stepped_kv(kind, options) as kv:
        truth = torch.randn(TOKENS, HEADS, DIM), torch.randn(TOKENS, HEADS, DIM)
        kv.write(0, *truth)
        k_shape, v_shape = BAD[bad]
        with pytest.raises(CacheStateError, match=r"\[5, 2, 16\]"):
            kv.write(0, torch.randn(k_shape), torch.randn(v_shape))
        k, v = kv.read(0, 0, TOKENS)
        assert torch.equal(k, truth[0]) and torch.equal(v, truth[1])


@pytest.mark.parametrize("kind,options", KINDS)
def test_a_refused_first_write_of_an_8bit_cache_fixes_no_scale(kind, options):
    """The one-head K of a first int8 write fixed (broadcast) scales before failing, or stored."""
    with stepped_kv(kind, options, "int8") as kv:
        with pytest.raises(CacheStateError, match="kv_heads"):
            kv.write(0, torch.randn(TOKENS, 1, DIM), torch.randn(TOKENS, 1, DIM))
        assert kv.cache.kv_scales.fixed == [False, False]
        truth = torch.randn(TOKENS, HEADS, DIM) * 3
        kv.write(0, truth, truth)
        expected = truth.abs().amax(dim=(0, 2)) / 127
        assert torch.allclose(kv.cache.kv_scales.k[0], expected)


@pytest.mark.parametrize("kind,options", KINDS[::2])
def test_integer_k_v_are_refused(kind, options):
    with stepped_kv(kind, options) as kv:
        with pytest.raises(CacheStateError, match="floating"):
            kv.write(0, torch.ones(TOKENS, HEADS, DIM, dtype=torch.int64),
                     torch.ones(TOKENS, HEADS, DIM))


def read_in_child(kv, *args) -> str:
    """The outcome of ``kv.read(*args)`` in a forked child: its exception's type name, "read",
    or "signal N" when it died (a read of unmapped memory)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: report and leave without running any of pytest's exit code
        os.close(read_end)
        try:
            kv.read(*args)
            outcome = "read"
        except Exception as error:   # the outcome is the error's type, asserted by the parent
            outcome = type(error).__name__
        os.write(write_end, outcome.encode())
        os._exit(0)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    outcome = os.read(read_end, 200).decode()
    os.close(read_end)
    return outcome if os.WIFEXITED(status) else f"signal {os.WTERMSIG(status)}"


@pytest.mark.parametrize("kind,options", KINDS)
@pytest.mark.parametrize("args", [(0, 0, -2), (0, -1, 3), (0, 2, 3), (0, 1.0, 3), (0, 0, 2.5),
                                  (0, 0, True)], ids=str)
def test_a_read_of_a_bad_layer_or_count_is_refused_by_type(kind, options, args):
    with stepped_kv(kind, options) as kv:
        for who in (kv, kv.cache):
            assert read_in_child(who, *args) == "CacheStateError"


def test_a_paged_read_takes_numpy_and_torch_integers():
    """The paged cache looked a tensor layer up in a dict by identity: KeyError."""
    np = pytest.importorskip("numpy")
    with stepped_kv("paged", dict(block_size=8)) as kv:
        truth = torch.randn(TOKENS, HEADS, DIM), torch.randn(TOKENS, HEADS, DIM)
        kv.write(1, *truth)
        for layer, tokens in ((np.int64(1), np.int32(3)), (torch.tensor(1), torch.tensor(3))):
            k, v = kv.read(0, layer, tokens)
            assert torch.equal(k, truth[0][:3]) and torch.equal(v, truth[1][:3])



@pytest.mark.parametrize("kind,options", KINDS)
def test_a_plan_ends_the_step_so_a_stale_write_cannot_reach_another_sequence(kind, options):
    """Sequence 0's step was begun, then a plan swapped 0 out and one gave its blocks (paged) to
    sequence 1: the old step's write went on, into sequence 1's K/V. A plan now ends the step."""
    torch.manual_seed(1)
    with stepped_kv(kind, options, swap_bytes=64 * 1024) as kv:
        kv.manager.swap_out(0)
        kv.execute(kv.manager.take_ops())
        kv.manager.allocate(1, TOKENS)
        kv.execute(kv.manager.take_ops())
        kv.sync_tables([1])
        truth = kv.read(1, 0, TOKENS)
        stale = torch.full((TOKENS, HEADS, DIM), 7.0)
        for stale_call in (lambda: kv.write(0, stale, stale), lambda: kv.layer_view(0)):
            with pytest.raises(CacheStateError, match="no step begun since the last plan"):
                stale_call()
        after = kv.read(1, 0, TOKENS)
        assert torch.equal(after[0], truth[0]) and torch.equal(after[1], truth[1])
