"""``llmkit plan``: from a model, a hardware profile, a workload and an SLO to a recipe.

It searches the configuration space in the simulator (``llmkit.tools.sim``: the real scheduler
against a calibrated cost model), ranks the candidates by goodput then cost, serves the best few
and measures them with ``bench serve`` on the same workload, and writes the chosen config as a
recipe (``recipe=PATH`` loads it). Modules:

- ``profile_check``: this machine's hardware profile, calibrated when missing, checked
  against a few timed steps of the real engine when cached (recalibrated when stale);
- ``space``: the candidates (``plan.*`` lists), pruned to what the cores allow;
- ``runner``: one candidate simulated (``Prediction``); ``rank``: the order;
- ``verify``: a candidate served by ``llmkit serve`` and measured by ``bench serve``;
- ``recipe``: the recipe YAML with the figures as comments; ``report``: the table and plot;
- ``cli``: the command (``errors``: its one-line failures).
"""
