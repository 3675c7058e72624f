"""benchmarks/tp.py as a user runs it. ``--tp 1`` is refused by argparse naming the flag, as
``vmemkv bench --tp 1`` is: before, it ran a "TP" row of one rank against TP=1 and printed
restart figures for an engine with no ranks ("TP=1 engine start: ... the first (it starts the
rank server) ... with spawn ..."), written to the JSON as ``tp_size`` 1. ``--model`` with a
vocabulary under 1024 tokens gets prompts inside it."""
import pytest

from vmemkv.benchmarks import tp


def test_a_tp_row_of_one_rank_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tp.main(["--tp", "1", "--quick", "--no-restarts"])
    assert exit_info.value.code == 2
    assert "argument --tp: must be >= 2, got 1" in capsys.readouterr().err


def test_a_model_of_a_small_vocabulary_gets_prompts_it_can_read_and_tp_agrees(tmp_path):
    """``--model tiny-llama`` (256 tokens): the prompts were drawn from ids 1..1023 whatever the
    model, so every run of a model below 1024 tokens ended in RequestRejectedError."""
    result = tp.run(quick=True, out=str(tmp_path / "tp.json"), cores=1, restarts=False,
                    model_name="tiny-llama")
    assert result["environment"]["model"] == "tiny-llama"
    assert [r["agree"] for r in result["rows"]] == [1.0, 1.0, 1.0]
    assert result["summary"]["tp_size"] == 2 and result["summary"]["tp_collectives_per_step"] == 5
