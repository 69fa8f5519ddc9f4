"""accel_train: a readable fine-tuning loop around `accelerate.Accelerator`."""

__version__ = "0.1.0"
