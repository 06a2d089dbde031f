"""How gradients and state move between workers: one strategy object per job, built from its config
(strategies/build.py). Importing this package imports nothing: the Controller reads checkpoints' catalogue and
plans restores from here without torch."""
