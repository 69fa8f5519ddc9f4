"""One training job: the cheap checks before anything loads (preflight.py), its stages from data to the saved weights
(recipe.py: setup, accelerator.prepare, fit, save, teardown), and the loop itself (loop.py: one function that names
no task)."""
