"""Print docs/design.md's module map: every module of model/, dataset/, trainer/ and scripts/ with the first sentence of
its docstring, folder by folder (each folder's own line from its __init__.py), and pretraining's reading order (the
files trainer/train_pretrain.py imports, with their lines). `python scripts/module_map.py --write` replaces both in
docs/design.md; tests/test_house.py checks that the map names every module and the reading order every file."""
import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("model", "model/export", "dataset", "dataset/demo", "dataset/tokenizing", "trainer/base", "trainer/parallel",
           "trainer/ckpt", "trainer/judge", "trainer/runtime", "trainer/plan", "trainer/core", "trainer/stages",
           "trainer/rl", "trainer", "scripts", "scripts/benchmarks", "scripts/curate", "scripts/inference",
           "scripts/planner", "scripts/serve")  # the floors, bottom first; then scripts/ and its packages
LONGEST = 160  # characters of a module's line
BEGIN, END = "<!-- module map: begin (scripts/module_map.py --write) -->", "<!-- module map: end -->"
READ_BEGIN, READ_END = "<!-- reading order: begin (scripts/module_map.py --write) -->", "<!-- reading order: end -->"
PACKAGES = ("trainer", "model", "dataset")


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


def module_path(name):
    """The file of project module `name` (a package: its __init__.py), or None when it is not one."""
    base = os.path.join(ROOT, *name.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def imports_in_order(path):
    """The project modules a file imports (imports inside functions too), in the order the source names them."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [f"{node.module}.{a.name}" for a in node.names] + [node.module] \
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
        for name in names:
            parts = name.split(".")
            module = next((".".join(parts[:k]) for k in range(len(parts), 0, -1)
                           if parts[0] in PACKAGES and module_path(".".join(parts[:k]))), None)
            if module and module not in found:
                found.append(module)
    return found


def reading_order(entry="trainer.train_pretrain"):
    """[(path, lines)] of every module `entry` reaches, breadth first in the order each file names them; package
    __init__ files count too."""
    order, queue = [], [entry]
    while queue:
        name = queue.pop(0)
        if name in order:
            continue
        order.append(name)
        queue.extend(imports_in_order(module_path(name)))
    paths = [os.path.relpath(module_path(name), ROOT) for name in order]
    return [(path, sum(1 for _ in open(os.path.join(ROOT, path)))) for path in paths]


def reading_block():
    rows = reading_order()
    lines = [READ_BEGIN, "", f"Pretraining's reading path: {len(rows)} files, {sum(n for _, n in rows)} lines, "
             "breadth first from the entry script (what `python trainer/train_pretrain.py` imports; a dimension, an "
             "optimizer of its own, a sink or a stage helper is read only when a flag asks for it):", ""]
    lines += [" -> ".join(f"{path} ({n})" for path, n in rows[i:i + 4]) + ("" if i + 4 >= len(rows) else " ->")
              for i in range(0, len(rows), 4)]
    return "\n".join(lines + ["", READ_END])


def replace_block(text, begin, end, block):
    start, stop = text.find(begin), text.find(end)
    return text[:start] + block + text[stop + len(end):] if start >= 0 else text.rstrip() + "\n\n" + block + "\n"


def main(argv):
    text = module_map()
    if "--write" not in argv:
        print(reading_block() + "\n\n" + text)
        return 0
    path = os.path.join(ROOT, "docs", "design.md")
    design = replace_block(open(path).read(), BEGIN, END, text)
    design = replace_block(design, READ_BEGIN, READ_END, reading_block())
    with open(path, "w") as f:
        f.write(design)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
