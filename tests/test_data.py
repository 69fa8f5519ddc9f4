"""Data: loading every supported source, loss masking per task, truncation, dynamic padding, clear errors."""

from __future__ import annotations

import copy
import json
import math
import random
import re

import pytest
import torch
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value
from transformers import AutoTokenizer

from accel_train.data import pipeline as data_lib
from accel_train import tasks
from accel_train.data import sources as data_sources
from accel_train.data import formats
from accel_train.tasks.seq_cls import check_labels, label_names, num_labels
from conftest import check_columns, tokenized
from accel_train.data.sources import check_data_source
from accel_train.config.schema import TINY_MODEL
from accel_train.config.load import load_config
from accel_train.config.sections import ConfigError
from accel_train.data.pipeline import IGNORE_INDEX


def make_cfg(*overrides: str):
    return load_config(None, list(overrides))


@pytest.fixture(scope="module", autouse=True)
def accelerate_state():
    """data.tokenize logs through accelerate's logger (on the main process), as it does in a run."""
    from accelerate import PartialState

    PartialState(cpu=True)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY_MODEL)


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def assistant_id(tok) -> int:
    return tok.convert_tokens_to_ids("<|assistant|>")


def targets(sample: dict) -> list[int]:
    """The input ids the loss is computed on."""
    return [i for i, lab in zip(sample["input_ids"], sample["labels"]) if lab != IGNORE_INDEX]


def assert_only_tail_labelled(sample: dict, start: int):
    """Labels are IGNORE_INDEX before `start` and equal the input ids from `start` on."""
    assert len(sample["labels"]) == len(sample["input_ids"]) == len(sample["attention_mask"])
    assert sample["labels"][:start] == [IGNORE_INDEX] * start
    assert sample["labels"][start:] == sample["input_ids"][start:]
    assert sample["attention_mask"] == [1] * len(sample["input_ids"])


# ---------------------------------------------------------------------------------------------------- tokenize_causal


def test_prompt_response_row_masks_prompt_and_generation_prompt(tok):
    cfg = make_cfg()
    out = formats.tokenize_causal({"prompt": "reverse abc", "response": "cba"}, tok, cfg)

    messages = [{"role": "user", "content": "reverse abc"}, {"role": "assistant", "content": "cba"}]
    assert out["input_ids"] == tok.apply_chat_template(messages)["input_ids"]
    # Everything up to and including the `<|assistant|>` generation prompt is masked ...
    start = out["input_ids"].index(assistant_id(tok)) + 1
    assert_only_tail_labelled(out, start)
    # ... and the loss covers exactly the response and the closing eos.
    assert targets(out) == ids(tok, "cba") + [tok.eos_token_id]
    assert out["input_ids"][-1] == tok.eos_token_id


def test_messages_column_labels_only_the_last_assistant_turn(tok):
    cfg = make_cfg()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}]
    # Through tokenize(), so the messages come back the way `datasets` stores them (a list of structs).
    out = tokenized(Dataset.from_list([{"messages": messages}]), tok, cfg)[0]

    assert out["input_ids"] == tok.apply_chat_template(messages)["input_ids"]
    last_assistant = max(i for i, t in enumerate(out["input_ids"]) if t == assistant_id(tok))
    assert_only_tail_labelled(out, last_assistant + 1)
    assert targets(out) == ids(tok, "cd") + [tok.eos_token_id]  # not "yo": the earlier turn is context


def test_without_chat_template_the_prompt_text_is_masked(tok):
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    cfg = make_cfg()
    out = formats.tokenize_causal({"prompt": "reverse abc", "response": "cba"}, plain, cfg)

    prompt_ids = plain("reverse abc\n")["input_ids"]
    assert out["input_ids"] == prompt_ids + ids(plain, "cba") + [plain.eos_token_id]
    assert_only_tail_labelled(out, len(prompt_ids))
    assert targets(out) == ids(plain, "cba") + [plain.eos_token_id]
    assert assistant_id(plain) not in out["input_ids"]  # no chat markup without a template
    assert tok.chat_template  # the shared tokenizer was not touched


def test_right_truncation_drops_samples_without_targets_and_cuts_long_responses(tok):
    short = {"prompt": "ab", "response": "ba"}  # <|user|> a b <|assistant|> b a </s>: 7 tokens
    long = {"prompt": "reverse abcdefghij", "response": "jihgfedcba"}  # 20 prompt tokens
    raw = Dataset.from_list([short, long])
    long_prompt_len = len(formats.tokenize_causal(long, tok, make_cfg())["input_ids"]) - len("jihgfedcba") - 1
    assert long_prompt_len == 20

    # Shorter than the long prompt: that sample keeps no target token and is dropped; the short one is intact.
    for max_length in (12, long_prompt_len):
        cfg = make_cfg(f"data.max_length={max_length}", "data.truncation=right")
        report = {}
        out = tokenized(raw, tok, cfg, report=report)
        assert len(out) == 1, max_length
        assert targets(out[0]) == ids(tok, "ba") + [tok.eos_token_id]
        assert (report["rows"], report["cut"], report["dropped"], report["refused"]) == (2, 0, 1, 0)
        assert report["first_dropped"].startswith("row 2: no trained token")

    # A length that cuts the response keeps the sample, cut to max_length, with the surviving response labelled,
    # and counts it.
    cfg = make_cfg(f"data.max_length={long_prompt_len + 3}", "data.truncation=right")
    report = {}
    out = tokenized(raw, tok, cfg, report=report)
    assert len(out) == 2 and (report["cut"], report["dropped"]) == (1, 0)
    cut = out[1]
    assert len(cut["input_ids"]) == len(cut["labels"]) == len(cut["attention_mask"]) == long_prompt_len + 3
    assert_only_tail_labelled(cut, long_prompt_len)
    assert targets(cut) == ids(tok, "jih")  # the eos was cut off with the rest of the response


