"""A VMemCache appends what each forward hands it, so it is built only for models whose
``generate`` hands it the decoder self-attention's new tokens and nothing else. Refused by
name before anything is built: a config with ``use_cache=False`` (generate re-feeds the whole
sequence every step: SmolLM2 cached 510 tokens for a 48-token answer and said "Paris, also known
as the City"), and an encoder-decoder (its cross-attention K/V landed in the self-attention's
rows: 156 tokens cached for a 12-token decoder). The way around the second that docs/models.md
gives, transformers' EncoderDecoderCache around a VMemCache of the decoder's shape, computes
transformers' logits."""
from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vmemkv.runtime.config import CacheConfig  # noqa: E402
from vmemkv.runtime.errors import CacheConfigError  # noqa: E402
from vmemkv.runtime.hf import VMemCache  # noqa: E402

LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, use_cache=False)
MPT = dict(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=256)   # its default


@pytest.mark.parametrize("config", [transformers.LlamaConfig(**LLAMA), transformers.MptConfig(**MPT)],
                         ids=["llama use_cache=False", "mpt default"])
def test_a_config_with_use_cache_false_is_refused_naming_it_and_the_fix(config):
    with pytest.raises(CacheConfigError, match=rf"\({config.model_type}\) sets use_cache=False: "
                                               r"generate then re-feeds .* model\.config\.use_cache = True"):
        VMemCache.from_model_config(config, max_batch=1, max_context=64)
    config.use_cache = True
    VMemCache.from_model_config(config, max_batch=1, max_context=64).close()


def test_smollm2_saved_with_use_cache_false_is_refused_and_runs_exactly_once_set(real_model_dir):
    """The bug hunter's case on the real model: both flags False gave wrong tokens silently."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(real_model_dir), dtype=torch.float32).eval()
    model.config.use_cache = model.generation_config.use_cache = False
    with pytest.raises(CacheConfigError, match=r"\(llama\) sets use_cache=False"):
        VMemCache.from_model_config(model.config, max_batch=1, max_context=128)
    model.config.use_cache = model.generation_config.use_cache = True
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(real_model_dir))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.inference_mode(), \
            VMemCache.from_model_config(model.config, max_batch=1, max_context=128) as cache:
        expected = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
        got = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, cache=cache)
        assert cache.get_seq_length() == got.shape[1] - 1     # not the re-fed 510 of 48
    assert torch.equal(got, expected)


def encoder_decoders() -> dict:
    """(model, the decoder's self-attention shape) per family: BART with more decoder than
    encoder layers, T5 with heads of d_kv=8, not d_model / heads = 16."""
    torch.manual_seed(0)
    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_position_embeddings=256, init_std=0.5, forced_eos_token_id=None)).eval()
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=128, d_model=64, d_kv=8, d_ff=128, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, initializer_factor=4.0)).eval()
    return {"bart": (bart, dict(num_layers=3, num_kv_heads=4, head_dim=16)),
            "t5": (t5, dict(num_layers=2, num_kv_heads=4, head_dim=8))}


@pytest.fixture(scope="module")
def seq2seq():
    return encoder_decoders()


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_an_encoder_decoder_is_refused_naming_is_encoder_decoder_and_the_wrapper(seq2seq, family):
    model, _ = seq2seq[family]
    with pytest.raises(CacheConfigError, match=rf"\({family}\) sets is_encoder_decoder=True.*"
                                               r"EncoderDecoderCache\(VMemCache\(CacheConfig"):
        VMemCache.from_model_config(model.config, max_batch=1, max_context=64)


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_an_encoder_decoder_cache_around_a_vmem_cache_computes_transformers_logits(seq2seq, family):
    model, shape = seq2seq[family]
    ids = torch.randint(3, 120, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0                                        # a padded encoder row
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None,
                  output_logits=True, return_dict_in_generate=True)
    cache = VMemCache(CacheConfig(**shape, max_batch=2, max_context=32))
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model.generate(ids, **kwargs)
        got = model.generate(ids, cache=transformers.EncoderDecoderCache(
            cache, transformers.DynamicCache()), **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for step, (ours, theirs) in enumerate(zip(got.logits, expected.logits, strict=True)):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    assert cache.stats().seq_len == 16                     # the decoder's tokens, nothing else
    cache.close()
