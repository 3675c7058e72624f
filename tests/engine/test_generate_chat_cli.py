"""``vmemkv generate --chat``: JSONL conversations (or one user message per line) through the
checkpoint's chat template, ``--system``, ``--stop TEXT``, labelled samples with multi-line text
indented; the tokens are Engine.chat's. A model without a tokenizer or a template is one line,
exit 2. And ``--model`` takes a hub id that is already in the local hub cache."""
from __future__ import annotations

import json

import pytest

from vmemkv.cli import main
from vmemkv.runtime.engine import Engine, SamplingParams
from vmemkv.runtime.generate_io import INDENT

from .byte_tokenizer import byte_tokenizer
from .conftest import model

CHATS = [
    [{"role": "user", "content": "first\nline two"}],
    "just a string",
    [{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}],
]


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    """tiny-llama's weights beside the byte tokenizer with a chat template."""
    path = tmp_path_factory.mktemp("chat-ckpt")
    model().save_pretrained(path)
    byte_tokenizer(chat_template=True).save_pretrained(path)
    return path


def _write(tmp_path, lines) -> str:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    return str(path)


def _run(capsys, *argv) -> tuple:
    capsys.readouterr()
    code = main(["generate", "--no-progress", "--max-new-tokens", "6", "--max-context", "128", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_chat_jsonl_gives_engine_chat_tokens_with_the_system_message(chat_checkpoint, tmp_path, capsys):
    code, out, _ = _run(capsys, "--model", str(chat_checkpoint), "--chat", "--system", "Be brief.",
                        "--prompts", _write(tmp_path, CHATS), "--json", "--ignore-eos")
    assert code == 0
    *records, _ = [json.loads(line) for line in out.splitlines()]
    conversations = [
        [{"role": "system", "content": "Be brief."}, *CHATS[0]],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "just a string"}],
        CHATS[2],                                               # it has its own system message
    ]
    assert [r["messages"] for r in records] == conversations
    with Engine(model(), byte_tokenizer(chat_template=True), max_context=128) as engine:
        want = engine.chat(conversations, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [r["outputs"][0]["token_ids"] for r in records] == [w.outputs[0].token_ids for w in want]
    assert records[0]["prompt_token_ids"] == list(want[0].prompt_token_ids)
    rendered = byte_tokenizer(chat_template=True).decode(want[0].prompt_token_ids)
    assert rendered == "<system>Be brief.\n<user>first\nline two\n<assistant>"


def test_a_plain_text_line_is_one_user_message_and_broken_json_is_refused(chat_checkpoint,
                                                                         tmp_path, capsys):
    plain, quoted, broken = (tmp_path / n for n in ("plain.txt", "quoted.jsonl", "broken.jsonl"))
    plain.write_text("What is 2 + 2?\n42\n")
    quoted.write_text('"What is 2 + 2?"\n"42"\n')
    broken.write_text('[{"role": "user", "content": "hi"}\n')
    runs = [_run(capsys, "--model", str(chat_checkpoint), "--chat", "--prompts", str(path),
                 "--json", "--ignore-eos") for path in (plain, quoted)]
    assert [code for code, _, _ in runs] == [0, 0]
    plain_records, quoted_records = ([json.loads(line) for line in out.splitlines()[:-1]]
                                     for _, out, _ in runs)
    assert [r["messages"] for r in plain_records] == [
        [{"role": "user", "content": "What is 2 + 2?"}], [{"role": "user", "content": "42"}]]
    assert plain_records == quoted_records
    code, out, err = _run(capsys, "--model", str(chat_checkpoint), "--chat", "--prompts", str(broken))
    assert code == 2 and out == "" and "prompt line 1 is not JSON" in err


def test_samples_are_labelled_and_multi_line_text_indented(chat_checkpoint, tmp_path, capsys):
    newline = {ord("\n"): 100.0}   # every token a newline: text of several lines
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"hello"\n[1, 2, 3]\n')
    code, out, _ = _run(capsys, "--model", str(chat_checkpoint), "--prompts", str(prompts),
                        "--chat", "--ignore-eos", "--json")
    assert code == 0 and len(out.splitlines()) == 3
    with Engine(model(), byte_tokenizer(chat_template=True), max_context=128) as engine:
        text = engine.chat(CHATS[:1], SamplingParams(max_new_tokens=3, logit_bias=newline))
    assert text[0].outputs[0].text == "\n\n\n"
    code, out, _ = _run(capsys, "--model", str(chat_checkpoint), "--prompts", str(prompts),
                        "--chat", "--ignore-eos", "--n", "2", "--temperature", "0.5")
    lines = out.splitlines()
    starts = [line for line in lines if line.startswith("[prompt")]
    assert [s.split("]")[0] + "]" for s in starts] == [
        "[prompt 0 sample 0]", "[prompt 0 sample 1]", "[prompt 1 sample 0]", "[prompt 1 sample 1]"]
    assert all(line.startswith(("[prompt", INDENT)) for line in lines)


def test_stop_text_cuts_the_sample(chat_checkpoint, tmp_path, capsys):
    prompts = _write(tmp_path, ["abc"])
    code, out, _ = _run(capsys, "--model", str(chat_checkpoint), "--prompts", prompts, "--json",
                        "--ignore-eos", "--max-new-tokens", "12")
    text = json.loads(out.splitlines()[0])["outputs"][0]["text"]
    at = next(i for i in range(1, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    code, out, _ = _run(capsys, "--model", str(chat_checkpoint), "--prompts", prompts, "--json",
                        "--ignore-eos", "--max-new-tokens", "12", "--stop", text[at:at + 2],
                        "--stop", "never")
    cut = json.loads(out.splitlines()[0])["outputs"][0]
    assert code == 0 and cut["finish_reason"] == "stop"
    assert cut["text"] == text[:text.find(text[at:at + 2])]


@pytest.mark.parametrize("argv,words", [
    (["--model", "tiny-llama", "--chat"], "no tokenizer"),
    (["--model", "tiny-llama", "--system", "x"], "give --chat"),
    (["--model", "{plain}", "--chat"], "no chat template"),
    (["--model", "{chat}", "--chat", "--prompts", "{bad}"], "messages[0].role"),
    (["--model", "tiny-llama", "--stop", "x", "--prompts", "{ids}"], "stop strings need a tokenizer"),
])
def test_chat_mistakes_are_one_line_exit_2(argv, words, chat_checkpoint, tmp_path_factory,
                                          tmp_path, capsys):
    plain = tmp_path_factory.getbasetemp() / "plain-ckpt"   # weights and a template-less tokenizer
    if not plain.exists():
        model().save_pretrained(plain)
        byte_tokenizer().save_pretrained(plain)
    good, bad, ids = _write(tmp_path, ["hi"]), str(tmp_path / "bad.jsonl"), str(tmp_path / "ids.txt")
    (tmp_path / "bad.jsonl").write_text('[{"role": "robot", "content": "x"}]\n')
    (tmp_path / "ids.txt").write_text("1 2 3\n")
    argv = [a.format(plain=plain, chat=chat_checkpoint, bad=bad, ids=ids) for a in argv]
    if "--prompts" not in argv:
        argv += ["--prompts", good]
    capsys.readouterr()
    code = main(["generate", "--no-progress", *argv])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and words in err, err


def test_a_hub_id_in_the_local_hub_cache_loads_offline(chat_checkpoint, tmp_path, monkeypatch):
    """A hub cache laid out as huggingface_hub writes it (refs/main -> snapshots/<rev>/)."""
    import shutil

    import huggingface_hub.constants as hub_constants

    from vmemkv.runtime.models import load_model, served_model_name
    repo = tmp_path / "hub" / "models--tiny-org--tiny-chat"
    shutil.copytree(chat_checkpoint, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    loaded, tokenizer = load_model("tiny-org/tiny-chat")
    assert tokenizer.chat_template and served_model_name("tiny-org/tiny-chat") == "tiny-org/tiny-chat"
    assert all(a.equal(b) for a, b in zip(loaded.state_dict().values(), model().state_dict().values()))