def test_prompt_first_truncation_keeps_the_whole_answer_and_its_end_of_turn(tok, caplog):
    """The default: the prompt's oldest tokens go, the answer keeps its eos, so the model still learns to stop; a
    sample whose answer alone does not fit is dropped, and both are counted and logged."""
    long = {"prompt": "reverse abcdefghij", "response": "jihgfedcba"}  # 20 prompt tokens, 11 answer tokens
    whole = formats.tokenize_causal(long, tok, make_cfg())
    raw = Dataset.from_list([{"prompt": "ab", "response": "ba"}, long])
    cfg = make_cfg("data.max_length=12")
    report = {}
    with caplog.at_level("WARNING"):
        out = tokenized(raw, tok, cfg, report=report)
    assert len(out) == 2 and (report["cut"], report["dropped"]) == (1, 0)
    assert out[1]["input_ids"] == whole["input_ids"][-12:]  # the generation prompt and the whole answer
    assert targets(out[1]) == ids(tok, "jihgfedcba") + [tok.eos_token_id]
    assert "1 of 2 samples cut and 0 dropped at data.max_length=12 (data.truncation=prompt_first)" in caplog.text

    report = {}
    out = tokenized(raw, tok, make_cfg("data.max_length=11"), report=report)  # no room for one prompt token
    assert len(out) == 1 and (report["cut"], report["dropped"]) == (0, 1)
    assert report["first_dropped"] == "row 2: the last answer alone is 11 tokens"


def test_numeric_looking_csv_values_are_tokenized_as_text(tmp_path, tok):
    """BUG (data.py): `datasets` infers int64 for a CSV column of numbers, e.g. arithmetic answers; the chat
    template then concatenates str + int and tokenizing fails with a bare TypeError."""
    path = tmp_path / "sums.csv"
    path.write_text("prompt,response\nwhat is 2+2,4\nwhat is 3+4,7\n")
    cfg = make_cfg(f"data.path={path}", "data.eval_fraction=0")
    train, _ = data_lib.load_splits(cfg)
    out = tokenized(train, tok, cfg)
    assert [targets(s) for s in out] == [ids(tok, "4") + [tok.eos_token_id], ids(tok, "7") + [tok.eos_token_id]]


# ---------------------------------------------------------------------------------------------------- load_splits

ROWS = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(20)]


def _write_jsonl(path_dir):
    path = path_dir / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _write_json(path_dir):
    path = path_dir / "data.json"
    Dataset.from_list(ROWS).to_json(path)  # JSON lines, which the json builder reads from a .json file too
    return path


def _write_csv(path_dir):
    path = path_dir / "data.csv"
    Dataset.from_list(ROWS).to_csv(path)
    return path


def _write_parquet(path_dir):
    path = path_dir / "data.parquet"
    Dataset.from_list(ROWS).to_parquet(path)
    return path


def _write_dataset_folder(path_dir):
    path = path_dir / "ds"
    Dataset.from_list(ROWS).save_to_disk(path)
    return path


def _write_dataset_dict_folder(path_dir):
    path = path_dir / "dd"
    DatasetDict(train=Dataset.from_list(ROWS), test=Dataset.from_list([{"prompt": "t", "response": "u"}] * 3)
                ).save_to_disk(path)
    return path


WRITERS = [_write_jsonl, _write_json, _write_csv, _write_parquet, _write_dataset_folder, _write_dataset_dict_folder]


@pytest.mark.parametrize("write", WRITERS, ids=lambda w: w.__name__.removeprefix("_write_"))
def test_load_splits_reads_local_sources_and_carves_eval(tmp_path, write):
    path = write(tmp_path)

    def split(seed):
        train, evaluation = data_lib.load_splits(make_cfg(f"data.path={path}", "data.eval_fraction=0.25", f"seed={seed}"))
        return train.to_list(), evaluation.to_list()

    train, evaluation = split(seed=1)
    assert (len(train), len(evaluation)) == (15, 5)
    assert sorted(train + evaluation, key=lambda r: int(r["prompt"][1:])) == ROWS  # a partition, values intact
    assert split(seed=1) == (train, evaluation)  # same seed, same split
    assert sorted(r["prompt"] for r in split(seed=2)[1]) != sorted(r["prompt"] for r in evaluation)


def test_load_splits_uses_a_named_eval_split_and_caps_train(tmp_path):
    path = _write_dataset_dict_folder(tmp_path)
    train, evaluation = data_lib.load_splits(make_cfg(f"data.path={path}", "data.eval_split=test"))
    assert train.to_list() == ROWS  # nothing carved out when an eval split is named
    assert evaluation.to_list() == [{"prompt": "t", "response": "u"}] * 3

    train, evaluation = data_lib.load_splits(make_cfg(f"data.path={path}", "data.eval_split=test", "data.max_samples=4"))
    capped = train.to_list()
    assert len(capped) == 4 and all(r in ROWS for r in capped) and len({r["prompt"] for r in capped}) == 4
    assert len(evaluation) == 3  # max_samples caps train only

    train, _ = data_lib.load_splits(make_cfg(f"data.path={path}", "data.eval_split=test", "data.max_samples=1000"))
    assert len(train) == len(ROWS)

    with pytest.raises(ConfigError) as e:
        data_lib.load_splits(make_cfg(f"data.path={path}", "data.eval_split=validation"))
    assert "'validation'" in str(e.value) and "train, test" in str(e.value)


def test_load_splits_without_eval(tmp_path):
    path = _write_jsonl(tmp_path)
    train, evaluation = data_lib.load_splits(make_cfg(f"data.path={path}", "data.eval_fraction=0"))
    assert evaluation is None and train.to_list() == ROWS


