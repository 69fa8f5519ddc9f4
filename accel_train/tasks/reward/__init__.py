"""Task reward: a reward model, one score per sequence, trained on preference pairs (config.py: the reward section;
task.py: the task)."""
