"""Tool-call evaluation: MiniMind-3's cases through multi-turn generation with the mock tools, and a pass count.

    python scripts/eval_toolcall.py --weight full_sft
    python scripts/eval_toolcall.py --load_from ./minimind-3 --open_thinking 1
    python scripts/eval_toolcall.py --weight full_sft --interactive 1      # your prompts, all six tools offered

Each case (dataset/tools.py TOOL_CASES) offers a few tools; the model's turn is parsed, its calls answered by the
mock tools as `tool` messages, and the model goes on, up to --max_turns turns. A case passes when the model made a
valid call (an offered tool, its required arguments, well-formed JSON), called the expected tool, and its final
answer states the ground truth. Greedy by default (--temperature 0), so the count repeats.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from trainer.base.prelude import loaded, loading  # noqa: E402 (first: a line at once, Ctrl-C in one line)

loading(__name__, "torch, transformers and the model")

import torch  # noqa: E402

from dataset.tools import TOOL_CASES, gt_matches, run_episode, tool_schemas, valid_call  # noqa: E402
from scripts.inference.flags import add_model_args, add_sampling_args, parsed  # noqa: E402
from scripts.inference.generate import generate_ids, render_prompt  # noqa: E402
from scripts.inference.load import load_or_exit  # noqa: E402

loaded()  # the imports are done: the script's own Ctrl-C handling from here


def score(case, turns):
    """The checks of one case from its parsed turns: valid call, right tool, ground truth in the final answer."""
    tools = tool_schemas(case["tools"])
    calls = [call for turn in turns for call in turn.tool_calls]
    malformed = any(turn.malformed for turn in turns)
    finished = not turns[-1].tool_calls  # the last turn answered instead of calling again
    answer = turns[-1].content if finished else ""
    found = gt_matches(answer, case["gt"])
    result = dict(valid_call=bool(calls) and not malformed and all(valid_call(c, tools) for c in calls),
                  right_tool=case["tool"] in [c["function"]["name"] for c in calls],
                  gt_found=len(found), gt_total=len(case["gt"]), finished=finished, answer=answer,
                  calls=[f"{c['function']['name']}({c['function']['arguments']})" for c in calls])
    result["passed"] = result["valid_call"] and result["right_tool"] and len(found) == len(case["gt"])
    return result


def evaluate(cases, generate, max_turns, open_thinking):
    """Run each case as an episode; yield (case, result)."""
    for case in cases:
        turns, _ = run_episode(lambda messages: generate(messages, tool_schemas(case["tools"])),
                               [{"role": "user", "content": case["prompt"]}], tool_schemas(case["tools"]), max_turns,
                               open_thinking)
        yield case, score(case, turns)


def case_line(index, total, case, result):
    """One line per case: verdict, the three checks, the calls made, the answer."""
    verdict = "PASS" if result["passed"] else "FAIL"
    calls = ", ".join(result["calls"]) or "no call"
    answer = json.dumps(result["answer"][:80], ensure_ascii=False)
    checks = f"valid_call={int(result['valid_call'])} right_tool={int(result['right_tool'])}"
    return (f"[{index}/{total}] {verdict} {checks} gt={result['gt_found']}/{result['gt_total']} | {case['prompt']} | "
            f"expected {case['tool']}; called {calls} | answer {answer}")


def summary(results):
    """The closing line: passes over cases and each check's count."""
    n = len(results)
    count = {key: sum(bool(r[key]) for r in results) for key in ("passed", "valid_call", "right_tool")}
    truth = sum(r["gt_found"] == r["gt_total"] for r in results)
    return (f"tool-call eval: {count['passed']}/{n} passed (valid call {count['valid_call']}/{n}, right tool "
            f"{count['right_tool']}/{n}, ground truth {truth}/{n})")


def empty_note(results):
    """A line saying what a score of empty turns means, or None: cases with no call and no answer text."""
    empty = sum(not r["calls"] and not r["answer"].strip() for r in results)
    if not empty:
        return None
    return (f"note: {empty}/{len(results)} cases got no tool call and an empty answer: the model closed its turn at "
            "once, so the score says it has not learned to call tools (the README chain's small model scores 0/9: "
            "its agent stage shows the pipeline, not learning; docs/stages.md)")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="MiniMind tool-call evaluation")
    add_model_args(parser, weight="full_sft")
    add_sampling_args(parser, max_new_tokens=256, temperature=0.0)
    parser.add_argument("--max_turns", type=int, default=3, help="model turns per case (calls, then the answer)")
    parser.add_argument("--interactive", type=int, default=0, choices=[0, 1],
                        help="your prompts from stdin with all six tools, printed turn by turn; no scoring")
    return parsed(parser, argv)


def main(argv=None):
    args = parse_args(argv)
    if args.max_turns < 1:
        print(f"error: --max_turns must be at least 1 (got {args.max_turns})", file=sys.stderr)
        sys.exit(2)
    model, tokenizer = load_or_exit(args)
    torch.manual_seed(args.seed)

    def generate(messages, tools):
        text = render_prompt(tokenizer, messages, chat=True, open_thinking=args.open_thinking, tools=tools)
        _, new_ids = generate_ids(model, tokenizer, text, args.max_new_tokens, args.temperature, args.top_p)
        return tokenizer.decode(new_ids, skip_special_tokens=True)

    if args.interactive:
        for line in sys.stdin:
            if not line.strip():
                break
            start = [{"role": "user", "content": line.strip()}]
            _, messages = run_episode(lambda m: generate(m, tool_schemas()), start, tool_schemas(), args.max_turns,
                                      args.open_thinking)
            for message in messages[1:]:
                print(json.dumps(message, ensure_ascii=False), flush=True)
        return 0
    results = []
    for index, (case, result) in enumerate(evaluate(TOOL_CASES, generate, args.max_turns, args.open_thinking), 1):
        results.append(result)
        print(case_line(index, len(TOOL_CASES), case, result), flush=True)
    if empty_note(results):
        print(empty_note(results))
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
