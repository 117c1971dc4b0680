"""Tool calls: MiniMind-3's six mock tools, the model's tool-call output parsed, and multi-turn tool episodes.

The chat template (model/tokenizer_config.json) renders `tools` into the system turn and an assistant turn as
    <think>\\n{reasoning}\\n</think>\\n\\n{content}\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
and tool results as <tool_response> blocks in a user turn. This module is the other direction and the environment:

    TOOLS, tool_schemas(names)          the six function schemas (OpenAI `tools` entries) of MiniMind-3's agent stage
    execute_tool(name, arguments)       deterministic mock results: a dict, {"error": ...} for a bad call
    parse_assistant(text, open_thinking, final=True) -> AssistantTurn(content, reasoning_content, tool_calls, malformed)
    valid_call(call, tools)             the call names an offered tool and gives its required arguments
    gt_matches(text, gt)                the ground-truth values a text states (MiniMind's agent reward rule)
    run_episode(generate, messages, tools, max_turns=3)   model turn -> mock tools answer -> model turn ...
    TOOL_CASES, agent_rows()            prompts with the expected tool and ground truth; MiniMind's agent_rl rows

No torch and no trainer import: scripts/eval_toolcall.py, scripts/serve_openai_api.py, scripts/web_demo.py and the
agent RL stage share it.
"""
import ast
import json
import math
import operator
import re
from dataclasses import dataclass, field


def _schema(name, description, required, **params):
    """An OpenAI `tools` entry; params: name -> (JSON type, description)."""
    properties = {key: {"type": kind, "description": text} for key, (kind, text) in params.items()}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(required)}}}


TOOLS = [  # MiniMind-3's trainer/train_agent.py tools: names, parameters and required ones as there
    _schema("calculate_math", "Evaluate a math expression (+ - * / ** %, sqrt, log, sin, ...).", ["expression"],
            expression=("string", "the expression, e.g. 256*37 or sqrt(144)")),
    _schema("unit_converter", "Convert a value between units (km, miles, kg, pounds, meters, feet, celsius, "
            "fahrenheit).", ["value", "from_unit", "to_unit"], value=("number", "the value to convert"),
            from_unit=("string", "the unit of value"), to_unit=("string", "the unit wanted")),
    _schema("get_current_weather", "Current weather of a city.", ["location"],
            location=("string", "a city name, e.g. Tokyo or 北京")),
    _schema("get_current_time", "Current date and time in a timezone.", [],
            timezone=("string", "an IANA timezone, default Asia/Shanghai")),
    _schema("get_exchange_rate", "Exchange rate between two currencies.", ["from_currency", "to_currency"],
            from_currency=("string", "currency code, e.g. USD"), to_currency=("string", "currency code, e.g. CNY")),
    _schema("translate_text", "Translate a text into a target language.", ["text", "target_language"],
            text=("string", "the text"), target_language=("string", "english, chinese, ...")),
]
TOOL_NAMES = [tool["function"]["name"] for tool in TOOLS]

# MiniMind-3's mock data (train_agent.py), so a model trained there meets the same world here
WEATHER = {"北京": ("28°C", "晴"), "上海": ("15°C", "多云"), "广州": ("32°C", "闷热"), "深圳": ("30°C", "晴"),
           "杭州": ("22°C", "阴"), "成都": ("18°C", "小雨"), "武汉": ("25°C", "多云"), "南京": ("20°C", "晴"),
           "西安": ("16°C", "大风"), "重庆": ("26°C", "阴"), "Tokyo": ("12°C", "晴"), "New York": ("8°C", "多云"),
           "London": ("5°C", "小雨"), "Paris": ("10°C", "阴"), "Sydney": ("25°C", "晴朗")}
TIMES = {"Asia/Shanghai": "2025-03-07 14:30:00", "America/New_York": "2025-03-07 01:30:00",
         "Europe/London": "2025-03-07 06:30:00", "Asia/Tokyo": "2025-03-07 15:30:00",
         "Europe/Paris": "2025-03-07 07:30:00", "Australia/Sydney": "2025-03-07 17:30:00"}
RATES = {("USD", "CNY"): 7.21, ("EUR", "CNY"): 7.85, ("GBP", "CNY"): 9.12, ("JPY", "CNY"): 0.048,
         ("USD", "EUR"): 0.92, ("USD", "GBP"): 0.79, ("CNY", "JPY"): 20.83, ("AUD", "CNY"): 4.72}
