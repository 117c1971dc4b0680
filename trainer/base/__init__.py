"""The bottom floor: what every other floor needs: the errors (errors.py), ranks, seeds and the small collectives
with main_guard (launch.py), the Logger (log.py) and per-rank logs (rank_log.py), the flag schema (schema.py),
console streams (streams.py); the path rule is model/weights/paths.py. May import model/ and dataset/ only; every
trainer folder may import it."""
