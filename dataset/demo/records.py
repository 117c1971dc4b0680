"""The rows of the embedded demo corpora (dataset/demo_data.py builds them into files; the agent's rows are
dataset/demo/agent.py's): Python's documentation and docstrings, chatterbot-corpus dialogues, computed tool calls,
reasoning, preference pairs and RL prompts. A pure function of the installed Python and packages."""
import ast
import datetime
import json
import math
import os
import random
import sysconfig
import unicodedata
import warnings

CHATTERBOT_LANGUAGES = ("english", "chinese")
NUM_TOOL_CONVERSATIONS = 48       # tool-call rows in the SFT demo: enough that every short run meets some
NUM_REASONING_CONVERSATIONS = 48  # rows with reasoning_content
NUM_DPO_PAIRS = 600  # preference pairs: a few epochs of the default DPO batch on a CPU in minutes
NUM_RLAIF_SUMS = 200  # arithmetic prompts among the RL prompts (the rest: chatterbot questions)
MIN_DOCSTRING_CHARS = 200   # shorter docstrings are mostly one-line signatures, not prose
MAX_CHUNK_CHARS = 2000      # pydoc topics are cut into paragraph chunks of at most about this size
# stdlib folders that hold tests, third-party code, GUIs demos or binaries rather than documentation
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "turtledemo",
             "__pycache__", "lib-dynload", "pydoc_data", "ensurepip"}


def _chunk_paragraphs(text, max_chars=MAX_CHUNK_CHARS, min_chars=MIN_DOCSTRING_CHARS):
    """Greedily join blank-line separated paragraphs into chunks of at most ~max_chars."""
    chunks, current = [], ""
    for para in text.split("\n\n"):
        if not para.strip():
            continue
        if current and len(current) + 2 + len(para) > max_chars and len(current) >= min_chars:
            chunks.append(current)
            current = para
        else:
            current = current + "\n\n" + para if current else para
    if current.strip():
        chunks.append(current)
    return chunks


def pydoc_topic_texts():
    """Python's help() topics (the language reference as plain text), chunked by paragraphs."""
    from pydoc_data.topics import topics
    texts = []
    for name in sorted(topics):
        texts.extend(_chunk_paragraphs(topics[name].strip()))
    return texts


def stdlib_docstrings(stdlib_dir=None, min_chars=MIN_DOCSTRING_CHARS, limit=None):
    """Module/class/function docstrings of the standard library, parsed with ast (never imported); `limit`: the first
    that many of them, parsing no more files than it takes (all of them: ~13 s of CPU)."""
    stdlib_dir = stdlib_dir or sysconfig.get_paths()["stdlib"]
    texts, seen = [], set()
    for dirpath, dirnames, filenames in os.walk(stdlib_dir):
        # sorted in place so os.walk visits folders in the same order on every machine
        dirnames[:] = sorted(d for d in dirnames
                             if d not in SKIP_DIRS and not d.startswith((".", "config-")))
        for filename in sorted(filenames):
            if limit is not None and len(texts) >= limit:
                return texts[:limit]
            if not filename.endswith(".py") or filename.startswith("test_"):
                continue
            with open(os.path.join(dirpath, filename), "rb") as f:
                source = f.read()
            try:
                with warnings.catch_warnings():  # invalid escapes in old sources warn while parsing
                    warnings.simplefilter("ignore")
                    tree = ast.parse(source)
            except (SyntaxError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= min_chars and doc not in seen:
                        seen.add(doc)
                        texts.append(doc)
    return texts[:limit]


def chatterbot_conversations(languages=CHATTERBOT_LANGUAGES):
    """chatterbot-corpus dialogues as lists of utterances, in sorted (language, file) order."""
    import chatterbot_corpus
    import yaml
    data_dir = os.path.join(os.path.dirname(os.path.abspath(chatterbot_corpus.__file__)), "data")
    conversations = []
    for language in languages:
        lang_dir = os.path.join(data_dir, language)
        for filename in sorted(os.listdir(lang_dir)):
            if not filename.endswith((".yml", ".yaml")):
                continue
            with open(os.path.join(lang_dir, filename), encoding="utf-8") as f:
                # BaseLoader keeps every scalar a string ("yes" stays "yes", not True)
                doc = yaml.load(f, Loader=yaml.BaseLoader) or {}
            for conv in doc.get("conversations") or []:
                utterances = [str(u).strip() for u in conv if str(u).strip()]
                if len(utterances) >= 2:
                    conversations.append(utterances)
    return conversations


def pretrain_records(stdlib_dir=None):
    """All pretraining documents, shuffled with a fixed seed so kinds of text are mixed."""
    texts = pydoc_topic_texts() + stdlib_docstrings(stdlib_dir)
    texts += ["\n".join(conv) for conv in chatterbot_conversations()]
    random.Random(0).shuffle(texts)
    return [{"text": t} for t in texts]


def _tool_schema(name, description, **params):
    """OpenAI-style function schema with string/integer parameters, all required."""
    properties = {key: {"type": kind, "description": text} for key, (kind, text) in params.items()}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(params)}}}


