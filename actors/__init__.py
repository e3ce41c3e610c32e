"""GPU workers and the models they run."""
