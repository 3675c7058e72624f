"""Text prompts: Engine with a tokenizer, load_model of a local checkpoint + tokenizer, and
`vmemkv generate` reading text from a file or stdin.

Nothing is downloaded: the tokenizer is built here with the `tokenizers` library (a WordLevel
vocabulary of exactly the tiny model's 256 ids, so every generated id decodes) and saved with
``save_pretrained`` next to a random-weight tiny-llama in a temporary directory.
"""
from __future__ import annotations

import io
import json

import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from vmemkv.cli import main  # noqa: E402
from vmemkv.runtime.engine import Engine, RequestRejectedError, SamplingParams  # noqa: E402
from vmemkv.runtime.models import build_model, load_model  # noqa: E402

from .conftest import VOCAB  # noqa: E402

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a cache of pages maps virtual memory to physical memory",
    "every request either finishes or is rejected at submission",
]
TEXTS = [
    "the quick brown fox",
    "a cache of pages maps virtual memory",
    "every request finishes zebra",          # "zebra" is out of vocabulary: <unk>
]
NEW_TOKENS = 8


def make_tokenizer(vocab_size: int = VOCAB) -> PreTrainedTokenizerFast:
    """WordLevel over the words of SENTENCES, padded with filler words to ``vocab_size`` ids;
    adds <s> in front of every encoding, like Llama tokenizers."""
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    words = sorted({w for s in SENTENCES for w in s.split()})
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    for i in range(len(vocab), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tok.decoder = decoders.WordPiece(prefix="##")     # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    assert (fast.pad_token_id, fast.bos_token_id, fast.eos_token_id, fast.unk_token_id) == (PAD, BOS, EOS, UNK)
    return fast


def tiny_model():
    """tiny-llama, seed 0, with bos/eos/pad ids matching the tokenizer (config and generation)."""
    model = build_model("tiny-llama", seed=0)
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = BOS, EOS, PAD
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def reference():
    """Separate model with the same weights, on transformers' default attention."""
    return tiny_model()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-llama-tok")
    tiny_model().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def hf_greedy_ids(reference, tokenizer, text: str, max_new_tokens: int = NEW_TOKENS) -> list:
    ids = tokenizer(text)["input_ids"]
    with torch.inference_mode():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def engine_outputs(model, tokenizer, texts, **options):
    with Engine(model, tokenizer, max_batch=4, max_context=128, **options) as engine:
        return engine.generate(texts, SamplingParams(max_new_tokens=NEW_TOKENS))


# ---- 1. Engine with a tokenizer --------------------------------------------------------------
@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_text_prompts_decode_and_match_transformers_greedy(cache, tokenizer, reference):
    outs = engine_outputs(tiny_model(), tokenizer, TEXTS, cache=cache, block_size=4)
    assert len(outs) == len(TEXTS)
    for text, out in zip(TEXTS, outs):
        assert out.prompt == text
        assert list(out.prompt_token_ids) == tokenizer(text)["input_ids"]
        assert out.prompt_token_ids[0] == BOS
        completion = out.outputs[0]
        assert completion.finished
        assert completion.token_ids == hf_greedy_ids(reference, tokenizer, text)
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        if completion.finish_reason == "stop":
            assert completion.token_ids[-1] == EOS
    assert UNK in outs[2].prompt_token_ids
    assert any(o.outputs[0].text for o in outs), "random model produced only empty texts"


def test_mixed_text_and_token_id_prompts(tokenizer, reference):
    ids = tokenizer(TEXTS[0])["input_ids"]
    outs = engine_outputs(tiny_model(), tokenizer, [ids, TEXTS[0]])
    assert outs[0].prompt is None and outs[1].prompt == TEXTS[0]
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == hf_greedy_ids(
        reference, tokenizer, TEXTS[0])
    assert outs[0].outputs[0].text == outs[1].outputs[0].text   # token-id prompts decode too


def test_eos_stops_and_is_left_out_of_the_text():
    # tiny-llama greedily continues TEXTS[0] with 21 ("pages") then 100: make 100 the eos
    tok = make_tokenizer()
    tok.add_special_tokens({"eos_token": "w100"})
    assert tok.eos_token_id == 100
    model, ref = tiny_model(), tiny_model()
    for m in (model, ref):
        m.config.eos_token_id = m.generation_config.eos_token_id = 100
    [out] = engine_outputs(model, tok, TEXTS[:1])
    completion = out.outputs[0]
    assert completion.token_ids == hf_greedy_ids(ref, tok, TEXTS[0]) == [21, 100]
    assert completion.finish_reason == "stop" and completion.text == "pages"


def test_stream_with_text_prompts(tokenizer):
    with Engine(tiny_model(), tokenizer, max_batch=4, max_context=128) as engine:
        events = list(engine.stream(TEXTS, SamplingParams(max_new_tokens=NEW_TOKENS)))
        outs = engine.last_outputs
    streamed = {i: [e.token_id for e in events if e.request_id == o.request_id] for i, o in enumerate(outs)}
    for i, out in enumerate(outs):
        assert streamed[i] == out.outputs[0].token_ids
        assert out.outputs[0].text == tokenizer.decode(streamed[i], skip_special_tokens=True)


# ---- 2. load_model: checkpoint and tokenizer -------------------------------------------------
def test_load_model_loads_checkpoint_and_tokenizer(checkpoint, tokenizer, reference):
    model, loaded = load_model(str(checkpoint))
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert model.dtype == torch.float32
    ref = reference.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
    assert model.generation_config.eos_token_id == EOS
    assert loaded is not None
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (BOS, EOS, PAD)
    for text in TEXTS:
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.decode([5, 6, 200]) == tokenizer.decode([5, 6, 200])
    outs = engine_outputs(model, loaded, TEXTS[:1])
    assert outs[0].outputs[0].token_ids == hf_greedy_ids(reference, tokenizer, TEXTS[0])


def test_load_model_without_tokenizer_gives_none(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    model, tok = load_model(str(tmp_path))
    assert tok is None and type(model).__name__ == "LlamaForCausalLM"


# ---- 3. CLI ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def expected(checkpoint, tokenizer, reference):
    """The engine's outputs for TEXTS on the checkpoint (and they equal transformers' greedy)."""
    model, loaded = load_model(str(checkpoint))
    outs = engine_outputs(model, loaded, TEXTS)
    for text, out in zip(TEXTS, outs):
        assert out.outputs[0].token_ids == hf_greedy_ids(reference, tokenizer, text)
    return outs


def cli(checkpoint, *extra):
    return main(["generate", "--model", str(checkpoint), "--max-new-tokens", str(NEW_TOKENS),
                 "--no-progress", *extra])


def test_cli_text_prompts_from_file(checkpoint, expected, tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(TEXTS) + "\n\n", encoding="utf-8")
    rc = cli(checkpoint, "--prompts", str(path))
    out, err = capsys.readouterr()
    assert rc == 0
    assert out == "".join(o.outputs[0].text + "\n" for o in expected)
    assert "tok/s" in err and "Loading weights" not in err     # --no-progress: no HF bar either


@pytest.mark.parametrize("cache", ["vmem", "paged"])
def test_cli_text_prompts_from_stdin_json(cache, checkpoint, expected, tokenizer, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(TEXTS) + "\n"))
    blocks = ["--block-size", "4"] if cache == "paged" else []   # vmem: refused, it has none
    rc = cli(checkpoint, "--prompts", "-", "--json", "--cache", cache, *blocks)
    out, _ = capsys.readouterr()
    assert rc == 0
    *records, stats = [json.loads(line) for line in out.splitlines()]   # --json ends with the stats
    assert len(records) == len(TEXTS) and stats["stats"]["requests"] == len(TEXTS)
    for text, record, exp in zip(TEXTS, records, expected):
        assert record["prompt_token_ids"] == tokenizer(text)["input_ids"]
        assert record["prompt"] == text
        [sample] = record["outputs"]
        assert sample["token_ids"] == exp.outputs[0].token_ids
        assert sample["text"] == exp.outputs[0].text
        assert sample["finish_reason"] == exp.outputs[0].finish_reason


def test_cli_stdin_plain_text_output(checkpoint, expected, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(TEXTS[1] + "\n"))
    rc = cli(checkpoint)                       # --prompts defaults to stdin
    out, _ = capsys.readouterr()
    assert rc == 0 and out == expected[1].outputs[0].text + "\n"


def test_cli_text_prompt_with_checkpoint_without_tokenizer_exits_2(tmp_path, monkeypatch, capsys):
    tiny_model().save_pretrained(tmp_path)
    capsys.readouterr()                        # drop save_pretrained's progress bar
    monkeypatch.setattr("sys.stdin", io.StringIO(TEXTS[0] + "\n"))
    rc = cli(tmp_path)
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "tokenizer" in err


# ---- 4. text without a tokenizer, and ids the model cannot take ------------------------------
def test_text_prompt_without_tokenizer_is_rejected():
    with Engine(tiny_model(), max_batch=4, max_context=128) as engine:
        with pytest.raises(RequestRejectedError, match="tokenizer") as info:
            engine.generate([[1, 5, 6], TEXTS[0]], SamplingParams(max_new_tokens=4))
        assert info.value.index == 1
        assert not engine.has_unfinished()               # nothing was queued, not even prompt 0
        with pytest.raises(RequestRejectedError, match="tokenizer"):
            engine.add_request(TEXTS[0])
        assert not engine.has_unfinished()


def test_text_encoding_outside_model_vocab_is_rejected():
    big = make_tokenizer(vocab_size=VOCAB + 64)
    big.add_tokens(["wide"])                             # id VOCAB + 64 >= the model's 256
    with Engine(tiny_model(), big, max_batch=4, max_context=128) as engine:
        with pytest.raises(RequestRejectedError, match="outside the vocabulary"):
            engine.generate(["the wide fox"], SamplingParams(max_new_tokens=4))
        assert not engine.has_unfinished()


def test_cli_text_flag_reads_a_digits_only_line_as_text(checkpoint, tokenizer, monkeypatch, capsys):
    """Without --text a line of integers is token ids; with it, every line is text."""
    monkeypatch.setattr("sys.stdin", io.StringIO("7 11\n"))
    assert cli(checkpoint, "--json") == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["prompt_token_ids"] == [7, 11]
    monkeypatch.setattr("sys.stdin", io.StringIO("7 11\n"))
    assert cli(checkpoint, "--json", "--text") == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["prompt"] == "7 11" and record["prompt_token_ids"] == tokenizer("7 11")["input_ids"]


def test_a_text_prompt_with_a_lone_surrogate_is_refused_naming_it():
    """The tokenizer raised a TypeError on it; the engine refuses it by index, queueing nothing
    (the server's 400 and chat's message check share the test: prompts.is_unicode_text)."""
    from .byte_tokenizer import byte_tokenizer
    with Engine(build_model("tiny-llama"), byte_tokenizer(), max_batch=1, max_context=32) as engine:
        with pytest.raises(RequestRejectedError, match="prompt 1 holds a lone surrogate"):
            engine.generate(["ok", "a\ud800"], SamplingParams(max_new_tokens=2))
        assert not engine.has_unfinished()