def _write_sources(tmp_path) -> dict:
    """Four prompt/response rows, the third with no response, in each file type: {path: where a message finds
    that row}. JSON lines after a blank line (datasets skips it); a JSON array, indented (4 lines an element); a
    CSV with its header and a prompt quoted over two lines; a parquet file, which has no lines."""
    rows = [{"prompt": f"reverse {w}", "response": w[::-1]} for w in ["abc", "bcd", "cde", "def"]]
    del rows[2]["response"]
    jsonl, array, table, parquet = (tmp_path / f"d.{s}" for s in ("jsonl", "json", "csv", "parquet"))
    jsonl.write_text(json.dumps(rows[0]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in rows[1:]))
    array.write_text(json.dumps(rows, indent=2))
    table.write_text('prompt,response\nreverse abc,cba\n"reverse\nbcd",dcb\nreverse cde,\nreverse def,fed\n')
    Dataset.from_list(rows).to_parquet(parquet)
    return {jsonl: f"line 4 of {jsonl}", array: f"line 10 of {array}", table: f"line 5 of {table}",
            parquet: f"row 3 of 4 in {parquet}"}


def test_a_row_is_named_by_the_line_an_editor_shows_and_a_missing_key_as_missing(tmp_path, tok):
    """Before: "row 2" (from 0, whatever the file), and the missing response trained on as the text "None"."""
    for path, where in _write_sources(tmp_path).items():
        cfg = make_cfg(f"data.path={path}", "data.eval_fraction=0")
        with pytest.raises(ConfigError) as e:
            tokenized(data_lib.load_splits(cfg)[0], tok, cfg)
        assert str(e.value) == f"data: {where} has no 'response' (the key is missing or null); add it or drop the row"
    # a split carved and shuffled at load names the file's line too, and an empty value is empty, not missing
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"reverse {w}", "response": "" if i == 7 else w[::-1]}) + "\n"
                            for i, w in enumerate(["abc", "bcd", "cde"] * 4)))
    cfg = make_cfg(f"data.path={path}", "data.eval_fraction=0.5", "task=dpo", "dpo.chosen_field=response",
                   "dpo.rejected_field=prompt")
    with pytest.raises(ConfigError) as e:
        for split in data_lib.load_splits(cfg):
            tokenized(split, tok, cfg)
    assert str(e.value) == f"data: line 8 of {path}: 'response' is empty; fill it or drop the row"


# ---------------------------------------------------------------------------------------------------- checks


@pytest.mark.parametrize("path", ["/nope/x.jsonl", "./missing.csv"])
def test_check_source_names_a_missing_file(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        check_data_source(make_cfg(f"data.path={path}"))
    assert "not found" in str(e.value) and path in str(e.value)


def test_check_source_lists_builtins_for_an_unknown_one():
    with pytest.raises(ConfigError) as e:
        check_data_source(make_cfg("data.path=builtin:foo"))
    assert "builtin:foo" in str(e.value) and "builtin:reverse" in str(e.value) and "builtin:sentiment" in str(e.value)


def test_check_source_rejects_an_unsupported_file_type(tmp_path):
    sheet = tmp_path / "data.xlsx"
    sheet.write_text("hello\n")
    with pytest.raises(ConfigError) as e:
        check_data_source(make_cfg(f"data.path={sheet}"))
    assert "'.xlsx'" in str(e.value) and ".jsonl" in str(e.value) and ".txt" in str(e.value)


def test_check_source_accepts_valid_sources(tmp_path):
    for path in ("builtin:reverse", "builtin:sentiment", _write_jsonl(tmp_path), _write_dataset_folder(tmp_path)):
        check_data_source(make_cfg(f"data.path={path}"))  # no error


@pytest.mark.parametrize("key", ["data.name=sst2", "data.revision=main"])
def test_hub_only_keys_with_local_or_builtin_data_are_refused_not_ignored(tmp_path, key):
    for path in ("builtin:reverse", _write_jsonl(tmp_path)):
        with pytest.raises(ConfigError) as e:
            check_data_source(make_cfg(f"data.path={path}", key))
        assert f"{key} would be ignored: data.path={path} is a" in str(e.value)
    check_data_source(make_cfg("data.path=json", f"data.data_files=[{_write_jsonl(tmp_path)}]", "data.name=x"))


def test_check_columns_names_missing_and_found_columns():
    ds = Dataset.from_list([{"text": "good film", "score": 1}])
    with pytest.raises(ConfigError) as e:
        check_columns(make_cfg("task=seq_cls", "data.path=reviews.csv"), ds)
    message = str(e.value)
    assert "lacks column(s) label" in message and "columns found: text, score" in message and "reviews.csv" in message

    check_columns(make_cfg("task=seq_cls", "data.label_field=score"), ds)  # mapped: no error
    check_columns(make_cfg(), Dataset.from_list([{"messages": [{"role": "user", "content": "x"}]}]))
    with pytest.raises(ConfigError, match="lacks column\\(s\\) response"):
        check_columns(make_cfg(), Dataset.from_list([{"prompt": "x"}]))


def test_num_labels_from_classlabel_max_label_or_override():
    features = Features({"text": Value("string"), "label": ClassLabel(names=["neg", "neutral", "pos"])})
    with_classlabel = Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]}, features=features)
    assert num_labels(make_cfg("task=seq_cls"), with_classlabel) == 3  # the feature, not the labels seen

    plain = Dataset.from_dict({"text": ["a", "b", "c"], "label": [0, 4, 1]})
    assert num_labels(make_cfg("task=seq_cls"), plain) == 5

    assert num_labels(make_cfg("task=seq_cls", "model.num_labels=7"), with_classlabel) == 7
    assert num_labels(make_cfg("task=seq_cls", "model.num_labels=7"), plain) == 7


def test_num_labels_sees_every_class_when_max_samples_caps_a_sorted_train_split(tmp_path):
    """BUG (data.py): with an eval split named, max_samples keeps the first rows of train in file order; on a
    label-sorted dataset (IMDB's train split is) they hold one class only, so num_labels, called on that capped
    train split as train.py does, returns 1: a 1-label head, which transformers trains as regression."""
    path = tmp_path / "reviews"
    DatasetDict(train=Dataset.from_dict({"text": [f"t{i}" for i in range(20)], "label": [0] * 10 + [1] * 10}),
                test=Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]})).save_to_disk(path)
    cfg = make_cfg("task=seq_cls", f"data.path={path}", "data.eval_split=test", "data.max_samples=10")
    train, evaluation = data_lib.load_splits(cfg)
    assert len(train) == 10
    assert num_labels(cfg, train) == 2