DEMO_TOOLS = {  # each tool row offers only the tool it calls, so rows fit the default --max_seq_len 340
    "gcd": _tool_schema("gcd", "Greatest common divisor.", a=("integer", "an integer"), b=("integer", "an integer")),
    "unicode_name": _tool_schema("unicode_name", "Unicode name of a character.", char=("string", "one character")),
    "weekday": _tool_schema("weekday", "Day of the week of a date.", date=("string", "YYYY-MM-DD")),
}


def _tool_question(rng):
    """(question, tool call, tool result, answer) with the result computed by the standard library."""
    kind = rng.choice(["gcd", "unicode_name", "weekday"])
    if kind == "gcd":
        a, b = rng.randrange(12, 1000), rng.randrange(12, 1000)
        result = math.gcd(a, b)
        return (f"What is the greatest common divisor of {a} and {b}?", {"name": kind, "arguments": {"a": a, "b": b}},
                {"gcd": result}, f"The greatest common divisor of {a} and {b} is {result}.")
    if kind == "unicode_name":
        char = chr(rng.choice([rng.randrange(0x41, 0x5B), rng.randrange(0x3B1, 0x3CA), rng.randrange(0x4E00, 0x4E80)]))
        result = unicodedata.name(char)
        return (f"What is the Unicode name of the character {char}?", {"name": kind, "arguments": {"char": char}},
                {"name": result}, f"The character {char} is called {result}.")
    date = datetime.date(2000, 1, 1) + datetime.timedelta(days=rng.randrange(0, 12000))
    result = date.strftime("%A")
    return (f"Which day of the week was {date.isoformat()}?", {"name": kind, "arguments": {"date": date.isoformat()}},
            {"weekday": result}, f"{date.isoformat()} was a {result}.")


def tool_records(n=NUM_TOOL_CONVERSATIONS, seed=0):
    """Tool-use conversations (system with tools, user, assistant call, tool result, answer).

    Every other row stores tools/tool_calls as JSON strings, as MiniMind-3's sft_t2t does, the rest as lists.
    """
    rng, records = random.Random(seed), []
    for i in range(n):
        question, call, result, answer = _tool_question(rng)
        tools, as_text = [DEMO_TOOLS[call["name"]]], i % 2 == 0
        records.append({"conversations": [
            {"role": "system", "content": "You are a helpful assistant with tools.",
             "tools": json.dumps(tools, ensure_ascii=False) if as_text else tools},
            {"role": "user", "content": question},
            {"role": "assistant", "content": "",
             "reasoning_content": f"I can answer this with the {call['name']} tool.",
             "tool_calls": json.dumps([call], ensure_ascii=False) if as_text else [call]},
            {"role": "tool", "content": json.dumps(result, ensure_ascii=False)},
            {"role": "assistant", "content": answer,
             "reasoning_content": f"The tool returned {json.dumps(result, ensure_ascii=False)}."},
        ]})
    return records


def reasoning_records(n=NUM_REASONING_CONVERSATIONS, seed=1):
    """Two-number sums and products, worked out digit by digit in reasoning_content."""
    rng, records = random.Random(seed), []
    for _ in range(n):
        a, b = rng.randrange(11, 100), rng.randrange(11, 100)
        if rng.random() < 0.5:
            steps = f"{a} + {b}: tens {a // 10 * 10} + {b // 10 * 10} = {a // 10 * 10 + b // 10 * 10}, " \
                    f"ones {a % 10} + {b % 10} = {a % 10 + b % 10}, total {a + b}."
            question, answer = f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
        else:
            steps = f"{a} * {b} = {a} * {b // 10 * 10} + {a} * {b % 10} = {a * (b // 10 * 10)} + {a * (b % 10)} " \
                    f"= {a * b}."
            question, answer = f"What is {a} * {b}?", f"{a} * {b} = {a * b}."
        records.append({"conversations": [{"role": "user", "content": question},
                                          {"role": "assistant", "content": answer, "reasoning_content": steps}]})
    return records


