"""`python -m accel_train [--config FILE] [key=value ...]`: the training loop in this one process (and the module
`accelerate launch -m accel_train` and `torchrun -m accel_train` start in each)."""

from accel_train.cli import cli

cli()