# ---------------------------------------------------------------------------------------------------- dataloaders


def test_causal_batches_are_padded_per_batch(tok):
    cfg = make_cfg()
    rows = [{"prompt": "ab", "response": "b"}, {"prompt": "abcd", "response": "dc"},
            {"prompt": "abcdefgh", "response": "hg"}, {"prompt": "abcdefghij", "response": "jihgf"}]
    ds = tokenized(Dataset.from_list(rows), tok, cfg)
    lengths = [len(x) for x in ds["input_ids"]]
    assert lengths == sorted(set(lengths))  # distinct lengths, so padding shows

    batches = list(data_lib.make_dataloader(ds, tasks.make(cfg).collator(tok), cfg, batch_size=2, shuffle=False))
    assert len(batches) == 2
    for b, batch in enumerate(batches):
        samples = [ds[2 * b], ds[2 * b + 1]]
        width = max(lengths[2 * b: 2 * b + 2])
        assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (2, width)
        for row, sample in enumerate(samples):
            n = len(sample["input_ids"])
            mask = batch["attention_mask"][row]
            real = mask.bool()
            assert int(mask.sum()) == n
            assert batch["input_ids"][row][real].tolist() == sample["input_ids"]
            assert batch["labels"][row][real].tolist() == sample["labels"]
            assert (batch["labels"][row][~real] == IGNORE_INDEX).all()
            assert (batch["input_ids"][row][~real] == tok.pad_token_id).all()
    assert batches[0]["input_ids"].shape[1] < batches[1]["input_ids"].shape[1]  # not padded to a global length


def test_seq_cls_batches_are_padded_per_batch(tok):
    cfg = make_cfg("task=seq_cls", "data.path=builtin:sentiment", "data.group_by_length=false")
    raw = data_lib.builtin_dataset("sentiment", 8)
    ds = tokenized(raw, tok, cfg)
    batch = next(iter(data_lib.make_dataloader(ds, tasks.make(cfg).collator(tok), cfg, batch_size=4, shuffle=False)))
    assert batch["labels"].tolist() == raw["label"][:4]
    lengths = [len(x) for x in ds["input_ids"][:4]]
    assert batch["input_ids"].shape == (4, max(lengths))
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths
    assert batch["input_ids"].dtype == torch.long


def skewed_lengths(n: int, seed: int = 0) -> list[int]:
    """Short sentences with a long tail (log-normal, median 12 tokens, up to 128)."""
    rng = random.Random(seed)
    return [min(128, max(2, round(rng.lognormvariate(math.log(12), 0.8)))) for _ in range(n)]


def padding_efficiency(order: list[int], lengths: list[int], batch: int) -> float:
    batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    return sum(lengths) / sum(len(b) * max(lengths[i] for i in b) for b in batches)


def test_length_grouped_order_is_seeded_complete_and_pads_little():
    lengths, step, batch = skewed_lengths(1000), 16, 4  # effective batch 16: e.g. 2 processes x batch 4 x accum 2
    sampler = data_lib.LengthGroupedSampler(lengths, step, seed=3)
    epochs = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        epochs.append(list(sampler))
        assert sorted(epochs[-1]) == list(range(1000)), "a sample was dropped or repeated"
        assert list(sampler) == epochs[-1], "iterating again changed the order"
    assert epochs[0] != epochs[1], "no reshuffle between epochs"
    again = data_lib.LengthGroupedSampler(lengths, step, seed=3)
    again.set_epoch(1)
    assert list(again) == epochs[1], "the order is not a function of (seed, epoch)"
    shuffled = torch.randperm(1000, generator=torch.Generator().manual_seed(3)).tolist()
    print(f"padding efficiency: shuffled {padding_efficiency(shuffled, lengths, batch):.3f}, "
          f"grouped {padding_efficiency(epochs[0], lengths, batch):.3f}")
    assert padding_efficiency(shuffled, lengths, batch) < 0.6 < 0.9 < padding_efficiency(epochs[0], lengths, batch)
    # each group of 50 steps is the same samples as the plain seeded shuffle's, in steps in a random order
    for g in range(0, 1000, 50 * step):
        assert sorted(epochs[0][g:g + 50 * step]) == sorted(shuffled[g:g + 50 * step])
    longest = [max(lengths[i] for i in epochs[0][s:s + step]) for s in range(0, 50 * step, step)]
    assert longest != sorted(longest, reverse=True), "steps sweep from long to short"


def test_grouped_evaluation_batches_are_longest_first_and_complete(tok):
    cfg = make_cfg("task=seq_cls", "data.path=builtin:sentiment")
    assert cfg.data.group_by_length and not make_cfg().data.group_by_length  # the defaults per task
    raw = data_lib.builtin_dataset("sentiment", 30)
    ds = tokenized(raw, tok, cfg)
    batches = list(data_lib.make_dataloader(ds, tasks.make(cfg).collator(tok), cfg, batch_size=4, shuffle=False))
    widths = [b["input_ids"].shape[1] for b in batches]
    assert widths == sorted(widths, reverse=True)
    real = [int(n) for b in batches for n in b["attention_mask"].sum(1)]
    assert real == sorted(real, reverse=True) and sum(len(b["labels"]) for b in batches) == 30
    assert sorted(real) == sorted(len(x) for x in ds["input_ids"])