def sft_records():
    """chatterbot dialogues as alternating user/assistant turns ending on an assistant turn, plus the
    tool-use and reasoning rows, shuffled together."""
    records = []
    for conv in chatterbot_conversations():
        conv = conv[:len(conv) // 2 * 2]  # a trailing user turn has no answer to learn from
        roles = ["user", "assistant"] * (len(conv) // 2)
        records.append({"conversations": [{"role": r, "content": c} for r, c in zip(roles, conv)]})
    records += tool_records() + reasoning_records()
    random.Random(0).shuffle(records)
    return records


def _arithmetic_pair(rng):
    """A sum or product: chosen worked out and right, rejected off by a few units without working."""
    a, b = rng.randrange(11, 100), rng.randrange(11, 100)
    op, value = ("+", a + b) if rng.random() < 0.5 else ("*", a * b)
    wrong = value + rng.choice([-10, -2, -1, 1, 2, 10])
    question = [{"role": "user", "content": f"What is {a} {op} {b}?"}]
    chosen = {"role": "assistant", "content": f"{a} {op} {b} = {value}.",
              "reasoning_content": f"Work out {a} {op} {b} digit by digit: {value}."}
    return question + [chosen], question + [{"role": "assistant", "content": f"{a} {op} {b} = {wrong}."}]


def _fact_pair(rng, other_answer, with_tools):
    """A gcd / Unicode name / weekday question: chosen answers it (through the tool where one is offered), rejected
    gives `other_answer` (another question's) at once. Returns (pair, this question's answer)."""
    question, call, result, answer = _tool_question(rng)
    prompt = [{"role": "user", "content": question}]
    if not with_tools:
        return (prompt + [{"role": "assistant", "content": answer}],
                prompt + [{"role": "assistant", "content": other_answer}]), answer
    prompt.insert(0, {"role": "system", "content": "You are a helpful assistant with tools.",
                      "tools": [DEMO_TOOLS[call["name"]]]})
    chosen = prompt + [{"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "content": json.dumps(result, ensure_ascii=False)},
                       {"role": "assistant", "content": answer}]
    return (chosen, prompt + [{"role": "assistant", "content": other_answer}]), answer


def dpo_records(n=NUM_DPO_PAIRS, seed=2):
    """Preference pairs from computed facts: half arithmetic, half facts (one in four of those with a tool)."""
    rng, records, last_answer = random.Random(seed), [], "I do not know."
    for i in range(n):
        if i % 2 == 0:
            chosen, rejected = _arithmetic_pair(rng)
        else:
            (chosen, rejected), last_answer = _fact_pair(rng, last_answer, with_tools=i % 8 == 1)
        records.append({"chosen": chosen, "rejected": rejected})
    return records


def kto_records(seed=4):
    """KTO's unpaired rows from the DPO pairs: each chosen answer labelled true, each rejected one false, shuffled
    (so that a row's neighbour, whose answer is its KL row's, answers another prompt)."""
    rows = [{"conversations": pair[side], "label": side == "chosen"} for pair in dpo_records()
            for side in ("chosen", "rejected")]
    random.Random(seed).shuffle(rows)
    return rows


def rlaif_records(n_sums=NUM_RLAIF_SUMS, seed=3):
    """RL prompts: each chatterbot dialogue's opening question and a sum or product, with a reference answer."""
    rng = random.Random(seed)
    pairs = [conv[:2] for conv in chatterbot_conversations()]
    for _ in range(n_sums):
        a, b = rng.randrange(11, 100), rng.randrange(11, 100)
        op, value = ("+", a + b) if rng.random() < 0.5 else ("*", a * b)
        pairs.append([f"What is {a} {op} {b}?", f"{a} {op} {b} = {value}."])
    rng.shuffle(pairs)
    return [{"conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs]
