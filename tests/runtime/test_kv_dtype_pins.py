"""8-bit KV encodings pinned where the suite left them loose: checkpoint scale shapes, given
scales surviving ``unfix``."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vmemkv.runtime.errors import CacheConfigError
from vmemkv.runtime.kv_dtype import KVScales, ScaleTable, checkpoint_kv_scales, kv_encoding

INT8 = kv_encoding("int8", torch.float32)
E4M3 = kv_encoding("fp8_e4m3", torch.float32)


class _Attention(torch.nn.Module):
    def __init__(self, layer_idx: int, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.register_buffer("k_scale", k_scale)
        self.register_buffer("v_scale", v_scale)


def _model(*layers) -> torch.nn.Module:
    model = torch.nn.Module()
    model.config = SimpleNamespace()      # no quantization_config: fp8 e4m3 scales
    model.layers = torch.nn.ModuleList(_Attention(i, k, v) for i, (k, v) in enumerate(layers))
    return model


def test_checkpoint_scales_per_kv_head_are_read_in_every_accepted_shape():
    model = _model((torch.tensor([0.5, 0.25]), torch.tensor(2.0)),
                   (torch.tensor([[[1.0]], [[3.0]]]), torch.tensor([4.0])))
    scales = checkpoint_kv_scales(model, E4M3, num_layers=2, num_kv_heads=2)
    assert scales == KVScales(k=((0.5, 0.25), (1.0, 3.0)), v=((2.0, 2.0), (4.0, 4.0)))


def test_a_checkpoint_scale_with_a_non_unit_trailing_dim_is_refused_naming_it():
    # [kv_heads, 2] holds 2 values per head: not one scale per KV head
    model = _model((torch.ones(2, 2), torch.ones(2)), (torch.ones(2), torch.ones(2)))
    with pytest.raises(CacheConfigError, match=r"layers\.0\.k_scale has shape \[2, 2\]"):
        checkpoint_kv_scales(model, E4M3, num_layers=2, num_kv_heads=2)


def test_unfix_keeps_given_scales_fixed_and_unchanged():
    given = KVScales.of([[0.5, 0.25]], [[2.0, 4.0]])
    table = ScaleTable(INT8, num_layers=1, num_kv_heads=2, device=torch.device("cpu"),
                       given=given)
    table.unfix()
    table.unfix(0)
    assert table.fixed == [True]
    assert table.k.tolist() == [[0.5, 0.25]] and table.v.tolist() == [[2.0, 4.0]]
    k = torch.full((3, 2, 4), 8.0)            # a later write encodes with the given scales
    stored_k, stored_v = table.encode(0, k, k)
    assert stored_k[0, :, 0].tolist() == [16, 32] and stored_v[0, :, 0].tolist() == [4, 2]


@pytest.mark.parametrize("symmetric", [False, 0, "false"])
def test_a_kv_cache_scheme_that_is_not_symmetric_true_is_refused(symmetric):
    from vmemkv.runtime.kv_dtype import checkpoint_format_max
    model = _model()
    model.config.quantization_config = {"kv_cache_scheme": {
        "type": "float", "num_bits": 8, "symmetric": symmetric}}
    with pytest.raises(CacheConfigError, match="kv_cache_scheme.symmetric is"):
        checkpoint_format_max(model)
    model.config.quantization_config["kv_cache_scheme"]["symmetric"] = True
    assert checkpoint_format_max(model) == 448.0
