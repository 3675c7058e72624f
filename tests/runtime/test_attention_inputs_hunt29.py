"""Hand-built step metadata that no backend can compute from is refused by
AttentionShapeError before anything is read: ``q_starts`` that are not the packed rows of
``query_lens`` (two requests read the same rows and the rows nobody wrote came back as
``torch.empty`` garbage), zero query heads (``cpu-varlen`` divided by zero, ``sdpa`` returned an
empty tensor), and 2-d lens tensors (an untyped TypeError)."""
import pytest
import torch

from vmemkv.runtime.attention import get_backend
from vmemkv.runtime.attention.errors import AttentionShapeError
from vmemkv.runtime.attention.views import BatchLens, PagedLayerView, StepMeta, VMemLayerView

BACKENDS = ("sdpa", "reference", "cpu-varlen")
HEADS, KV_HEADS, DIM = 4, 2, 16


def caches():
    torch.manual_seed(0)
    return torch.randn(3, 32, KV_HEADS, DIM), torch.randn(3, 32, KV_HEADS, DIM)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("q_starts", [(0, 0), (0, 2), (1, 0)])
def test_q_starts_that_are_not_packed_rows_are_refused(name, q_starts):
    k, v = caches()
    meta = StepMeta(BatchLens((5, 6), (1, 2), q_starts), host_slots=(1, 2))
    view = VMemLayerView(k, v, torch.tensor([1, 2]), torch.tensor([5, 6]), torch.tensor([1, 2]),
                         meta=meta)
    with pytest.raises(AttentionShapeError, match=r"q_starts .* packed rows .*\[0, 1\]"):
        get_backend(name).forward(torch.randn(3, HEADS, DIM), view)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("kind", ["vmem", "paged"])
def test_zero_query_heads_are_refused(name, kind):
    k, v = caches()
    lens = torch.tensor([5]), torch.tensor([1])
    view = VMemLayerView(k, v, torch.tensor([1]), *lens) if kind == "vmem" else \
        PagedLayerView(k, v, torch.tensor([[2]], dtype=torch.int32), *lens)
    with pytest.raises(AttentionShapeError, match="positive multiple of kv_heads"):
        get_backend(name).forward(torch.randn(1, 0, DIM), view)


@pytest.mark.parametrize("name", BACKENDS)
def test_lens_of_more_than_one_dimension_are_refused(name):
    k, v = caches()
    view = VMemLayerView(k, v, torch.tensor([1]), torch.tensor([[5]]), torch.tensor([[1]]))
    with pytest.raises(AttentionShapeError, match=r"context_lens must be 1-d.*\(1, 1\)"):
        get_backend(name).forward(torch.randn(1, HEADS, DIM), view)