def test_rank_balanced_order_keeps_each_micro_step_and_evens_the_ranks_tokens():
    """2 processes x batch 8 on the bench's skewed lengths: each window of 2 batches (one micro-step, a batch per
    rank) holds the seeded shuffle's samples, split so that the ranks' tokens are about even."""
    from accel_train.bench.workloads import sample_lengths

    lengths, batch, procs = sample_lengths("skewed", 1003, 1024, random.Random(0)), 8, 2
    sampler = data_lib.RankBalancedSampler(lengths, batch, procs, seed=5)
    window = batch * procs
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        order = list(sampler)
        shuffled = torch.randperm(1003, generator=torch.Generator().manual_seed(5 + epoch)).tolist()  # accelerate's
        assert sorted(order) == list(range(1003)) and list(sampler) == order
        for w in range(0, 1003, window):
            assert sorted(order[w:w + window]) == sorted(shuffled[w:w + window]), "a sample left its micro-step"
        tail = 1003 // window * window
        assert order[tail:] == shuffled[tail:]  # the last, partial window: as shuffled, as accelerate deals it

        def slowest(o):  # the rank with the most tokens, per micro-step, over the mean
            loads = [[sum(lengths[i] for i in o[w + r * batch:w + (r + 1) * batch]) for r in range(procs)]
                     for w in range(0, tail, window)]
            return sum(max(x) / (sum(x) / procs) for x in loads) / len(loads)

        print(f"epoch {epoch}: slowest rank's tokens over the mean: shuffled {slowest(shuffled):.3f}, "
              f"balanced {slowest(order):.3f}")
        assert slowest(shuffled) > 1.1 and slowest(order) < 1.03
    # equal lengths: nothing to even out, the shuffle's split is kept
    same = data_lib.RankBalancedSampler([5] * 40, 4, 2, seed=5)
    assert list(same) == torch.randperm(40, generator=torch.Generator().manual_seed(5)).tolist()


def test_width_rounding_under_bf16_is_32_for_packed_rows_8_for_padded_batches():
    cfg = make_cfg()
    assert [data_lib.width_multiple(cfg, precision, pack) for precision, pack in (
        ("bf16", True), ("bf16", False), ("fp16", False), ("no", True), ("no", False))] == [32, 8, 8, 1, 1]
    assert data_lib.width_multiple(make_cfg("data.pad_to_multiple_of=64"), "bf16", False) == 64  # asked: kept


def test_grouped_classification_training_batches_are_90_percent_real_tokens_under_bf16(tok):
    """The bench's `cls` lengths (log-normal, median 128 tokens, up to 1,024), batches of 16 as the training loader
    of a bf16 run builds them (grouped by length, widths rounded up): at least 0.9 of the computed tokens are data."""
    from accel_train.bench.workloads import sample_lengths

    cfg = make_cfg("task=seq_cls", "data.path=builtin:sentiment", "train.mixed_precision=bf16")
    lengths = sample_lengths("cls", 3200, 1024, random.Random(0))
    ds = Dataset.from_dict({"input_ids": [[7] * n for n in lengths], "attention_mask": [[1] * n for n in lengths],
                            "labels": [0] * len(lengths)})
    multiple = data_lib.width_multiple(cfg, "bf16", pack=False)
    real = computed = 0
    collate = tasks.make(cfg).collator(tok, multiple=multiple)
    for batch in data_lib.make_dataloader(ds, collate, cfg, 16, shuffle=True, step_samples=16):
        assert batch["input_ids"].shape[1] % multiple == 0
        real, computed = real + int(batch["attention_mask"].sum()), computed + batch["input_ids"].numel()
    assert real == sum(lengths)
    print(f"padding efficiency: {real / computed:.3f}")
    assert real / computed >= 0.9


# ---------------------------------------------------------------------------------------------------- built-in data


def test_builtin_datasets_are_deterministic():
    for name in data_sources.BUILTIN:
        assert data_lib.builtin_dataset(name, 50).to_list() == data_lib.builtin_dataset(name, 50).to_list()
    # The run's seed changes the train/eval split, never the data itself.
    splits = [data_lib.load_splits(make_cfg("data.builtin_size=40", f"seed={seed}")) for seed in (1, 2)]
    everything = [sorted(map(json.dumps, train.to_list() + evaluation.to_list())) for train, evaluation in splits]
    assert everything[0] == everything[1]
    assert splits[0][1].to_list() != splits[1][1].to_list()


def test_builtin_reverse_responses_are_reversed_words():
    for row in data_lib.builtin_dataset("reverse", 200):
        verb, word = row["prompt"].split(" ")
        assert verb == "reverse" and 3 <= len(word) <= 6 and row["response"] == word[::-1]


def test_builtin_sentiment_labels_follow_the_word_counts():
    rows = data_lib.builtin_dataset("sentiment", 300).to_list()
    for row in rows:
        words = row["text"].split()
        n_pos = sum(w in data_sources.POSITIVE_WORDS for w in words)
        n_neg = sum(w in data_sources.NEGATIVE_WORDS for w in words)
        assert n_pos != n_neg and row["label"] == int(n_pos > n_neg), row
    assert {r["label"] for r in rows} == {0, 1}


# ---------------------------------------------------------------------------------------------------- formats


def test_messages_with_text_parts_and_a_tool_call_turn_are_rendered_intact(tok):
    """OpenAI-style content given as a list of parts, and a turn whose content is None (a tool call): the text is
    what the parts say, never the string 'None'. The tiny model's template does not show tool calls, so it renders
    that turn as an empty answer, and the row is refused (counted, with the reason) rather than trained on."""
    rows = [{"messages": [
        {"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": "{}"}]},
        {"role": "user", "content": [{"type": "text", "text": "ef"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "gh"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "gh"}]}]}]
    ds = Dataset.from_list(rows)
    messages = formats.conversation(ds[0], make_cfg(), "messages", 0)
    assert [m["content"] for m in messages] == ["abcd", "", "ef", "gh"]
    report = {}
    out = tokenized(ds, tok, make_cfg(), report=report)
    assert report["refused"] == 1 and report["first_refused"] == (
        "row 1: the chat template renders assistant turn 1 empty (it does not show tool calls)")
    plain = [{"role": "user", "content": "abcd"}, {"role": "assistant", "content": "gh"}]
    assert len(out) == 1 and out[0]["input_ids"] == tok.apply_chat_template(plain)["input_ids"]
    assert "None" not in tok.decode(out[0]["input_ids"])
    assert targets(out[0]) == ids(tok, "gh") + [tok.eos_token_id]


