"""The run time of one process among many: what does not depend on what is trained.

    launched.py    what the launcher asked for (world size, ranks, a sharding engine), read before torch
    dist.py        the Accelerator, the process group and its timeouts, one line per event across ranks, signals
    engine.py      the engine's answers for the running job: sharded weights, frozen copies, generation on them
    checkpoint.py  checkpoints every rank writes and resumes from, the stop that every rank takes together
    tracking.py    logging, trackers, MFU and memory, summary.json
    faults.py      injected faults for the tests (ACCEL_TRAIN_FAULT)
    plot.py        the loss curves of runs (accel-train plot)
"""
