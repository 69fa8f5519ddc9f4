"""Task kto: answers labelled desirable or undesirable, against a reference (config.py: the kto section; task.py)."""