def test_sharegpt_conversations_map_speakers_to_roles(tok):
    rows = [{"conversations": [{"from": "human", "value": "ab"}, {"from": "gpt", "value": "ba"}]}]
    out = tokenized(Dataset.from_list(rows), tok, make_cfg())[0]
    messages = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]
    assert out["input_ids"] == tok.apply_chat_template(messages)["input_ids"]
    assert targets(out) == ids(tok, "ba") + [tok.eos_token_id]


@pytest.mark.parametrize("extra", ["", "xy"])
def test_alpaca_rows_become_a_prompt_and_an_answer(tok, extra):
    row = {"instruction": "reverse", "input": extra, "output": "esrever"}
    out = formats.tokenize_causal(row, tok, make_cfg())
    prompt = "reverse" + (f"\n\n{extra}" if extra else "")
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": "esrever"}]
    assert out["input_ids"] == tok.apply_chat_template(messages)["input_ids"]
    assert targets(out) == ids(tok, "esrever") + [tok.eos_token_id]


MULTI_TURN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
              {"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}]


@pytest.mark.parametrize("template", [True, False], ids=["chat-template", "no-template"])
def test_train_on_all_assistant_turns_or_all_tokens(tok, template):
    tokenizer = copy.deepcopy(tok)
    if not template:
        tokenizer.chat_template = None
    ds = Dataset.from_list([{"messages": MULTI_TURN}])
    every = tokenized(ds, tokenizer, make_cfg("data.train_on=all_assistant"))[0]
    last = tokenized(ds, tokenizer, make_cfg("data.train_on=last_assistant"))[0]
    everything = tokenized(ds, tokenizer, make_cfg("data.train_on=all"))[0]
    assert every["input_ids"] == last["input_ids"] == everything["input_ids"]
    eos = [tokenizer.eos_token_id]
    assert targets(every) == ids(tokenizer, "yo") + eos + ids(tokenizer, "cd") + eos
    assert targets(last) == ids(tokenizer, "cd") + eos
    assert everything["labels"] == everything["input_ids"]
    if not template:  # the turns as lines of text, an eos after each answer
        expected = (tokenizer("hi\n")["input_ids"] + ids(tokenizer, "yo") + eos
                    + tokenizer("ab\n", add_special_tokens=False)["input_ids"] + ids(tokenizer, "cd") + eos)
        assert every["input_ids"] == expected


def test_a_conversation_not_ending_with_the_assistant_names_the_row(tok):
    rows = [{"messages": MULTI_TURN}, {"messages": MULTI_TURN[:3]}]
    with pytest.raises(ConfigError) as e:
        tokenized(Dataset.from_list(rows), tok, make_cfg())
    message = str(e.value)
    assert message.startswith("data: row 2 (") and "ends with 'user'" in message and "\n" not in message
    tokenized(Dataset.from_list(rows), tok, make_cfg("data.train_on=all"))  # all tokens: nothing to find


def test_plain_text_is_split_into_max_length_chunks_with_loss_on_every_token(tok):
    text = "the quick brown fox jumps over the lazy dog"
    ds = Dataset.from_list([{"text": text}, {"text": "ab"}])
    out = tokenized(ds, tok, make_cfg("data.max_length=16"))
    whole = tok(text)["input_ids"] + [tok.eos_token_id]
    assert [s["input_ids"] for s in out][:3] == [whole[:16], whole[16:32], whole[32:]]
    assert all(s["labels"] == s["input_ids"] for s in out)
    assert out[3]["input_ids"] == tok("ab")["input_ids"] + [tok.eos_token_id]
    assert len(out) == 4  # nothing dropped: every chunk here has a token to predict


def test_format_is_chosen_by_config_and_missing_columns_are_named():
    cols = ["instruction", "input", "output"]
    assert formats.resolve_format(make_cfg(), cols) == "alpaca"
    assert formats.resolve_format(make_cfg(), ["text"]) == "text"
    assert formats.resolve_format(make_cfg(), ["conversations"]) == "messages"
    assert formats.resolve_format(make_cfg("data.format=text", "data.text_field=output"), cols) == "text"
    with pytest.raises(ConfigError, match="lacks column\\(s\\) output"):
        check_columns(make_cfg(), Dataset.from_list([{"instruction": "x"}]))
    with pytest.raises(ConfigError, match="lacks column\\(s\\) body"):
        check_columns(make_cfg("data.format=text", "data.text_field=body"), Dataset.from_list([{"x": "y"}]))


# ---------------------------------------------------------------------------------------------------- labels


def test_string_labels_are_mapped_to_ids_in_sorted_order(tok):
    train = Dataset.from_list([{"text": "ab", "label": "positive"}, {"text": "cd", "label": "negative"},
                               {"text": "ef", "label": "neutral"}])
    evaluation = Dataset.from_list([{"text": "gh", "label": "positive"}])
    cfg = make_cfg("task=seq_cls")
    names = label_names(cfg, train, evaluation)
    assert names == ["negative", "neutral", "positive"] and num_labels(cfg, train, evaluation) == 3
    check_labels(cfg, 3, train, evaluation)
    out = tokenized(train, tok, cfg, names)
    assert out["labels"] == [2, 0, 1]
    with pytest.raises(ConfigError, match="3 classes"):
        check_labels(make_cfg("task=seq_cls", "model.num_labels=2"), 2, train, evaluation)
    with_classlabel = train.cast_column("label", ClassLabel(names=["negative", "neutral", "positive"]))
    assert label_names(cfg, with_classlabel) == ["negative", "neutral", "positive"]
    assert label_names(cfg, Dataset.from_list([{"text": "x", "label": 1}])) is None


# ---------------------------------------------------------------------------------------------------- hub options


def test_hub_dataset_options_are_passed_to_load_dataset(monkeypatch):
    seen = {}

    def fake_load_dataset(path, **kwargs):
        seen.update(path=path, **kwargs)
        return DatasetDict(train=Dataset.from_list(ROWS))

    monkeypatch.setattr(data_lib, "load_dataset", fake_load_dataset)
    cfg = make_cfg("data.path=glue", "data.name=sst2", "data.revision=abc123", "data.eval_fraction=0",
                   "data.data_files={train: [train-*.parquet]}")
    train, _ = data_lib.load_splits(cfg)
    assert seen == {"path": "glue", "name": "sst2", "revision": "abc123", "streaming": False,
                    "data_files": {"train": ["train-*.parquet"]}}
    assert train.to_list() == ROWS


def test_local_folder_with_named_subsets_and_data_file_globs(tmp_path):
    """A folder laid out as on the hub: a README declaring two configurations (subsets), each with its splits."""
    for subset, n in (("small", 4), ("large", 9)):
        (tmp_path / subset).mkdir()
        for split, k in (("train", n), ("test", 2)):
            rows = [{"prompt": f"{subset}{i}", "response": "r"} for i in range(k)]
            (tmp_path / subset / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {s}\n  data_files:\n  - split: train\n    path: {s}/train.jsonl\n"
        f"  - split: test\n    path: {s}/test.jsonl\n" for s in ("small", "large")) + "---\n")
    train, evaluation = data_lib.load_splits(make_cfg(f"data.path={tmp_path}", "data.name=large", "data.eval_split=test"))
    assert len(train) == 9 and len(evaluation) == 2 and train[0]["prompt"].startswith("large")

    cfg = make_cfg("data.path=json", f"data.data_files={{train: ['{tmp_path}/*/train.jsonl'], "
                   f"test: ['{tmp_path}/small/test.jsonl']}}", "data.eval_split=test")
    check_data_source(cfg)
    train, evaluation = data_lib.load_splits(cfg)
    assert len(train) == 13 and len(evaluation) == 2

    with pytest.raises(ConfigError, match="no file matches"):
        check_data_source(make_cfg("data.path=json", f"data.data_files=[{tmp_path}/nothing-*.jsonl]"))


