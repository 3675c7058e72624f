"""An adapter's identity and layout: the digest names the content, the flat layout is aligned and
fits num_bytes, and views of the caller's buffer are the loaded weights without a copy."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from vmemkv.runtime.lora import ALIGN_BYTES, LoraAdapter, LoraBufferError
from vmemkv.runtime.lora.weights import FlatLayout
from vmemkv.runtime.models import build_model

from .adapters import ATTENTION, save_adapter

# per unit of rank: (in + out) of q, k, v, o, in 2 layers
LLAMA_ATTENTION_PARAMS = 2 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64))


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-llama")


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    return save_adapter(model, tmp_path_factory.mktemp("adapter") / "a", seed=1, r=4)


def test_same_files_give_the_same_digest_wherever_they_lie(model, saved, tmp_path):
    copied = shutil.copytree(saved, tmp_path / "elsewhere")
    digest = LoraAdapter.load(saved, model).digest
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert LoraAdapter.load(saved, model).digest == digest
    assert LoraAdapter.load(copied, model).digest == digest


def test_other_weights_or_other_math_under_the_same_name_change_the_digest(model, tmp_path):
    path = save_adapter(model, tmp_path / "same-name", seed=1)
    first = LoraAdapter.load(path, model).digest
    save_adapter(model, tmp_path / "same-name", seed=2)             # retrained, same place
    retrained = LoraAdapter.load(path, model).digest
    config_file = tmp_path / "same-name" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["lora_alpha"] = 16
    config_file.write_text(json.dumps(config))
    rescaled = LoraAdapter.load(path, model).digest
    assert len({first, retrained, rescaled}) == 3


def test_num_bytes_is_the_weights_in_the_module_dtype(model, saved):
    adapter = LoraAdapter.load(saved, model)
    assert adapter.num_bytes == 4 * LLAMA_ATTENTION_PARAMS * 4          # r=4, fp32
    assert adapter.modules == tuple(sorted(f"model.layers.{i}.self_attn.{p}"
                                           for i in range(2) for p in ATTENTION))
    bf16 = LoraAdapter.load(saved, build_model("tiny-llama", dtype=torch.bfloat16))
    assert bf16.num_bytes == adapter.num_bytes // 2
    assert bf16.digest == adapter.digest                               # content, not compute dtype


def test_layout_aligns_every_tensor_and_pads_num_bytes():
    layout = FlatLayout.plan({"m1": ((3, 5), (7, 3), torch.float32),       # 60 and 84 bytes
                              "m0": ((1, 1), (1, 1), torch.bfloat16)})     # 2 and 2 bytes
    (a0, b0), (a1, b1) = layout.slots["m0"], layout.slots["m1"]
    assert [a0.offset_bytes, b0.offset_bytes, a1.offset_bytes, b1.offset_bytes] == [0, 64, 128, 192]
    assert layout.num_bytes == 320
    assert all(slot.offset_bytes % ALIGN_BYTES == 0 for pair in layout.slots.values() for slot in pair)


def test_views_are_the_loaded_weights_and_share_the_buffer(model, saved):
    adapter = LoraAdapter.load(saved, model)
    pool = torch.zeros(adapter.num_bytes + 2 * ALIGN_BYTES, dtype=torch.uint8)
    buffer = pool[ALIGN_BYTES:ALIGN_BYTES + adapter.num_bytes]          # a region of "pool pages"
    adapter.pack_into(buffer)
    weights = adapter.views(buffer)
    stored = load_file(f"{saved}/adapter_model.safetensors")
    for module, lora in weights.modules.items():
        assert torch.equal(lora.a, stored[f"base_model.model.{module}.lora_A.weight"])
        assert torch.equal(lora.b, stored[f"base_model.model.{module}.lora_B.weight"])
        assert lora.scale == 8 / 4
        for tensor in (lora.a, lora.b):
            start = tensor.data_ptr() - buffer.data_ptr()
            assert 0 <= start and start + tensor.numel() * tensor.element_size() <= adapter.num_bytes
    assert weights.digest == adapter.digest
    pool[ALIGN_BYTES:ALIGN_BYTES + adapter.num_bytes].zero_()          # write the buffer ...
    # ... and the views see it
    assert all(not lora.a.any() and not lora.b.any() for lora in weights.modules.values())
    assert not pool[:ALIGN_BYTES].any() and not pool[-ALIGN_BYTES:].any()   # nothing outside written


def test_buffers_that_cannot_hold_the_adapter_are_refused(model, saved):
    adapter = LoraAdapter.load(saved, model)
    with pytest.raises(LoraBufferError, match=f"num_bytes={adapter.num_bytes}"):
        adapter.pack_into(torch.empty(adapter.num_bytes - 1, dtype=torch.uint8))
    with pytest.raises(LoraBufferError, match="uint8"):
        adapter.views(torch.empty(adapter.num_bytes, dtype=torch.float32))
    with pytest.raises(LoraBufferError, match="multiple of 64"):
        adapter.pack_into(torch.empty(adapter.num_bytes + 64, dtype=torch.uint8)[1:])


def test_a_slice_keeps_the_rows_and_columns_a_rank_holds_and_the_digest(model, saved):
    adapter = LoraAdapter.load(saved, model)
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj"
    cuts = {q: (slice(32, 64), None), o: (None, slice(0, 32))}       # rank 1's q, rank 0's o
    part = adapter.sliced(cuts)
    assert part.digest == adapter.digest and part.scales == adapter.scales
    whole, mine = adapter.materialize(), part.materialize()
    for module, lora in whole.modules.items():
        rows, cols = cuts.get(module, (None, None))
        assert torch.equal(mine.modules[module].a, lora.a if cols is None else lora.a[:, cols])
        assert torch.equal(mine.modules[module].b, lora.b if rows is None else lora.b[rows])
    # q's B loses 32 of 64 rows, o's A 32 of 64 columns: 4 x 32 fp32 values each
    assert part.num_bytes == adapter.num_bytes - 2 * 4 * 32 * 4
    assert adapter.sliced({}) is adapter and adapter.sliced({q: (None, None)}) is adapter


def test_a_copy_without_its_image_gives_views_but_packs_nothing(model, saved):
    adapter = LoraAdapter.load(saved, model)
    buffer = torch.zeros(adapter.num_bytes, dtype=torch.uint8)
    adapter.pack_into(buffer)
    lean = adapter.without_image()
    assert lean.digest == adapter.digest and lean.num_bytes == adapter.num_bytes
    for module, lora in lean.views(buffer).modules.items():
        assert torch.equal(lora.a, adapter.views(buffer).modules[module].a)
    with pytest.raises(LoraBufferError, match="holds no host image"):
        lean.pack_into(buffer)
    adapter.pack_into(buffer)                            # the original keeps its image
