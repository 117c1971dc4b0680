"""A multiple-choice task written here for lm-eval (YAML + JSONL in a folder): the documents and the writer that
tests/test_eval_bench.py and tests/test_export_eval_items.py share."""
import json

DOCS = [
    {"question": "The sky on a clear day is", "choices": ["blue", "green", "a wooden table"], "label": 0},
    {"question": "Two plus two equals", "choices": ["four", "five"], "label": 0},
    {"question": "Python is a programming", "choices": ["snake", "language", "river", "city"], "label": 1},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Fahrenheit"], "label": 0},
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Rome"], "label": 0},
    {"question": "A cat says", "choices": ["meow", "moo", "quack"], "label": 0},
]
TASK_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

def write_task(folder):
    folder.mkdir()
    data = folder / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / "tiny_mc.yaml").write_text(TASK_YAML.format(data=data))
    return folder