# ---------------------------------------------------------------------------------------------------- own data


def _write_rows(path, rows):
    """A data file of `rows` in the type its suffix names (.txt: their text column, a line each)."""
    if path.suffix == ".txt":
        path.write_text("".join(r["text"] + "\n" for r in rows))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        getattr(Dataset.from_list(rows), {".json": "to_json", ".csv": "to_csv", ".parquet": "to_parquet"}[path.suffix])(path)
    return path


def test_a_file_and_a_separate_eval_file_of_any_type(tmp_path):
    train = _write_rows(tmp_path / "train.jsonl", ROWS)
    for suffix in (".csv", ".tsv", ".txt"):
        evaluation = tmp_path / f"eval{suffix}"
        if suffix == ".tsv":
            evaluation.write_text("prompt\tresponse\nt0\tu0\nt1\tu1\n")
        else:
            _write_rows(evaluation, [{"prompt": "t0", "response": "u0", "text": "t0"}, {"prompt": "t1", "response": "u1", "text": "t1"}])
        cfg = make_cfg(f"data.path={train}", f"data.eval_path={evaluation}")
        check_data_source(cfg)
        got_train, got_eval = data_lib.load_splits(cfg)
        assert got_train.to_list() == ROWS  # nothing carved out of train
        assert len(got_eval) == 2 and ("text" if suffix == ".txt" else "response") in got_eval.column_names

    with pytest.raises(ConfigError, match="data.eval_split=test and data.eval_path=.* both"):
        make_cfg(f"data.path={train}", f"data.eval_path={train}", "data.eval_split=test")
    with pytest.raises(ConfigError, match="for an evaluation file use data.eval_path=held_out.jsonl"):
        check_data_source(make_cfg(f"data.path={train}", "data.eval_split=held_out.jsonl"))
    with pytest.raises(ConfigError, match="data.eval_path: data file not found: .*nope.jsonl"):
        check_data_source(make_cfg(f"data.path={train}", f"data.eval_path={tmp_path / 'nope.jsonl'}"))
    with pytest.raises(ConfigError, match="unknown config key data.eval_paht; did you mean data.eval_path"):
        make_cfg("data.eval_paht=x.jsonl")


