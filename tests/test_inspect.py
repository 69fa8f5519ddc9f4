"""python -m accel-train inspect: the data as the run will see it, before any training, with nothing written."""

from __future__ import annotations

import io
import json
import re

from conftest import python_m


def inspect(*args, **kw):
    return python_m(*args, tool="inspect", **kw)


def test_shows_loss_tokens_truncation_lengths_and_packing(tmp_path):
    rows = [{"prompt": "reverse abc", "response": "cba"}, {"prompt": "reverse abcdefghij", "response": "jihgfedcba"},
            {"prompt": "reverse abcdefghijabcdefghij", "response": "x"}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # <|user|>reverse abcdefghij<|assistant|> is 20 tokens: max_length 24 cuts the second response, and the third
    # row's prompt alone (30 tokens) leaves it no target
    proc = inspect(f"data.path={data}", "data.eval_fraction=0", "data.max_length=24", "--samples", "3",
                   f"output_dir={tmp_path / 'out'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # The default, data.truncation=prompt_first: the prompts lose their start, every answer keeps its eos.
    assert "samples: 3 kept; 2 cut to max_length (data.truncation=prompt_first), 0 dropped by it, 0 refused" in out
    assert "cdefghij<|assistant|>[[jihgfedcba</s>]]" in out and "ij<|assistant|>[[x</s>]]" in out

    proc = inspect(f"data.path={data}", "data.eval_fraction=0", "data.max_length=24", "data.truncation=right",
                   "--samples", "2", f"output_dir={tmp_path / 'out'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "format prompt_response, train_on last_assistant, max_length 24" in out
    assert ("samples: 2 kept; 1 cut to max_length (data.truncation=right), 1 dropped by it (first: "
            f"line 3 of {data}: no trained token in the first 24 tokens), 0 refused") in out
    assert "<|user|>reverse abc<|assistant|>[[cba</s>]]" in out
    assert "<|user|>reverse abcdefghij<|assistant|>[[jihg]]" in out  # cut: no eos left
    assert re.search(r"token lengths: min 17, median 20.5, p90 23.3, p99 23.93, max 24", out)
    assert re.search(r"packing \(batch 16\): 1.0 rows per batch; padding efficiency \S+ packed", out)
    assert not (tmp_path / "out").exists()


def test_classification_shows_label_names_and_their_spread(tmp_path):
    rows = [{"text": "good film", "label": "positive"}] * 3 + [{"text": "a very very dull plot", "label": "negative"}]
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = inspect("task=seq_cls", f"data.path={data}", "data.eval_fraction=0", "--samples", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "labels: negative 1 (25.0%), positive 3 (75.0%)" in proc.stdout
    assert "--- sample 0: 9 tokens, label 1 (positive)" in proc.stdout
    assert "padding (batch 16): efficiency 0.571" in proc.stdout  # 9 + 9 + 9 + 21 tokens padded to 4 x 21


def test_a_messages_row_not_ending_with_the_assistant_is_one_line_exit_2(tmp_path):
    data = tmp_path / "m.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    proc = inspect(f"data.path={data}", "data.eval_fraction=0")
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and f"data: line 1 of {data} " in errors[0] and "not an assistant turn" in errors[0]


def test_dpo_shows_pairs_with_their_trained_tokens_and_truncation(tmp_path):
    # builtin:reverse_pref: "<|user|>reverse WORD<|assistant|>" is 13 to 16 tokens, each answer 4 to 7 with </s>:
    # max_length 18 cuts the prompt of the pairs longer than that
    proc = inspect("task=dpo", "data.path=builtin:reverse_pref", "data.builtin_size=50", "data.max_length=18",
                   "--samples", "2", f"output_dir={tmp_path / 'out'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "(task dpo, pairs prompt/chosen/rejected, max_length 18)" in out
    assert "rows: 45 train, 5 eval" in out
    assert "pairs: 45 kept; 0 dropped (chosen and rejected identical after truncation), 33 cut to max_length" in out
    assert "--- pair 0: prompt 13 tokens; chosen 4, rejected 4 with loss, in [[ ]]" in out
    assert "chosen: <|user|>reverse fhd<|assistant|>[[dhf</s>]]" in out
    assert "rejected: <|user|>reverse fhd<|assistant|>[[dcf</s>]]" in out  # a near miss: one letter changed
    assert "chosen: verse eggfd<|assistant|>[[dfgge</s>]]" in out  # the prompt loses its first tokens, not the answer
    assert "prompt tokens: min 11, median 12, p90 13, p99 13, max 13, mean 12.2" in out
    assert re.search(r"padding \(batch 16 pairs, 32 rows\): efficiency 0\.\d{3}", out)
    assert not (tmp_path / "out").exists()


def test_grpo_shows_the_prompts_as_the_model_continues_them(tmp_path):
    # builtin:reverse's prompts are 13 to 16 tokens with the template's generation prompt; data.max_length 22 less
    # grpo.max_new_tokens 8 keeps their last 14
    proc = inspect("task=grpo", "data.builtin_size=50", "data.max_length=22", "grpo.max_new_tokens=8",
                   "grpo.answer_field=response", "--samples", "1", f"output_dir={tmp_path / 'out'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "(task grpo, prompts from prompt; rewards exact_match get the columns response)" in out
    cut = int(re.search(r"rows: 45 train, 5 eval; (\d+) prompts cut to 14 tokens", out).group(1))
    assert 0 < cut < 45
    assert re.search(r"--- prompt 0: 1[34] tokens, then up to 8 generated\n(verse|<\|user\|>reverse) [a-j]+<\|assistant\|>\n",
                     out), out
    assert "prompt tokens: min 13, " in out and "max 14," in out
    assert not (tmp_path / "out").exists()


UNSEEN = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "reverse abc"},
                        {"role": "assistant", "content": "cba"}]}] * 16


def test_unk_tokens_are_reported_with_the_first_row_and_the_chosen_format(tmp_path):
    """Characters the tiny tokenizer has no token for (uppercase, newline) and samples left with nothing to learn
    are reported by inspect, with the row and the characters lost."""
    from accel_train.tools import inspect as inspect_lib
    from accel_train.config.load import load_config

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in UNSEEN))
    out = io.StringIO()
    figures = inspect_lib.inspect_data(load_config(None, [f"data.path={data}", "data.eval_fraction=0"]), 1, out)
    text = out.getvalue()
    assert "format messages from column(s) messages (data.format=auto; the same as data.format=messages)" in text
    assert ("<unk>: 2.94% of the tokens (16 of 544) are characters the tokenizer has no token for; first, in «»: "
            f"line 1 of {data}: system: «B»e brief.<|user|>reverse abc<|assistant|>cba</s>") in text
    assert figures["unk"] == 16 and figures["untrained"] == 0 and "no trained token" not in text

    texts = tmp_path / "texts.txt"
    texts.write_text("abc\nab\n")  # max_length 3: "abc" + eos leaves a chunk of eos alone, nothing to predict
    out = io.StringIO()
    figures = inspect_lib.inspect_data(load_config(None, [f"data.path={texts}", "data.eval_fraction=0",
                                                          "data.max_length=3"]), 1, out)
    assert "no trained token: 1 of 3 samples (33.3%), dropped; first: sample 1: '</s>'" in out.getvalue()
    assert figures["untrained"] == 1 and "<unk>" not in out.getvalue()


