"""Workflows over whole runs and checkpoints: reading a training run back and exporting it."""
