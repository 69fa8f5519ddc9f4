"""Task distill: a teacher's token distributions taught on the responses (config.py: the distill section; task.py:
the task, its teacher and its divergence)."""
