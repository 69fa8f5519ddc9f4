"""Generation on gathered weights where the ranks run different numbers of forwards (sharding.generating with
gather: each rank generates alone, as many forwards as its rows take), then training: under the accelerate config
this is launched with (FSDP2, DeepSpeed ZeRO-3) no collective may come from those forwards, and the next training
step must issue the same collectives on every rank. Three gathered blocks (each starts right after the one before,
as an evaluation's batches or a rollout after an evaluation do), ranks 0 and 1 running 0 and 1, 1 and 2, 0 and 2
forwards, then two training steps and an all-reduce; prints "ok" and the loss on each rank.

    accelerate launch --config_file configs/accelerate/fsdp2.yaml tests/scripts/uneven_generation.py
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from accel_train.config.schema import TINY_MODEL
from accel_train.config.load import load_config
from accel_train.runtime.dist import make_accelerator
from accel_train.runtime.engine import generating


def main() -> None:
    cfg = load_config(None, ["train.per_device_batch_size=2", "train.mixed_precision=no", "train.dist_timeout_s=60"])
    accelerator = make_accelerator(cfg)  # as a run forms it (DeepSpeed on CPUs over gloo, its batch fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(3, 40, (2, 8), generator=torch.Generator().manual_seed(1)).to(accelerator.device)
    rank = accelerator.process_index
    inner = accelerator.unwrap_model(model)
    for forwards in (0 if rank == 0 else 1, rank + 1, 0 if rank == 0 else 2):
        with generating(model, True), torch.no_grad():
            for _ in range(forwards):  # FSDP2 records each group's forwards
                inner(input_ids=ids)
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    total = accelerator.reduce(loss.detach().reshape(1), reduction="sum")
    print(f"rank {rank}: ok, loss {loss.item():.6f}, summed {total.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
