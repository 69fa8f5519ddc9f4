"""Memory readings: the resident set through psutil, and the peak in the units each platform reports (ru_maxrss is
KiB on Linux and bytes on macOS; Windows has no getrusage, psutil reads its peak working set)."""

from __future__ import annotations

import mmap
import resource
from types import SimpleNamespace

import psutil
import pytest

from accel_train.runtime import tracking

CPU = SimpleNamespace(type="cpu")
MB = 2**20


@pytest.mark.parametrize("platform, ru_maxrss", [("linux", 300 * 1024), ("darwin", 300 * MB)])
def test_peak_memory_units_per_platform(monkeypatch, tmp_path, platform, ru_maxrss):
    """Without /proc (macOS, BSDs, a Linux without procfs): ru_maxrss."""
    monkeypatch.setattr(tracking.sys, "platform", platform)
    monkeypatch.setattr(tracking, "PROC_STATUS", tmp_path / "no-proc")
    monkeypatch.setattr(resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=ru_maxrss))
    assert tracking.peak_memory_mb(CPU) == pytest.approx(300.0)


def test_peak_memory_on_windows_reads_the_peak_working_set(monkeypatch):
    monkeypatch.setattr(tracking.sys, "platform", "win32")
    fake = SimpleNamespace(memory_info=lambda: SimpleNamespace(rss=100 * MB, peak_wset=300 * MB))
    monkeypatch.setattr(tracking.psutil, "Process", lambda: fake)
    assert tracking.peak_memory_mb(CPU) == pytest.approx(300.0)


def test_reset_peak_memory_forgets_what_was_freed_before():
    """What recipe.wrap's MFU probe (and a set-up spike) allocated and freed before training does not count in
    the run's peak memory, as in the benchmark's other contenders, which reset at the same point."""
    # An anonymous mapping written page by page and unmapped: resident while it lives, gone after, whatever the
    # allocator would do with a freed buffer of this worker (malloc may keep one in its heap, resident: no spike)
    with mmap.mmap(-1, 200 * MB) as spike:
        for page in range(0, 200 * MB, mmap.PAGESIZE):
            spike[page] = 1
    assert tracking.peak_memory_mb(CPU) > tracking.current_memory_mb(CPU) + 150
    tracking.reset_peak_memory(CPU)
    assert tracking.peak_memory_mb(CPU) < tracking.current_memory_mb(CPU) + 50


def test_mfu_above_the_measured_peak_is_unknown():
    assert tracking.mfu(5e9, 1e10) == 0.5
    assert tracking.mfu(1.1e10, 1e10) is None and tracking.mfu(5e9, 0.0) is None


def test_current_memory_is_this_process_resident_set():
    rss = psutil.Process().memory_info().rss / MB
    assert tracking.current_memory_mb(CPU) == pytest.approx(rss, rel=0.1)


# ---------------------------------------------------------------------------------------------------- MFU's FLOPs


def test_matmul_weights_of_a_llama_leave_the_input_embeddings_out_unless_tied():
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    from accel_train.models.build import attention_size, matmul_parameters

    h, inter, layers, vocab = 64, 128, 2, 100
    linear = layers * (4 * h * h + 3 * h * inter)  # q, k, v, o (4 heads x 16, no grouping); gate, up, down
    for tied in (False, True):
        config = LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=vocab, tie_word_embeddings=tied)
        model = LlamaForCausalLM(config)
        # the head once (tied or not), never the input embeddings as such; norms left out
        assert matmul_parameters(model) == (linear + vocab * h,) * 2
        assert sum(p.numel() for p in model.parameters()) > linear + vocab * h  # what 4N counted before
    assert attention_size(model) == layers * 4 * 16
    r = 8
    lora = peft.get_peft_model(model, peft.LoraConfig(r=r, target_modules=["q_proj", "v_proj"]))
    assert matmul_parameters(lora) == (linear + vocab * h + layers * 2 * r * (h + h), layers * 2 * r * (h + h))


def test_matmul_weights_of_a_bert_classifier_leave_the_three_embedding_tables_out():
    from transformers import BertConfig, BertForSequenceClassification

    from accel_train.models.build import attention_size, matmul_parameters

    h, inter, layers = 32, 64, 2
    config = BertConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=4,
                        vocab_size=100, max_position_embeddings=64, type_vocab_size=2, num_labels=3)
    model = BertForSequenceClassification(config)
    # per layer q, k, v, attention output, intermediate, output; then the pooler and the classifier
    assert matmul_parameters(model)[0] == layers * (4 * h * h + 2 * h * inter) + h * h + 3 * h
    assert attention_size(model) == layers * h


def test_flops_per_token_counts_attention_at_the_row_width():
    n, trainable, attention = 1000, 10, 64
    assert tracking.flops_per_token(n, trainable, attention, 0) == 4 * n + 2 * trainable
    # QK^T and AV: 4 x width x heads x head_dim per layer forward, 3x that with the backward
    assert tracking.flops_per_token(n, trainable, attention, 256) - tracking.flops_per_token(n, trainable, attention, 0) \
        == 12 * attention * 256