TRANSLATIONS = {("你好世界", "english"): "Hello World", ("Good morning", "chinese"): "早上好",
                ("今天天气真好", "english"): "The weather is nice today",
                ("I love programming", "chinese"): "我喜欢编程",
                ("机器学习很有趣", "english"): "Machine learning is interesting",
                ("Happy birthday", "chinese"): "生日快乐"}
# unit -> (quantity, scale to the base unit, offset): value_base = value * scale + offset
UNITS = {"km": ("length", 1000.0, 0.0), "miles": ("length", 1609.344, 0.0), "meters": ("length", 1.0, 0.0),
         "feet": ("length", 0.3048, 0.0), "kg": ("mass", 1.0, 0.0), "pounds": ("mass", 0.45359237, 0.0),
         "celsius": ("temperature", 1.0, 0.0), "fahrenheit": ("temperature", 5 / 9, -160 / 9)}
UNIT_ALIASES = {"kilometers": "km", "kilometer": "km", "公里": "km", "千米": "km", "mile": "miles", "mi": "miles",
                "英里": "miles", "m": "meters", "meter": "meters", "米": "meters", "foot": "feet", "ft": "feet",
                "英尺": "feet", "kilograms": "kg", "kilogram": "kg", "公斤": "kg", "千克": "kg", "pound": "pounds",
                "lb": "pounds", "lbs": "pounds", "磅": "pounds", "c": "celsius", "°c": "celsius", "摄氏度": "celsius",
                "f": "fahrenheit", "°f": "fahrenheit", "华氏度": "fahrenheit"}

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCTIONS = {name: getattr(math, name) for name in ("sqrt", "log", "log10", "log2", "exp", "sin", "cos", "tan",
                                                     "floor", "ceil", "factorial")} | {"abs": abs, "round": round}
_CONSTANTS = {"pi": math.pi, "e": math.e}


def _evaluate(node):
    """A parsed arithmetic expression's value: numbers, operators, math functions; nothing else runs."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 256:  # 9**9**9 would run for minutes
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](left, right)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        if node.func.id == "factorial" and _evaluate(node.args[0]) > 100:
            raise ValueError("factorial argument too large")
        return _FUNCTIONS[node.func.id](*[_evaluate(arg) for arg in node.args])
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculate_math(expression):
    """MiniMind's calculator: ^ × ÷ − and full-width brackets read as Python operators."""
    for written, python in (("^", "**"), ("×", "*"), ("÷", "/"), ("−", "-"), ("（", "("), ("）", ")")):
        expression = expression.replace(written, python)
    return {"result": str(_evaluate(ast.parse(expression.strip(), mode="eval").body))}


def unit_converter(value, from_unit, to_unit):
    source, target = (UNIT_ALIASES.get(u.strip().lower(), u.strip().lower()) for u in (from_unit, to_unit))
    if source not in UNITS or target not in UNITS or UNITS[source][0] != UNITS[target][0]:
        raise ValueError(f"cannot convert {from_unit} to {to_unit}")
    base = float(value) * UNITS[source][1] + UNITS[source][2]
    return {"result": round((base - UNITS[target][2]) / UNITS[target][1], 4), "unit": target}


def get_current_weather(location):
    temperature, condition = WEATHER.get(location, ("22°C", "晴"))  # MiniMind's answer for a city not listed
    return {"city": location, "temperature": temperature, "humidity": "65%", "condition": condition}


def get_exchange_rate(from_currency, to_currency):
    pair = (from_currency.strip().upper(), to_currency.strip().upper())
    if pair in RATES:
        rate = RATES[pair]
    elif pair[::-1] in RATES:
        rate = round(1 / RATES[pair[::-1]], 4)
    else:
        raise ValueError(f"no rate for {pair[0]} to {pair[1]}")
    return {"from": pair[0], "to": pair[1], "rate": rate}


MOCKS = {
    "calculate_math": lambda a: calculate_math(str(a["expression"])),
    "unit_converter": lambda a: unit_converter(a["value"], str(a["from_unit"]), str(a["to_unit"])),
    "get_current_weather": lambda a: get_current_weather(a["location"]),
    "get_current_time": lambda a: {"datetime": TIMES.get(a.get("timezone") or "Asia/Shanghai", TIMES["Asia/Shanghai"]),
                                   "timezone": a.get("timezone") or "Asia/Shanghai"},
    "get_exchange_rate": lambda a: get_exchange_rate(str(a["from_currency"]), str(a["to_currency"])),
    "translate_text": lambda a: {"translated_text": TRANSLATIONS.get(
        (a["text"], str(a["target_language"]).lower()), a["text"])},
}


