"""
Embedded default corpora, built from text that ships with the installed software (no download).

- pretrain_demo.jsonl  {"text": ...}: Python's own documentation (pydoc topics + standard-library
  docstrings, read with `ast`, nothing imported) mixed with chatterbot-corpus dialogues.
- sft_demo_v2.jsonl    {"conversations": [{"role": "user", ...}, {"role": "assistant", ...}]}:
  chatterbot-corpus English and Chinese dialogues, plus MiniMind-3-style rows with reasoning_content
  (arithmetic worked out step by step) and tool calls (tools over standard-library facts: gcd,
  Unicode character names, weekdays, computed here), tools/tool_calls as JSON strings and as lists.
- dpo_demo.jsonl       {"chosen": [messages], "rejected": [messages]}, MiniMind's dpo.jsonl: the same computed
  facts (sums, products, gcd, Unicode names, weekdays; with and without tools), the chosen answer right, the rejected
  one another question's answer or the right one with a wrong number. Standard library only.
- rlaif_demo.jsonl     {"conversations": [user, assistant]}, MiniMind's rlaif.jsonl: RL prompts (the last assistant
  message is a reference the RL stages drop): chatterbot questions and sums/products.
- agent_rl_demo.jsonl  {"conversations": [system with tools, user, assistant], "gt": [...]}, MiniMind-3's
  agent_rl.jsonl: questions for MiniMind-3's six mock tools (dataset/tools.py), gt the mock tool's answer.
- kto_demo.jsonl       {"conversations": [...], "label": true | false}: the DPO pairs unpaired (TRL's unpaired
  preference format), chosen answers true, rejected ones false, shuffled.

All are a pure function of the installed Python and packages: same bytes on every such machine.
Run `python dataset/demo_data.py` to build them all, or call `ensure_demo_data("pretrain" | "sft" | "dpo" | "rlaif" |
"agent" | "kto")`.
"""
import json
import os

DATASET_DIR = os.path.dirname(os.path.abspath(__file__))
PRETRAIN_DEMO = os.path.join(DATASET_DIR, "pretrain_demo.jsonl")
SFT_DEMO = os.path.join(DATASET_DIR, "sft_demo_v2.jsonl")
# v2 of the SFT demo adds tool-call and reasoning rows; a new name, so a checkout's older build is not reused
DEMO_FILES = {"pretrain": "pretrain_demo.jsonl", "sft": "sft_demo_v2.jsonl", "dpo": "dpo_demo.jsonl",
              "rlaif": "rlaif_demo.jsonl", "agent": "agent_rl_demo.jsonl", "kto": "kto_demo.jsonl"}

# what a first build reads, for the line that announces it
BUILD_NOTES = {"pretrain": "Python's docs and docstrings, ~20 s", "sft": "dialogues and computed tool calls, a few s",
               "dpo": "computed preference pairs, a few s", "rlaif": "RL prompts, a few s",
               "agent": "tool questions, a few s"}


def _write_jsonl_atomic(records, path):
    """Write records as JSONL to a temporary file, then rename it over `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp_path = f"{path}.tmp{os.getpid()}"
    with open(tmp_path, "w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_path, path)  # readers see the old file or the complete new one, never a partial
    return path


def build_demo_data(kind, out_dir=DATASET_DIR, stdlib_dir=None):
    """(Re)build one demo corpus ("pretrain", "sft", "dpo", "rlaif", "agent" or "kto") into out_dir; its path.

    stdlib_dir: where pretraining docstrings are read from (default: this Python's standard library).
    """
    if kind not in DEMO_FILES:
        raise ValueError(f"unknown demo data kind {kind!r}, expected one of {sorted(DEMO_FILES)}")
    make = record_builder(kind)
    records = make(stdlib_dir) if kind == "pretrain" else make()
    return _write_jsonl_atomic(records, os.path.join(out_dir, DEMO_FILES[kind]))


def record_builder(kind):
    """The function that makes corpus `kind`'s rows; its module is read when that corpus is built (a checkout builds
    each once), not by a run that finds the file."""
    if kind == "agent":
        from dataset.demo.agent import agent_records
        return agent_records
    from dataset.demo import records
    return {"pretrain": records.pretrain_records, "sft": records.sft_records, "dpo": records.dpo_records,
            "rlaif": records.rlaif_records, "kto": records.kto_records}[kind]


def ensure_demo_data(kind, out_dir=DATASET_DIR, announce=None):
    """Path of the demo corpus `kind`, building it first if it does not exist yet; `announce(line)` says so first
    (the pretraining corpus takes ~20 s of one core and printed nothing while it was built)."""
    if kind not in DEMO_FILES:
        raise ValueError(f"unknown demo data kind {kind!r}, expected one of {sorted(DEMO_FILES)}")
    path = os.path.join(out_dir, DEMO_FILES[kind])
    if os.path.exists(path):
        return path
    if announce is not None:
        announce(f"building the demo corpus {path} (first use only; {BUILD_NOTES[kind]})")
    return build_demo_data(kind, out_dir)


if __name__ == "__main__":
    for kind in DEMO_FILES:
        path = build_demo_data(kind)
        with open(path, encoding="utf-8") as f:
            n_lines = sum(1 for _ in f)
        print(f"{kind}: {path}  {os.path.getsize(path) / 1e6:.2f} MB, {n_lines} records")