def test_training_starts_by_saying_what_the_model_cannot_see(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in UNSEEN))
    proc = python_m(f"data.path={data}", "data.eval_fraction=0", "train.max_steps=1", "track.log_with=[]",
                    f"output_dir={tmp_path / 'out'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    unk = [line for line in proc.stderr.splitlines() if "are <unk>" in line]
    assert len(unk) == 1 and "2.94% of the tokens (16 of 544)" in unk[0] and "system: «B»e brief." in unk[0]
    assert "data: format messages from column(s) messages" in proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["data"]["train"]["unk"], summary["data"]["train"]["tokens"]) == (16, 544)


def test_packing_view_lays_batches_out_as_the_attention_training_runs_under():
    """Under flash-attention training packs each micro-batch into one row (data.pipeline.PackingCollator's varlen);
    under sdpa into rows whose width is chosen by attention's cost: the view reports the layout the run will use."""
    from transformers import AutoTokenizer

    from accel_train.components.views import batch_efficiency
    from accel_train.config.load import load_config
    from accel_train.config.schema import TINY_MODEL

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    lengths = [17, 23, 40, 9, 31, 12, 28, 19] * 4  # 2 batches of 16
    rows = {}
    for attention in ("sdpa", "flash_attention_2"):
        cfg = load_config(None, [f"model.attn_implementation={attention}", "data.group_by_length=false"])
        line = batch_efficiency(cfg, lengths, tokenizer, packs=True)
        rows[attention] = float(re.search(r"packing \(batch 16\): ([\d.]+) rows per batch", line).group(1))
        if attention != "sdpa":  # one row a batch, as long as its samples: no padding
            assert "padding efficiency 1.000 packed" in line
    assert rows["flash_attention_2"] == 1.0 and rows["sdpa"] > 1


def test_the_batch_views_round_widths_up_as_training_does():
    """data.pad_to_multiple_of (and in bf16/fp16 its defaults, data.pipeline.width_multiple): the padded batches
    and the packed rows the view reports are as wide as training makes them, not their longest sample."""
    from transformers import AutoTokenizer

    from accel_train.components.views import batch_efficiency
    from accel_train.config.load import load_config
    from accel_train.config.schema import TINY_MODEL

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    lengths = [17, 23, 40, 9, 31, 12, 28, 19] * 4  # one batch of 32
    real, longest = sum(lengths), max(lengths)  # 716, 40
    for multiple in (1, 48):
        cfg = load_config(None, [f"data.pad_to_multiple_of={multiple}", "train.per_device_batch_size=32",
                                 "model.attn_implementation=flash_attention_2"])
        line = batch_efficiency(cfg, lengths, tokenizer, packs=True)
        # one row (flash-attention): 716 wide, 720 at a multiple of 48 (15 x 48)
        assert f"padding efficiency {real / (-(-real // multiple) * multiple):.3f} packed" in line, line
        # padded: 32 rows as wide as the longest, 40, or 48
        wide = -(-longest // multiple) * multiple
        assert line.endswith(f"vs {real / (32 * wide):.3f} padded"), line
        padded = batch_efficiency(cfg, lengths, tokenizer, packs=False)
        assert f"efficiency {real / (32 * wide):.3f}" in padded, padded
        assert ("rounded up to a multiple of 48" in padded) is (multiple == 48), padded
