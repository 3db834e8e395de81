"""Named engine set-ups (`@package _global_`), the Hydra config group `recipe`; data files only."""
