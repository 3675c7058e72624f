"""Page geometry figures: the host page size for a token that does not divide 64 KiB, and the
tokens and pages derived from it."""
import pytest

from vmemkv.scheduler.errors import ConfigError
from vmemkv.scheduler.geometry import KiB, MiB, PageGeometry, default_page_bytes
from vmemkv.scheduler.presets import get_model


def test_the_host_page_is_the_smallest_multiple_of_64_kib_holding_whole_tokens():
    phi = get_model("phi-2")                 # 5,120 bytes a layer-token: 5 * 1,024
    assert default_page_bytes("per-layer", phi.num_layers, phi.layer_bytes_per_token,
                              on_cuda=False) == 5 * 64 * KiB
    assert default_page_bytes("per-layer", phi.num_layers, phi.layer_bytes_per_token,
                              on_cuda=True) == 2 * MiB
    tiny = get_model("tiny")                 # 512 bytes: 64 KiB holds 128 whole tokens
    assert default_page_bytes("per-layer", tiny.num_layers, tiny.layer_bytes_per_token,
                              on_cuda=False) == 64 * KiB


def test_tokens_round_up_to_whole_pages_and_a_whole_page_stays():
    geometry = PageGeometry("per-layer", 4096, 4, 512)      # 8 tokens a page group
    assert geometry.tokens_per_page == 8
    assert [geometry.round_up_tokens(n) for n in (0, 1, 8, 16, 17)] == [0, 8, 8, 16, 24]
    assert [geometry.pages_for(n) for n in (0, 1, 8, 16, 17)] == [0, 1, 1, 2, 3]


def test_a_page_one_byte_short_of_a_token_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"page_bytes=511 holds no token.*needs >= 512"):
        PageGeometry("per-layer", 511, 4, 512)
    assert PageGeometry("per-layer", 512, 4, 512).tokens_per_page == 1
