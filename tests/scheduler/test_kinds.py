"""Layer kinds from a model's per-layer windows: every layer in exactly one kind, full first."""
import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.managers.kinds import KindSpec, kinds_of
from vmemkv.scheduler.presets import MODELS, ModelSpec


def test_a_gemma3_pattern_has_a_full_kind_and_one_window_kind():
    kinds = kinds_of(MODELS["gemma-3-27b"])
    assert [k.name for k in kinds] == ["full", "window-1024"]
    assert kinds[0].layers == tuple(range(5, 62, 6)) and not kinds[0].windowed
    assert kinds[1].window_tokens == 1024 and kinds[1].num_layers == 62 - 10
    assert sorted(kinds[0].layers + kinds[1].layers) == list(range(62))


def test_uniform_models_have_one_kind_and_mixed_windows_one_kind_each():
    assert kinds_of(MODELS["llama-3-8b"]) == (KindSpec("full", tuple(range(32))),)
    assert kinds_of(MODELS["mistral-7b-v0.1"]) == (KindSpec("window-4096", tuple(range(32)), 4096),)
    mixed = ModelSpec("m", 4, 1, 1, 1, weight_bytes=0, layer_windows=(8, None, 4, 8))
    assert kinds_of(mixed) == (KindSpec("full", (1,)), KindSpec("window-4", (2,), 4),
                               KindSpec("window-8", (0, 3), 8))


@pytest.mark.parametrize("layers, window", [((), None), ((2, 1), None), ((0, 0), None),
                                            ((True,), None), ((0,), 0), ((0,), True)])
def test_bad_kind_specs_are_refused_by_name(layers, window):
    with pytest.raises(ConfigError, match="KindSpec 'k'"):
        KindSpec("k", layers, window)
