"""Task dpo: preference pairs, against a reference or not (config.py: the dpo section; task.py: the task)."""
