"""A synthetic sprite-video task for training and evaluating a tiny causal Wan model (see ``task.py``)."""
