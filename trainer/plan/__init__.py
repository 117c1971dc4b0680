"""The stage contract (stage.py, objective.py) and flags -> one frozen TrainPlan: the plan's sections (sections.py),
the parser (flags.py), resolve() (resolve.py), the checks, config files and the model config. Floor 7: may import
runtime/, observe/, judge/, ckpt/, parallel/, base/ (their plan sections and checks), model/ and dataset/."""
