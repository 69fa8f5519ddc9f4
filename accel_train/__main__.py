"""`python -m accel_train [--config FILE] [key=value ...]`: the training loop in this one process."""

from accel_train.cli import cli

cli()
