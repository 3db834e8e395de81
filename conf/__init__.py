"""Hydra config tree of llmkit (config.yaml + one group per component kind); data files only."""
