"""GGUF conversion of a real (small) file, tests/runtime/gguf_fixture.py: the converted
checkpoint is the file's own (its weights, its tokenizer, whatever lies beside it); a file whose
tensors do not cover the model, that holds tensors transformers would leave out, or that is cut
short, is a GgufError (exit 2) and caches nothing; a conversion is quiet and leaves only its directory in the cache."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from vmemkv.cli import main  # noqa: E402
from vmemkv.runtime import gguf  # noqa: E402
from vmemkv.runtime.models import load_model  # noqa: E402

from .gguf_fixture import write_tiny_gguf  # noqa: E402

HELLO_BYTES = [71, 68, 75, 75, 78]     # "hello" in the fixture's byte tokens (GPT-2 alphabet order)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VMEMKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def _entries(cache) -> list:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def _another_models_tokenizer(folder) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(folder)


def test_a_gguf_converts_to_its_own_weights_and_tokenizer_whatever_lies_beside_it(cache, tmp_path):
    # the tokenizer files of another model beside the GGUF were taken as its tokenizer, and the
    # cache (keyed by the GGUF's hash) kept that pairing for every copy of the file
    folder = tmp_path / "models"
    folder.mkdir()
    written = write_tiny_gguf(folder / "tiny.gguf")
    _another_models_tokenizer(folder)
    model, tokenizer = load_model(str(folder / "tiny.gguf"))
    assert tokenizer("hello").input_ids == HELLO_BYTES and tokenizer.decode(HELLO_BYTES) == "hello"
    got = model.state_dict()
    assert all(torch.equal(got[name], tensor) for name, tensor in written.state_dict().items())
    assert _entries(cache) == [gguf.cache_key(gguf.file_sha256(folder / "tiny.gguf"))]


def test_a_gguf_whose_tensors_do_not_cover_the_model_is_refused_and_nothing_cached(cache,
                                                                                  tmp_path):
    # the missing tensor was filled with random weights, cached, and generated nonsense (exit 0)
    path = tmp_path / "gap.gguf"
    write_tiny_gguf(path, skip={"blk.1.ffn_norm.weight"})
    for _ in range(2):                                    # the second try is refused again
        with pytest.raises(gguf.GgufError, match=r"1 missing: "
                           r"model\.layers\.1\.post_attention_layernorm\.weight\); nothing"):
            gguf.gguf_checkpoint(path)
        assert _entries(cache) == []


def test_a_gguf_with_tensors_transformers_leaves_out_is_refused_and_nothing_cached(cache,
                                                                                    tmp_path):
    # transformers' loader skipped, without a word, every tensor the model has no place for:
    # Llama 3's rope_freqs (its long-context frequency scaling) and a q bias were dropped, and
    # the model converted and ran with default rotary frequencies and no bias
    path = tmp_path / "extra.gguf"
    write_tiny_gguf(path, extra={"rope_freqs.weight": np.full(8, 8.0, dtype=np.float32),
                                 "blk.0.attn_q.bias": np.ones(64, dtype=np.float32)})
    with pytest.raises(gguf.GgufError, match=r"2 in the file left out by transformers: "
                       r"blk\.0\.attn_q\.bias, rope_freqs\.weight\); nothing was converted"):
        gguf.gguf_checkpoint(path)
    assert _entries(cache) == []


def test_a_gguf_with_its_lm_head_tied_to_the_embeddings_converts(cache, tmp_path):
    # no output.weight in the file is no gap: the head is the embedding matrix (SmolLM2's case)
    path = tmp_path / "tied.gguf"
    written = write_tiny_gguf(path, tied=True)
    model, _ = load_model(str(path))
    embeddings = written.state_dict()["model.embed_tokens.weight"]
    assert torch.equal(model.lm_head.weight, embeddings)


def test_a_truncated_gguf_is_a_gguf_error_and_exit_2(cache, tmp_path, capsys):
    # struct.error escaped as a traceback from both commands
    whole = tmp_path / "whole.gguf"
    write_tiny_gguf(whole)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:2000])           # ends inside the tokenizer's metadata
    with pytest.raises(gguf.GgufError, match="transformers cannot read .*cut.gguf"):
        gguf.gguf_checkpoint(cut)
    assert gguf.main([str(cut)]) == 2
    assert main(["generate", "--model", str(cut), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("cannot read" in line for line in err)
    assert _entries(cache) == []


def test_a_conversion_is_quiet_and_leaves_only_its_directory(cache, tmp_path, capfd):
    # transformers' de-quantizing, loading and saving bars were printed (even with
    # --no-progress), and every converted file left a <key>.lock behind
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    capfd.readouterr()
    target = gguf.gguf_checkpoint(path)
    assert capfd.readouterr().err == ""
    assert _entries(cache) == [target.name] and target.name.startswith("v3-")


def test_holders_of_the_conversion_lock_never_overlap_and_it_is_removed(tmp_path):
    lock_path = tmp_path / "key.lock"
    inside, most = [0], [0]

    def hold():
        for _ in range(15):
            with gguf._locked(lock_path):
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                time.sleep(0.0005)
                inside[0] -= 1
    threads = [threading.Thread(target=hold) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 1 and not lock_path.exists()