def tool_schemas(names=None):
    """The schemas of the named tools (all six by default), in the order given."""
    by_name = {tool["function"]["name"]: tool for tool in TOOLS}
    return [by_name[name] for name in (names or TOOL_NAMES)]


def _arguments(arguments):
    """A call's arguments as a dict (OpenAI sends them as JSON text); None when they are not an object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None
    return arguments if isinstance(arguments, dict) else None


def execute_tool(name, arguments):
    """The mock tool's result for one call: always a dict, {"error": ...} for an unknown tool or bad arguments."""
    args = _arguments(arguments)
    if name not in MOCKS:
        return {"error": f"unknown tool: {name}"}
    if args is None:
        return {"error": "arguments must be a JSON object"}
    try:
        return MOCKS[name](args)
    except KeyError as e:
        return {"error": f"missing argument {e.args[0]}"}
    except (ValueError, TypeError, ArithmeticError, SyntaxError, RecursionError) as e:
        return {"error": f"{name} failed: {str(e)[:80]}"}


def valid_call(call, tools):
    """An OpenAI-style call names one of `tools` and gives each required argument (not null, not empty)."""
    function = call.get("function", call)
    args = _arguments(function.get("arguments", {}))
    schema = {tool["function"]["name"]: tool["function"] for tool in tools or []}.get(function.get("name"))
    if schema is None or args is None:
        return False
    return all(args.get(key) not in (None, "") for key in schema.get("parameters", {}).get("required", []))


