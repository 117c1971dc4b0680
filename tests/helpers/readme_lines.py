"""README.md's command blocks as tests read them: the quick start, the own-corpus path and the small chain
(tests/test_readme_chain.py runs them smaller, tests/test_small_chain.py its SFT at full size)."""
import os
import re

from tests.helpers.launch import ROOT

MARK = "# the small chain, after the quick start:"


def readme_text():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def readme_blocks():
    return re.findall(r"```bash\n(.*?)```", readme_text(), re.S)


def readme_chain():
    """The command lines of README.md's small-chain block, without the leading `python `."""
    block = next(b for b in readme_blocks() if b.startswith(MARK))
    return [line[len("python "):] for line in block.splitlines() if line.startswith("python ")]


def own_corpus():
    """The command lines of README.md's own-corpus block (raw -> curated -> tokenizer -> pretraining), without the
    leading `python `."""
    block = next(b for b in readme_blocks() if b.startswith("python scripts/curate_data.py"))
    return [line[len("python "):] for line in block.splitlines() if line.startswith("python ")]


def quick_start():
    """The README's first training command (its install block), which the chain goes on from."""
    return next(line[len("python "):] for line in readme_blocks()[0].splitlines()
                if line.startswith("python trainer/"))