@pytest.mark.parametrize("saved", ["Dataset", "DatasetDict of one split"])
def test_a_save_to_disk_folder_as_eval_path_is_evaluated_on(tmp_path, saved):
    """data.eval_path naming a save_to_disk folder (of a Dataset, or of a DatasetDict whatever its one split's
    name): a run evaluates on its rows; a DatasetDict of several splits is one line naming them, before anything
    is written."""
    from conftest import python_m, read_metrics

    train = _write_rows(tmp_path / "train.jsonl", ROWS)
    held_out = Dataset.from_list([{"prompt": f"t{i}", "response": f"u{i}"} for i in range(6)])
    folder = tmp_path / "held_out"
    (held_out if saved == "Dataset" else DatasetDict(test=held_out)).save_to_disk(folder)
    quick = [f"data.path={train}", f"data.eval_path={folder}", "train.max_steps=2", "train.eval_every=2",
             "track.log_with=[]"]
    proc = python_m(*quick, f"output_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, evals = read_metrics(tmp_path / "run")
    assert evals and math.isfinite(evals[-1]["eval_loss"]) and evals[-1]["step"] == 2

    DatasetDict(validation=held_out, test=held_out).save_to_disk(tmp_path / "two")
    proc = python_m(*quick, f"data.eval_path={tmp_path / 'two'}", f"output_dir={tmp_path / 'refused'}")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert lines == [f"accel_train: error: data.eval_path: {tmp_path / 'two'} is a DatasetDict of 2 splits "
                     "(validation, test); an evaluation source is one set of rows: save the split to evaluate on "
                     "alone (dataset_dict[NAME].save_to_disk(FOLDER)), or give a data file"]
    assert not (tmp_path / "refused").exists()


def test_a_folder_of_train_and_eval_files_names_the_split_datasets_gives_eval(tmp_path, caplog):
    _write_rows(tmp_path / "train.jsonl", ROWS)
    _write_rows(tmp_path / "eval.jsonl", ROWS[:3])
    with pytest.raises(ConfigError) as e:
        data_lib.load_splits(make_cfg(f"data.path={tmp_path}", "data.eval_split=eval"))
    message = str(e.value)
    assert "data.eval_split: split 'eval' not in" in message and "splits found: train, test" in message
    assert "eval/evaluation -> test" in message and "data.eval_path=FILE" in message and "\n" not in message
    train, evaluation = data_lib.load_splits(make_cfg(f"data.path={tmp_path}", "data.eval_split=test"))
    assert (len(train), len(evaluation)) == (20, 3)
    with caplog.at_level("INFO"):
        data_lib.load_splits(make_cfg(f"data.path={tmp_path}"))
    assert "also holds split(s) test, not used: data.eval_split=test evaluates on it" in caplog.text


def test_data_files_without_a_builder_in_data_path_is_refused(tmp_path):
    mine = _write_rows(tmp_path / "mine.jsonl", ROWS)
    with pytest.raises(ConfigError) as e:
        check_data_source(make_cfg(f"data.data_files=[{mine}]"))
    assert "data.data_files needs data.path to name their builder" in str(e.value) and "data.path=FILE" in str(e.value)


@pytest.mark.parametrize("row, fmt, prompt, read, keys", [
    ({"instruction": "add", "input": "2 3", "response": "5"}, "alpaca", "add\n\n2 3", "instruction, response, input",
     "data.output_field=response"),  # GPTeacher
    ({"instruction": "add", "context": "2 3", "response": "5", "category": "qa"}, "alpaca", "add\n\n2 3",
     "instruction, response, context", "data.input_field=context data.output_field=response"),  # Dolly
    ({"question": "what is 2+3", "answer": "5"}, "prompt_response", "what is 2+3", "question, answer",
     "data.prompt_field=question data.response_field=answer"),
    ({"prompt": "what is 2+3", "completion": "5"}, "prompt_response", "what is 2+3", "prompt, completion",
     "data.response_field=completion"),  # TRL's
], ids=["gpteacher", "dolly", "question-answer", "prompt-completion"])
def test_auto_format_recognises_common_column_sets_and_names_its_choice(tok, row, fmt, prompt, read, keys):
    """(The run logs the line: test_checkpoint's first run.)"""
    ds, cfg = Dataset.from_list([row]), make_cfg()
    chosen = check_columns(cfg, ds)
    assert chosen == f"format {fmt} from column(s) {read} (data.format=auto; the same as data.format={fmt} {keys})"
    out = tokenized(ds, tok, cfg)[0]
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": "5"}]
    assert out["input_ids"] == tok.apply_chat_template(messages)["input_ids"]
    assert targets(out) == ids(tok, "5") + [tok.eos_token_id]


def test_unk_tokens_and_samples_without_a_trained_token_are_counted_and_logged(tok, caplog):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            {"messages": [{"role": "system", "content": "You are kind.\nBe brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "yo"}]}]
    report = {}
    with caplog.at_level("WARNING"):
        tokenized(Dataset.from_list(rows), tok, make_cfg(), report=report)
    # "system: " is in the vocabulary; Y, \n, B and H are not: 4 of 7 + 38 tokens, one per character or marker
    assert (report["unk"], report["tokens"]) == (4, 45)
    assert report["first_unk"] == "row 2: system: «Y»ou are kind.«\\nB»e brief.<|user|>«H»i<|assistant|>yo</s>"
    assert "8.89% of the tokens (4 of 45) are <unk>" in caplog.text and report["first_unk"] in caplog.text
    assert "untrained" not in report

    # format text, max_length 3: "abc" + eos is 2 chunks, the second (eos alone) has nothing to predict
    report = {}
    with caplog.at_level("WARNING"):
        out = tokenized(Dataset.from_list([{"text": "abc"}, {"text": "ab"}]), tok,
                                make_cfg("data.format=text", "data.max_length=3"), report=report)
    assert len(out) == 2 and (report["untrained"], report["samples"]) == (1, 3) and "unk" not in report
    assert report["first_untrained"] == "sample 1: '</s>'"
    assert "1 of 3 samples (33.3%) have no trained token (every label -100) and are dropped" in caplog.text


def test_the_tiny_template_renders_a_system_turn_in_its_vocabulary_and_the_rest_as_before(tok):
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tok.apply_chat_template(plain, tokenize=False) == "<|user|>hi<|assistant|>yo</s>"
    assert tok.apply_chat_template(plain)["input_ids"] == [4, 13, 14, 5, 30, 20, 3]
    system = tok.apply_chat_template([{"role": "system", "content": "be brief"}, *plain])["input_ids"]
    assert tok.decode(system) == "system: be brief<|user|>hi<|assistant|>yo</s>" and tok.unk_token_id not in system
    assert len(tok) == 52


README_EXAMPLES = re.compile(r"^# [^:]+: (\{.*\})\npython -m accel_train (.+)$", re.M)


def test_readme_own_data_examples_resolve_and_read_their_format(tmp_path, monkeypatch):
    """Each command of README's "Train on your data", on files holding its example row: the config loads, the cheap
    checks pass, both files load and the columns are those of the format the comment names."""
    from conftest import REPO

    section = (REPO / "README.md").read_text().partition("## Train on your data")[2].partition("\n## ")[0]
    examples = README_EXAMPLES.findall(section)
    assert len(examples) == 6
    monkeypatch.chdir(tmp_path)
    formats_seen = []
    for row, command in examples:
        overrides = command.split()
        cfg = make_cfg(*overrides)
        for path in (cfg.data.path, cfg.data.eval_path):
            _write_rows(tmp_path / path, [json.loads(row)] * 4)
        check_data_source(cfg)
        train, evaluation = data_lib.load_splits(cfg)
        assert len(train) == 4 and len(evaluation) == 4, command
        check_columns(cfg, train)
        formats_seen.append(formats.resolve_format(cfg, train.column_names) if cfg.task == "causal_lm" else cfg.task)
    assert formats_seen == ["messages", "messages", "alpaca", "prompt_response", "text", "seq_cls"]