@dataclass
class AssistantTurn:
    """One assistant message parsed: the OpenAI fields, and the <tool_call> bodies that were not a call."""
    content: str
    reasoning_content: str | None = None
    tool_calls: list = field(default_factory=list)
    malformed: list = field(default_factory=list)

    def message(self):
        """The OpenAI assistant message, as the chat template renders it back."""
        message = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _call(body, index):
    """An OpenAI tool call from a <tool_call> body ({"name": str, "arguments": object}), else None."""
    try:
        data = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = _arguments(data.get("arguments", {}))
    if args is None:
        return None
    return {"id": f"call_{index}", "type": "function",
            "function": {"name": data["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _unfinished_tail(text):
    """How many trailing characters may still change: the start of a tag, or a character decoded from part of its
    bytes (the tokenizer shows it as U+FFFD until the rest arrives)."""
    held = len(text) - len(text.rstrip("\ufffd"))
    body = text[:len(text) - held]
    for k in range(min(len(body), max(map(len, TAGS)) - 1), 0, -1):
        if any(tag.startswith(body[-k:]) for tag in TAGS):
            return held + k
    return held


def parse_assistant(text, open_thinking=False, final=True):
    """Split a generated assistant text into content, reasoning_content and OpenAI tool_calls.

    Reasoning is what precedes the first </think> when the prompt opened the think block (open_thinking) or the
    text starts with <think>; a block never closed is all reasoning. Each <tool_call> block holding
    {"name", "arguments"} JSON becomes a call and leaves the content; other blocks stay in it (listed as malformed).
    final=False parses a text still being generated: only what no later token can change (the streaming server
    sends it), so every field is a prefix of the final parse's.
    """
    if not final:
        text = text[:len(text) - _unfinished_tail(text)]
    reasoning, rest = None, text
    start = text.lstrip()
    if open_thinking or start.startswith("<think>"):
        body = start[len("<think>"):] if start.startswith("<think>") else start
        reasoning, _, rest = body.partition("</think>")
        reasoning = reasoning.strip()
    if not final:  # a call still being written: from the first <tool_call> after the last whole block
        opened = rest.find("<tool_call>", max((m.end() for m in BLOCK.finditer(rest)), default=0))
        rest = rest[:opened] if opened >= 0 else rest
    calls, malformed = [], []

    def take(match):
        call = _call(match.group(1), len(calls))
        if call is None:
            malformed.append(match.group(1))
            return match.group(0)
        calls.append(call)
        return ""

    content = BLOCK.sub(take, rest).strip()
    return AssistantTurn(content, reasoning, calls, malformed)


def gt_matches(text, gt):
    """The ground-truth values `text` states. A number matches a number of the text within 1e-6 (thousands
    separators ignored, a sentence's final period allowed), never digits inside another number ("12" is not in
    "12.5"); any other value matches as a case-insensitive substring. MiniMind's agent reward rule, minus its
    substring match for numbers."""
    text = str(text)
    numbers = [float(x) for x in re.findall(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?!\w|\.\d)", text.replace(",", ""))]
    found = set()
    for value in gt:
        value = str(value).strip()
        number = value.replace(",", "")
        if re.fullmatch(r"[-+]?\d+(?:\.\d+)?", number):
            if any(abs(float(number) - n) < 1e-6 for n in numbers):
                found.add(value)
        elif value and value.lower() in text.lower():
            found.add(value)
    return found


def tool_message(call, tools):
    """The `tool` message answering one call: the mock's JSON result (an error for a tool not offered)."""
    name = call["function"]["name"]
    offered = {tool["function"]["name"] for tool in tools or []}
    result = execute_tool(name, call["function"]["arguments"]) if name in offered else \
        {"error": f"tool {name} is not available"}
    return {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result, ensure_ascii=False)}


def run_episode(generate, messages, tools, max_turns=3, open_thinking=False):
    """Multi-turn tool use: `generate(messages) -> text` is one model turn; each call it makes is answered by the
    mock tools as a `tool` message, until a turn makes no call or max_turns turns are done.
    Returns (turns, messages): the parsed turns and the conversation with every added message."""
    messages, turns = list(messages), []
    for _ in range(max_turns):
        turn = parse_assistant(generate(messages), open_thinking)
        turns.append(turn)
        messages.append(turn.message())
        if not turn.tool_calls:
            break
        messages += [tool_message(call, tools) for call in turn.tool_calls]
    return turns, messages


# The tool-call cases: MiniMind-3's eval prompts, each with the tools offered, the tool expected, the ground truth
# (from the mock data above) and a reference answer (the last message of an agent_rl row)
TOOL_CASES = [
    dict(prompt="帮我算一下 256 乘以 37 等于多少", tools=["calculate_math", "get_current_time"],
         tool="calculate_math", gt=["9472"], answer="256 乘以 37 等于 9472。"),
    dict(prompt="What is 2 to the power of 10?", tools=["calculate_math", "unit_converter"],
         tool="calculate_math", gt=["1024"], answer="2 to the power of 10 is 1024."),
    dict(prompt="现在几点了？", tools=["get_current_time", "get_current_weather"],
         tool="get_current_time", gt=["14:30"], answer="现在是 2025-03-07 14:30:00（Asia/Shanghai）。"),
    dict(prompt="帮我把100公里换算成英里", tools=["unit_converter", "calculate_math"],
         tool="unit_converter", gt=["62.1371"], answer="100 公里约等于 62.1371 英里。"),
    dict(prompt="Convert 30 celsius to fahrenheit.", tools=["unit_converter", "get_current_weather"],
         tool="unit_converter", gt=["86"], answer="30 celsius is 86 fahrenheit."),
    dict(prompt="北京今天天气怎么样？", tools=["get_current_weather", "get_current_time"],
         tool="get_current_weather", gt=["28°C"], answer="北京今天晴，气温 28°C。"),
    dict(prompt="What is the weather in Tokyo?", tools=["get_current_weather", "translate_text"],
         tool="get_current_weather", gt=["12°C"], answer="Tokyo is sunny (晴) at 12°C."),
    dict(prompt="查一下美元兑人民币汇率", tools=["get_exchange_rate", "get_current_time"],
         tool="get_exchange_rate", gt=["7.21"], answer="1 美元约兑 7.21 人民币。"),
    dict(prompt="把'你好世界'翻译成英文", tools=["translate_text", "calculate_math"],
         tool="translate_text", gt=["Hello World"], answer="'你好世界' 的英文是 Hello World。"),
]


def agent_rows(cases=TOOL_CASES):
    """The cases as MiniMind-3's agent_rl.jsonl rows: tools (JSON text) on the system message, the user prompt, the
    reference answer (dropped by the RL loader), and `gt`."""
    return [{"conversations": [{"role": "system", "content": "", "tools": json.dumps(tool_schemas(case["tools"]),
                                                                                    ensure_ascii=False)},
                               {"role": "user", "content": case["prompt"]},
                               {"role": "assistant", "content": case["answer"]}],
             "gt": list(case["gt"])} for case in cases]
