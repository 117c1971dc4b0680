"""scripts/curate_data.py's report: documents, characters and tokens in and out of each step (from datatrove's
stats.json of every stage; tokens estimated from the token sample, steps.TokenSample), why documents were dropped,
decontamination hits per evaluation file, a few removed documents per step; printed as a table."""
import glob
import json
import os

EXAMPLES, EXAMPLE_CHARS = 3, 160  # removed documents shown per step, and how much of each
TALLIED = ("documents", "characters", "sampled_documents", "sampled_characters", "sampled_tokens")


def total(value):
    """A datatrove stat as one number: a count, or the total of a metric."""
    return value.get("total", 0) if isinstance(value, dict) else value


def stage_report(name, logdir):
    """{'stage', 'tallies': [{step, documents, characters, tokens}], 'dropped': {reason: n}, 'decont': {file: n}},
    summed over the per-task stats files (a restarted run's stats.json holds only the tasks it ran itself)."""
    report = {"stage": name, "tallies": [], "dropped": {}, "decont": {}}
    tallies = {}
    for path in sorted(glob.glob(os.path.join(logdir, "stats", "*.json"))):
        with open(path, encoding="utf-8") as f:
            steps = json.load(f)
        for step in steps:
            stats = step.get("stats", {})
            if "tally " in step["name"]:  # datatrove names a step's stats "<type>: <name>"
                tally = tallies.setdefault(step["name"].split("tally ", 1)[1], dict.fromkeys(TALLIED, 0))
                for key in TALLIED:
                    tally[key] += total(stats.get(key, 0))
            for key, value in stats.items():
                if key.startswith("dropped_"):
                    add(report["dropped"], key[len("dropped_"):], total(value))
                elif key.startswith("contaminated_") and not key.startswith("contaminated_tg_"):
                    add(report["decont"], key[len("contaminated_"):], total(value))
    report["tallies"] = [{"step": step, **counts, "tokens": estimated_tokens(counts)}
                         for step, counts in tallies.items()]
    return report


def estimated_tokens(tally):
    """The tally's characters times the token sample's tokens per character there (0 without a sampled document)."""
    if not tally["sampled_characters"]:
        return 0
    return round(tally["characters"] * tally["sampled_tokens"] / tally["sampled_characters"])


def kept_documents(report):
    """Documents in the published shards (0 when the run stopped with none left)."""
    return sum(t["documents"] for stage in report["stages"] for t in stage["tallies"] if t["step"] == "output")


def add(counts, key, value):
    counts[key] = counts.get(key, 0) + value


def removed_examples(work, step):
    """The first few documents `step` removed (its exclusion files, in rank order)."""
    examples = []
    for path in sorted(glob.glob(os.path.join(work, "removed", step, "*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                metadata = row.get("metadata", {})  # dedup steps give no reason: the step is the reason
                reason = metadata.get("filter_reason") or metadata.get("contaminated_task") or step
                examples.append({"text": row["text"][:EXAMPLE_CHARS], "reason": reason})
                if len(examples) == EXAMPLES:
                    return examples
    return examples


def step_rows(report):
    """[(step, documents/characters/tokens in, the same out)] in pipeline order, from consecutive tallies."""
    tallies = [t for stage in report["stages"] for t in stage["tallies"]]
    rows = []
    for before, after in zip(tallies, tallies[1:]):
        if after["step"] != "output":
            rows.append((after["step"], before, after))
    return rows


def print_report(report):
    """The console table: one line per step, documents/characters/tokens in -> out, then removed examples."""
    rows = step_rows(report)
    head = f"{'step':<18}{'documents in':>14}{'out':>10}{'characters in':>15}{'out':>12}{'tokens in':>12}{'out':>11}"
    print(head)
    print("-" * len(head))
    for step, before, after in rows:
        print(f"{step:<18}{before['documents']:>14,}{after['documents']:>10,}{before['characters']:>15,}"
              f"{after['characters']:>12,}{before['tokens']:>12,}{after['tokens']:>11,}")
    for stage in report["stages"]:
        if stage["dropped"]:
            print(f"{stage['stage']}: dropped " + ", ".join(f"{k} {v:,}" for k, v in sorted(stage["dropped"].items())))
        if stage["decont"]:
            hits = ", ".join(f"{k} {v:,}" for k, v in sorted(stage["decont"].items()))
            print(f"decontamination hits per file: {hits}")
    for step, examples in report.get("examples", {}).items():
        for example in examples:
            print(f"removed by {step} ({example['reason']}): {example['text']!r}")
    sample, tallies = report["token_sample"], [t for stage in report["stages"] for t in stage["tallies"]]
    sampled = tallies[0]["sampled_documents"] if tallies else 0
    how = "counted for every document" if sample["every"] == 1 else f"estimated from 1 in {sample['every']} documents"
    print(f"tokens: {how} ({sampled:,} sampled, at most {sample['max_chars']:,} characters of each), scaled by "
          f"characters; tokenizer {sample['tokenizer']}")
    print(f"near duplicates: Jaccard threshold about {report['minhash_threshold']:.2f}; "
          f"{len(report['shards'])} shard(s) written")
