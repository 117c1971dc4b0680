"""scripts/export_eval_items.py: an lm-eval task written here (tests/test_eval_bench.py's YAML + JSONL), exported
offline to the JSONL that curate_data --eval_path reads: each row the prompt lm-eval renders, the choices, the gold
answer's text, as the YAML template gives them by hand."""
import json

import pytest

from scripts.export_eval_items import main

pytest.importorskip("lm_eval")  # requirements.txt installs it; a bare environment skips, naming it
from tests.helpers.eval_tasks import DOCS, write_task  # noqa: E402 (offline: a fixture in conftest.py)


def test_export_renders_items_as_the_task_does(tmp_path, offline):  # noqa: F811
    tasks = write_task(tmp_path / "tasks")
    assert main(["--tasks", "tiny_mc", "--include_path", str(tasks), "--out_dir", str(tmp_path / "items")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "items" / "tiny_mc.jsonl").read_text().splitlines()]
    assert rows == [{"query": f"Question: {d['question']}\nAnswer:", "choices": d["choices"],
                     "target": d["choices"][d["label"]]} for d in DOCS]

