"""The layout planner: the layout model (cost.py: memory per rank and bytes per step of a parallel layout, every
dimension from trainer/parallel/mesh.py's DIMENSIONS), docs/scaling.md's tables (scaling.py), named GPUs (gpus.py) and
whether a run fits one (fit.py, its flags checked before torch loads in flags.py). The commands are scripts/bench.py
--plan, scripts/layout_model.py and scripts/fit_plan.py."""
