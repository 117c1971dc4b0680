"""The agent stage's demo rows (agent_rl_demo.jsonl, built by dataset/demo_data.py): questions for MiniMind-3's six
mock tools (dataset/tools.py), gt the mock tool's answer."""
import random

from dataset.tools import RATES, TIMES, TOOL_NAMES, TRANSLATIONS, WEATHER, agent_rows, execute_tool

NUM_AGENT_ROWS = 120  # tool questions for the agent stage


def _agent_case(rng, kind):
    """A question for mock tool `kind`: (prompt, its call's arguments, the answer and the gt over the tool's result)."""
    if kind == "calculate_math":
        a, b = rng.randrange(12, 1000), rng.randrange(12, 100)
        return f"What is {a} times {b}?", {"expression": f"{a}*{b}"}, f"{a} times {b} is {{result}}.", "{result}"
    if kind == "unit_converter":
        value = rng.randrange(1, 200)
        source, target = rng.choice([("km", "miles"), ("miles", "km"), ("kg", "pounds"), ("celsius", "fahrenheit")])
        return (f"Convert {value} {source} to {target}.", {"value": value, "from_unit": source, "to_unit": target},
                f"{value} {source} is {{result}} {target}.", "{result}")
    if kind == "get_current_weather":
        city = rng.choice(sorted(WEATHER))
        return f"What is the weather in {city}?", {"location": city}, f"{city}: {{temperature}}, {{condition}}.", \
            "{temperature}"
    if kind == "get_current_time":
        zone = rng.choice(sorted(TIMES))
        return f"What time is it in {zone}?", {"timezone": zone}, f"In {zone} it is {{datetime}}.", "{time}"
    if kind == "get_exchange_rate":
        source, target = rng.choice(sorted(RATES))
        return (f"What is the exchange rate from {source} to {target}?", {"from_currency": source,
                "to_currency": target}, f"1 {source} is {{rate}} {target}.", "{rate}")
    text, language = rng.choice(sorted(TRANSLATIONS))
    return f"Translate '{text}' into {language}.", {"text": text, "target_language": language}, \
        "{translated_text}", "{translated_text}"


def agent_records(n=NUM_AGENT_ROWS, seed=4):
    """Agent RL rows: each question offers the tool it needs and another; gt is what the mock tool answers (a
    product, a conversion, a city's temperature, the time of day, a rate, a translation)."""
    rng, cases = random.Random(seed), []
    for _ in range(n):
        tool = rng.choice(TOOL_NAMES)
        prompt, arguments, answer, truth = _agent_case(rng, tool)
        result = execute_tool(tool, arguments)
        result["time"] = str(result.get("datetime", ""))[11:16]  # HH:MM, as TOOL_CASES states a time
        cases.append(dict(prompt=prompt, tools=[tool, rng.choice([t for t in TOOL_NAMES if t != tool])], tool=tool,
                          gt=[truth.format(**result)], answer=answer.format(**result)))
    return agent_rows(cases)
