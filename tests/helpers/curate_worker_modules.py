"""scripts/curate_data.py with a probe patched in from here: each task's first pipeline step writes the process's
pid, parent pid and sys.modules to DUMP_DIR/<pid>.json, then the run goes on unchanged (tests/test_curate_data.py
reads what a pool worker imported).

    python tests/helpers/curate_worker_modules.py DUMP_DIR <curate_data.py flags>
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from scripts import curate_data  # noqa: E402
from scripts.curate import steps as curate_steps  # noqa: E402

DUMP_DIR = sys.argv.pop(1)
real_run = curate_steps.Tally.run


def run_with_probe(self, data, rank=0, world_size=1):
    if self.name == "tally input":
        with open(os.path.join(DUMP_DIR, f"{os.getpid()}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "ppid": os.getppid(), "modules": sorted(sys.modules)}, f)
    yield from real_run(self, data, rank, world_size)


curate_steps.Tally.run = run_with_probe
sys.exit(curate_data.main(sys.argv[1:]))
