"""Task grpo: reinforcement learning from rewards of sampled completions (config.py: the grpo section; task.py: the
task and its loss; rollouts.py: each step's completions, scored)."""
