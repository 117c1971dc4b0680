"""The subset of Go's text/template that model/export/ollama.py's TEMPLATE uses, evaluated as Ollama would (Ollama
cannot run here; no maintained pip package evaluates Go templates): text, `{{- -}}` trimming, if / else if / else, range
over a list with `$i, $v :=`, variables (`:=`, `=` into an outer scope), fields, parenthesised pipelines with a field
after them, and the functions eq, ne, and, or, not, len, index, slice and Ollama's json (Go's json.Marshal).
"""
import json
import re

ACTION = re.compile(r"\{\{(- )?(.*?)( -)?\}\}", re.S)
TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\(|\)|:=|=|,|[^\s(),=:]+')


def parse(source):
    """The template as a tree: a list of str (text) and tuples ('action', words) / ('if', [(cond, body)], else) /
    ('range', vars, words, body)."""
    items, pos = [], 0
    for match in ACTION.finditer(source):
        items.append(source[pos:match.start()])
        items.append(match)
        pos = match.end()
    items.append(source[pos:])
    for i, item in enumerate(items):  # trim markers eat the whitespace beside the action
        if isinstance(item, re.Match):
            if item.group(1):
                items[i - 1] = items[i - 1].rstrip()
            if item.group(3):
                items[i + 1] = items[i + 1].lstrip()
    tokens = [item if isinstance(item, str) else item.group(2).strip() for item in items]
    body, rest = _block(tokens, 0, kinds=())
    assert rest == len(tokens), "unbalanced template"
    return body


def _block(tokens, i, kinds):
    """Parse nodes from tokens[i] until an action starting with one of `kinds`; returns (nodes, index of it)."""
    nodes = []
    while i < len(tokens):
        text, action = tokens[i], tokens[i + 1] if i + 1 < len(tokens) else None
        if text:
            nodes.append(text)
        if action is None:
            return nodes, i + 1
        word = action.split(" ", 1)[0]
        if word in kinds:
            return nodes, i + 1
        if word == "if":
            branches, default, i = [], [], i + 2
            condition = action[3:]
            while True:
                body, i = _block(tokens, i, kinds=("else", "end"))
                branches.append((condition, body))
                closing = tokens[i]
                if closing.startswith("else if "):
                    condition, i = closing[8:], i + 1
                elif closing == "else":
                    default, i = _block(tokens, i + 1, kinds=("end",))
                    break
                else:
                    break
            nodes.append(("if", branches, default))
            i += 1
            continue
        if word == "range":
            head = action[6:]
            names, pipeline = head.split(":=") if ":=" in head else ("", head)
            body, i = _block(tokens, i + 2, kinds=("end",))
            nodes.append(("range", [n.strip() for n in names.split(",") if n.strip()], pipeline, body))
            i += 1
            continue
        nodes.append(("action", action))
        i += 2
    return nodes, i


def go_json(value):
    """Go's json.Marshal: compact, keys in the order given (Ollama's ordered maps and structs), <>& escaped."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def truth(value):
    return value not in (None, False, 0, "") and not (isinstance(value, (list, dict)) and not value)


FUNCS = {
    "eq": lambda a, *b: any(a == x for x in b), "ne": lambda a, b: a != b, "not": lambda a: not truth(a),
    "len": len, "index": lambda x, *keys: _index(x, keys), "json": go_json,
    "slice": lambda x, i=0, j=None: x[i:j],
}


def _index(value, keys):
    for key in keys:
        value = value[key]
    return value


class Render:
    def __init__(self, data):
        self.root, self.scopes, self.out = data, [{"$": data}], []

    def run(self, nodes, dot):
        self.scopes.append({})
        for node in nodes:
            if isinstance(node, str):
                self.out.append(node)
            elif node[0] == "action":
                self.action(node[1], dot)
            elif node[0] == "if":
                for condition, body in node[1]:
                    if truth(self.pipeline(condition, dot)):
                        self.run(body, dot)
                        break
                else:
                    self.run(node[2], dot)
            else:
                self.loop(node, dot)
        self.scopes.pop()

    def loop(self, node, dot):
        _, names, pipeline, body = node
        for i, item in enumerate(self.pipeline(pipeline, dot) or []):
            self.scopes.append(dict(zip(names, [i, item][-len(names):] if names else [])))
            self.run(body, item)
            self.scopes.pop()

    def action(self, text, dot):
        match = re.match(r"(\$\w+)\s*(:=|=)\s*(.*)", text, re.S)
        if match:
            name, op, pipeline = match.groups()
            value = self.pipeline(pipeline, dot)
            scope = self.scopes[-1] if op == ":=" else next(s for s in reversed(self.scopes) if name in s)
            scope[name] = value
            return
        value = self.pipeline(text, dot)
        self.out.append("true" if value is True else "false" if value is False else str(value))

    def pipeline(self, text, dot):
        tokens = [(m.group(), m.start(), m.end()) for m in TOKEN.finditer(text)]
        value, rest = self.command(tokens, 0, dot)
        assert rest == len(tokens), f"unparsed: {text}"
        return value

    def command(self, tokens, i, dot):
        """Evaluate operands from tokens[i] to a ')' or the end: a function call or one operand."""
        first, i = self.operand(tokens, i, dot)
        if not isinstance(first, Function):
            return first, i
        if first.name in ("and", "or"):  # Go 1.18+: arguments are evaluated only until one decides
            value = None
            while i < len(tokens) and tokens[i][0] != ")":
                value, i = self.operand(tokens, i, dot)
                if truth(value) == (first.name == "or"):
                    return value, self.skip(tokens, i)
            return value, i
        args = []
        while i < len(tokens) and tokens[i][0] != ")":
            value, i = self.operand(tokens, i, dot)
            args.append(value)
        return FUNCS[first.name](*args), i

    @staticmethod
    def skip(tokens, i):
        """The index of the ')' closing the current command (or the end), past nested parentheses."""
        depth = 0
        while i < len(tokens) and (depth or tokens[i][0] != ")"):
            depth += {"(": 1, ")": -1}.get(tokens[i][0], 0)
            i += 1
        return i

    def operand(self, tokens, i, dot):
        text, _, end = tokens[i]
        if text == "(":
            value, i = self.command(tokens, i + 1, dot)
            i += 1  # the ')'
            if i < len(tokens) and tokens[i][1] == tokens[i - 1][2] and tokens[i][0].startswith("."):
                value = fields(value, tokens[i][0])  # (pipeline).Field
                i += 1
            return value, i
        if text.startswith('"'):
            return json.loads(text), i + 1
        if text.isdigit():
            return int(text), i + 1
        if text in ("true", "false"):
            return text == "true", i + 1
        if text.startswith("."):
            return fields(dot, text), i + 1
        if text.startswith("$"):
            name, _, path = text.partition(".")
            base = next(s[name] for s in reversed(self.scopes) if name in s)
            return (fields(base, "." + path) if path else base), i + 1
        return Function(text), i + 1


class Function:
    def __init__(self, name):
        self.name = name


def fields(value, path):
    for name in path.strip(".").split(".") if path != "." else []:
        value = value.get(name) if isinstance(value, dict) else None  # missingkey=zero
    return value


def render(source, data):
    """Render Go template `source` with `data` (dicts with Ollama's capitalised field names)."""
    renderer = Render(data)
    renderer.run(parse(source), data)
    return "".join(renderer.out)
