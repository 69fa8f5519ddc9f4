"""The user's tools around a run, each a command of its own (`accel-train NAME ...`, `python -m accel_train NAME ...`,
or `python -m MODULE ...`), each with a `main(argv)`:

    inspect   the data as training will see it, before any training, with nothing written
    generate  answers of a trained causal LM (or any model folder) to prompts
    predict   a classifier's classes, or a reward model's scores
    sample    completions of a model on a data set's prompts, scored and kept as SFT / preference data
    export    a run's LoRA adapter merged into its base model
    push      a run to the Hugging Face Hub, with its model card
    plot      the loss curves of one or more runs
    bench     the benchmark against TRL, the Trainer and a bare loop (accel_train/bench)
    gpu-check the checks of every GPU path, with a report (accel_train/bench/gpu_check.py)

A tool that runs on every process of a launch (`accel-train launch [accelerate options] TOOL ...`) has a `check(argv)`
too, run once before any process starts: those are `LAUNCHED`.
"""

from accel_train.runtime.tracking import quiet_imports

quiet_imports()  # a tool's modules import peft (and with it bitsandbytes) as they load: its output is its answer

TOOLS = {
    "inspect": "accel_train.tools.inspect",
    "generate": "accel_train.tools.generate",
    "predict": "accel_train.tools.predict",
    "sample": "accel_train.tools.sample",
    "export": "accel_train.tools.export",
    "push": "accel_train.tools.push",
    "plot": "accel_train.runtime.plot",
    "bench": "accel_train.bench.run",
    "gpu-check": "accel_train.bench.gpu_check",
}
LAUNCHED = ("sample",)
