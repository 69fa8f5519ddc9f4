"""Task distill: a teacher's token distributions taught on the responses, the data's or the student's own to prompts
alone (config.py: the distill section; task.py: the task, its teacher and its divergence)."""
