"""Checkpoint directories (runtime/models.py load_model): a checkpoint loads as its files hold it
or is a ModelLoadError, one line and exit 2 from ``vmemkv generate``. A file cut short, tensors
that do not cover the model or that it has no place for, and a tokenizer whose files do not load
are refused (they were a traceback, random weights, and "the model has no tokenizer"); a head
tied to the embeddings, absent from the file, and a directory with no tokenizer files load."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from vmemkv.cli import main
from vmemkv.runtime.models import ModelLoadError, build_model, load_model, model_config

from ..engine.byte_tokenizer import byte_tokenizer


@pytest.fixture()
def checkpoint(tmp_path):
    """tiny-llama's weights and the byte tokenizer, as save_pretrained writes them."""
    build_model("tiny-llama").save_pretrained(tmp_path / "ckpt")
    byte_tokenizer().save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _edit_weights(checkpoint, edit) -> None:
    weights = load_file(checkpoint / "model.safetensors")
    edit(weights)
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})


def _generate_error(capsys, checkpoint) -> str:
    capsys.readouterr()
    assert main(["generate", "--model", str(checkpoint), "--prompts", "-", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_checkpoint_loads_with_its_weights_and_tokenizer(checkpoint):
    model, tokenizer = load_model(str(checkpoint))
    want = build_model("tiny-llama").state_dict()
    assert all(torch.equal(t, want[name]) for name, t in model.state_dict().items())
    assert tokenizer("hi").input_ids == [ord("h"), ord("i")]


def test_a_truncated_safetensors_file_is_a_model_load_error(checkpoint, capsys):
    # SafetensorError escaped as a traceback (an interrupted download)
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4000])
    with pytest.raises(ModelLoadError, match="is not a loadable causal-LM checkpoint"):
        load_model(str(checkpoint))
    assert "ModelLoadError" in _generate_error(capsys, checkpoint)


@pytest.mark.parametrize("edit, words", [
    (lambda w: w.pop("model.layers.1.post_attention_layernorm.weight"),
     r"1 missing: model\.layers\.1\.post_attention_layernorm\.weight"),
    (lambda w: w.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
     r"1 unused: model\.layers\.0\.self_attn\.q_proj\.bias"),
], ids=["missing-tensor", "unused-tensor"])
def test_tensors_that_do_not_match_the_model_are_refused_naming_them(checkpoint, edit, words,
                                                                     capsys):
    # a missing tensor was initialised at random, an unused one dropped: nonsense, exit 0
    _edit_weights(checkpoint, edit)
    with pytest.raises(ModelLoadError, match=words):
        load_model(str(checkpoint))
    assert "do not match the model" in _generate_error(capsys, checkpoint)


def test_a_head_tied_to_the_embeddings_is_no_missing_tensor(tmp_path):
    from transformers import AutoModelForCausalLM
    config = model_config("tiny-llama")
    config.tie_word_embeddings = True
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tied")
    assert "lm_head.weight" not in load_file(tmp_path / "tied" / "model.safetensors")
    model, tokenizer = load_model(str(tmp_path / "tied"))
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight) and tokenizer is None


def test_a_tokenizer_file_that_does_not_load_is_an_error_naming_it(checkpoint, capsys):
    # it was taken for no tokenizer: text prompts refused "the model has no tokenizer", ids
    # answered with ids
    tokenizer_json = checkpoint / "tokenizer.json"
    tokenizer_json.write_bytes(tokenizer_json.read_bytes()[:300])
    with pytest.raises(ModelLoadError,
                       match=r"tokenizer of .*ckpt does not load \(tokenizer\.json\)"):
        load_model(str(checkpoint))
    assert "tokenizer.json" in _generate_error(capsys, checkpoint)
