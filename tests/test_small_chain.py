"""The README's small chain ends in a model that visibly learned: its SFT line, at the README's size and settings, then
its chat line, whose reply is the demo's own answer to the question, word for word (the README's comment is that
answer: the expectation comes from the data, not from a reply measured on one CPU's kernels).

The one change: SFT starts from the seeded init (--from_weight none) instead of the quick start's pretrained model,
whose pretraining costs 1-70 minutes by the load (the README says that start answered the same)."""
import collections
import shlex
import time

from dataset.demo.records import sft_records
from tests.helpers.launch import forked
from tests.helpers.readme_lines import readme_chain


def sft_and_chat_lines():
    """The chain's first SFT line and the chat line after it, with the reply the README gives in its comment."""
    chain = readme_chain()
    at = next(i for i, line in enumerate(chain) if line.startswith("trainer/train_sft.py"))
    chat = chain[at + 1]
    assert chat.startswith("scripts/eval_llm.py") and "#" in chat, chat
    return chain[at], chat, chat.split("#", 1)[1].strip()


def toy_answers():
    """The demo's ten most frequent (question, answer) pairs: the tech-support rows, about 100 each."""
    pairs = collections.Counter((r["conversations"][0]["content"], r["conversations"][1]["content"])
                                for r in sft_records() if len(r["conversations"]) == 2)
    return [pair for pair, count in pairs.most_common(10) if count >= 80]


def test_the_readme_sft_line_teaches_the_toy_answers(tmp_path):
    sft_line, chat_line, printed = sft_and_chat_lines()
    script, *args = shlex.split(chat_line, comments=True)
    prompt = args[args.index("--prompt") + 1]
    answers = dict(toy_answers())
    assert len(answers) == 10 and printed == answers[prompt]  # the README's comment is the demo's answer
    out = str(tmp_path / "out")
    start = time.monotonic()
    sft_script, *sft_args = shlex.split(sft_line)
    sft = forked(sft_script, [*sft_args, "--from_weight", "none", "--save_dir", out, "--checkpoint_dir",
                              str(tmp_path / "ckpt"), "--cache_dir", str(tmp_path / "cache")], timeout=1800)
    assert sft.returncode == 0, sft.stderr[-3000:]
    trained = time.monotonic() - start
    chat = forked(script, [*args, "--save_dir", out, "--max_new_tokens", "32"], timeout=300)
    assert chat.returncode == 0, chat.stderr[-3000:]
    reply = chat.stdout.split(f">>> {prompt}\n", 1)[1].strip().splitlines()[-1]
    print(f"SFT at the README's settings: {trained:.0f} s; reply {reply!r}")
    assert reply == answers[prompt]
