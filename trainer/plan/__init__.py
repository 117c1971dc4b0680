"""Flags -> one frozen TrainPlan: the plan's sections (sections.py) and the flag schema (schema.py), the parser
(flags.py), resolve() (resolve.py), the checks, config files and the model config. May import runtime/, ckpt/,
parallel/ (their plan sections and checks) and core/stage.py (the Stage base); never stages/, rl/ or an entry script."""
