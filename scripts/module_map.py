"""Print docs/design.md's module map: every module of model/, dataset/, trainer/ and scripts/ with the first sentence of
its docstring, folder by folder (each folder's own line from its __init__.py). `python scripts/module_map.py --write`
replaces the map in docs/design.md; tests/test_house.py checks that the map names every module."""
import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("model", "dataset", "trainer", "trainer/core", "trainer/plan", "trainer/ckpt", "trainer/runtime",
           "trainer/stages", "trainer/rl", "trainer/parallel", "scripts", "scripts/benchmarks",
           "scripts/inference", "scripts/serve")
LONGEST = 160  # characters of a module's line
BEGIN, END = "<!-- module map: begin (scripts/module_map.py --write) -->", "<!-- module map: end -->"


def first_sentence(path):
    """The docstring's first sentence, on one line (empty when the module has none)."""
    doc = ast.get_docstring(ast.parse(open(path).read())) or ""
    text = " ".join(doc.split())
    match = re.match(r"(.+?\.)(\s|$)", text)
    sentence = match.group(1) if match else text
    if len(sentence) > LONGEST:
        sentence = sentence[:sentence.rfind(" ", 0, LONGEST)] + " ..."
    return sentence.replace("|", "\\|")


def module_map():
    lines = [BEGIN, "", "## Module map", ""]
    for folder in FOLDERS:
        full = os.path.join(ROOT, folder)
        init = os.path.join(full, "__init__.py")
        lines += [f"### {folder}/", ""]
        if os.path.exists(init) and first_sentence(init):
            lines += [first_sentence(init), ""]
        lines += ["| module | what it holds |", "| --- | --- |"]
        for name in sorted(os.listdir(full)):
            if name.endswith((".py", ".sh")) and name != "__init__.py":
                what = first_sentence(os.path.join(full, name)) if name.endswith(".py") else "a shell script"
                lines.append(f"| `{folder}/{name}` | {what} |")
        lines.append("")
    return "\n".join(lines + [END])


def main(argv):
    text = module_map()
    if "--write" not in argv:
        print(text)
        return 0
    path = os.path.join(ROOT, "docs", "design.md")
    design = open(path).read()
    start, stop = design.find(BEGIN), design.find(END)
    design = design[:start] + text + design[stop + len(END):] if start >= 0 else design.rstrip() + "\n\n" + text + "\n"
    with open(path, "w") as f:
        f.write(design)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
