"""Run accel_train's real entry in this process, recording `accelerator.sync_gradients` at every backward (what
accelerate hands DeepSpeed as the accumulation boundary) into the JSON file OUT.
    python tests/scripts/sync_probe.py OUT [key=value ...]
"""

import json
import sys

from accelerate import Accelerator

from accel_train.cli import main

seen = []
backward = Accelerator.backward


def recording_backward(self, loss, **kwargs):
    seen.append(self.sync_gradients)
    return backward(self, loss, **kwargs)


Accelerator.backward = recording_backward
try:
    main(sys.argv[2:])
finally:
    with open(sys.argv[1], "w") as f:
        json.dump(seen, f)
