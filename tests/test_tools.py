"""dataset/tools.py: tool-call parsing against hand-written texts and the chat template's own rendering; the mock
tools against hand-computed results; episodes and agent rows."""
import json
import random

import pytest

from dataset.chat import chat_messages
from dataset.tools import (
    TOOL_CASES,
    TOOLS,
    agent_rows,
    execute_tool,
    gt_matches,
    parse_assistant,
    run_episode,
    tool_schemas,
    valid_call,
)


def calls(turn):
    """(name, arguments as a dict) of each parsed call."""
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in turn.tool_calls]


WEATHER_CALL = '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Tokyo"}}\n</tool_call>'


@pytest.mark.parametrize("text,open_thinking,content,reasoning,expected_calls,malformed", [
    ("Hello there.", False, "Hello there.", None, [], 0),
    ("Let me look.\n" + WEATHER_CALL, False, "Let me look.", None, [("get_current_weather", {"location": "Tokyo"})], 0),
    (WEATHER_CALL + "\n" + WEATHER_CALL.replace("Tokyo", "北京"), False, "", None,
     [("get_current_weather", {"location": "Tokyo"}), ("get_current_weather", {"location": "北京"})], 0),
    # the prompt opened the think block: everything up to </think> is reasoning
    ("The user wants weather.\n</think>\n\n" + WEATHER_CALL, True, "", "The user wants weather.",
     [("get_current_weather", {"location": "Tokyo"})], 0),
    ("<think>\nshort\n</think>\n\nIt is 12°C.", False, "It is 12°C.", "short", [], 0),
    ("still thinking when cut off", True, "", "still thinking when cut off", [], 0),
    # arguments given as JSON text (as OpenAI clients send them back) are decoded
    ('<tool_call>{"name": "calculate_math", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>', False, "",
     None, [("calculate_math", {"expression": "1+1"})], 0),
    # not a call: bad JSON, no name, arguments not an object; they stay in the content
    ("A <tool_call>{oops}</tool_call>", False, "A <tool_call>{oops}</tool_call>", None, [], 1),
    ('<tool_call>{"arguments": {}}</tool_call>', False, '<tool_call>{"arguments": {}}</tool_call>', None, [], 1),
    ('<tool_call>{"name": "x", "arguments": [1]}</tool_call>', False,
     '<tool_call>{"name": "x", "arguments": [1]}</tool_call>', None, [], 1),
    # a </think> the prompt did not open is text
    ("plain </think> text", False, "plain </think> text", None, [], 0),
    # a call cut off by the length limit is text
    ('<tool_call>\n{"name": "get_cur', False, '<tool_call>\n{"name": "get_cur', None, [], 0),
])
def test_parse_hand_written(text, open_thinking, content, reasoning, expected_calls, malformed):
    turn = parse_assistant(text, open_thinking)
    assert turn.content == content
    assert turn.reasoning_content == reasoning
    assert calls(turn) == expected_calls
    assert len(turn.malformed) == malformed
    assert [c["id"] for c in turn.tool_calls] == [f"call_{i}" for i in range(len(expected_calls))]


def assistant_text(rendered):
    """The last assistant turn's text in a rendering: what the model would have generated."""
    start = rendered.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    return rendered[start:rendered.index("<|im_end|>", start)]


@pytest.mark.parametrize("reasoning", ["", "The user asks two things; weather first, then the rate."])
@pytest.mark.parametrize("as_text", [False, True])
def test_template_rendering_parses_back(tokenizer, reasoning, as_text):
    """An assistant message with tool_calls rendered by model/tokenizer_config.json's template parses back into the
    same reasoning, content and calls (arguments given as objects, or as OpenAI's JSON text)."""
    arguments = [{"location": "Tokyo"}, {"from_currency": "USD", "to_currency": "CNY"}]
    message = {"role": "assistant", "content": "Checking both.", "reasoning_content": reasoning, "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": json.dumps(a) if as_text else a}}
        for name, a in zip(["get_current_weather", "get_exchange_rate"], arguments)]}
    tools = tool_schemas(["get_current_weather", "get_exchange_rate"])
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Weather in Tokyo and USD to CNY?"},
                                              message], tools=tools, tokenize=False)
    text = assistant_text(rendered)
    assert text.startswith("<think>\n") and "<tool_call>" in text  # the template's own format
    turn = parse_assistant(text)
    assert turn.content == "Checking both."
    assert turn.reasoning_content == reasoning
    assert calls(turn) == [("get_current_weather", arguments[0]), ("get_exchange_rate", arguments[1])]
    # and the parsed message renders to the same text again
    again = tokenizer.apply_chat_template([{"role": "user", "content": "Weather in Tokyo and USD to CNY?"},
                                           turn.message()], tools=tools, tokenize=False)
    assert again == rendered


def test_generation_prompt_and_parse_agree_on_thinking(tokenizer):
    """With open_thinking the template ends the prompt inside <think>: the model's text has only the closing tag,
    and parse_assistant(open_thinking=True) takes the reasoning from there."""
    messages = [{"role": "user", "content": "hi"}]
    opened = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, open_thinking=True)
    assert opened.endswith("<think>\n")
    generated = "I should greet back.\n</think>\n\nHello!"
    turn = parse_assistant(generated, open_thinking=True)
    assert (turn.reasoning_content, turn.content) == ("I should greet back.", "Hello!")
    rendered = tokenizer.apply_chat_template(messages + [turn.message()], tokenize=False)
    assert rendered == opened + generated + "<|im_end|>\n"  # the same tokens the model produced, closed


STREAMED = ["Reasoning about <b> tags.\n</think>\n\nHere: " + WEATHER_CALL + " done <tool_call>{bad}</tool_call> x",
            "<think>\nhmm\n</think>\n\n" + WEATHER_CALL + "\n" + WEATHER_CALL, "Ends in a partial tag </tool_ca",
            "你好，世界\ufffd",
            # a tag inside a call's JSON: the call is whole only at its first </tool_call>
            'A <tool_call>{"name": "calculate_math", "arguments": {"expression": "<tool_call>1"}}</tool_call> B']


@pytest.mark.parametrize("text", STREAMED)
@pytest.mark.parametrize("open_thinking", [False, True])
def test_partial_parse_only_grows(text, open_thinking):
    """A streaming server sends the partial parse of each prefix: each field of it must be a prefix of the final
    parse's (nothing sent is ever taken back), and the final parse of the whole text is what non-streaming returns."""
    final = parse_assistant(text, open_thinking)
    sent_content, sent_reasoning = "", ""
    for k in range(len(text) + 1):
        partial = parse_assistant(text[:k], open_thinking, final=False)
        assert partial.content.startswith(sent_content) and final.content.startswith(partial.content), (k, partial)
        reasoning = partial.reasoning_content or ""
        assert reasoning.startswith(sent_reasoning) and (final.reasoning_content or "").startswith(reasoning)
        sent_content, sent_reasoning = partial.content, reasoning
        assert partial.tool_calls == final.tool_calls[:len(partial.tool_calls)]


def test_partial_parse_only_grows_on_random_texts():
    """The same property on 300 random texts made of tags, call bodies and text pieces, cut at every character."""
    pieces = ["<think>", "</think>", "<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": 1}}',
              '"<tool_call>"', "{oops}", "word", " ", "\n", "<", "</", "\ufffd", "你"]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        for open_thinking in (False, True):
            final = parse_assistant(text, open_thinking)
            for k in range(len(text) + 1):
                partial = parse_assistant(text[:k], open_thinking, final=False)
                assert final.content.startswith(partial.content), (text, k)
                assert (final.reasoning_content or "").startswith(partial.reasoning_content or ""), (text, k)


def test_partial_parse_holds_back_what_can_change():
    assert parse_assistant("Here <tool_ca", final=False).content == "Here"
    assert parse_assistant('Here <tool_call>{"name": "x"', final=False).content == "Here"
    assert parse_assistant("你\ufffd", final=False).content == "你"
    assert parse_assistant("abc\n</thi", open_thinking=True, final=False).reasoning_content == "abc"


def test_mock_tools_hand_computed():
    assert execute_tool("calculate_math", {"expression": "256 × 37"}) == {"result": "9472"}
    assert execute_tool("calculate_math", '{"expression": "2^10 + sqrt(144)"}') == {"result": "1036.0"}
    assert execute_tool("calculate_math", {"expression": "(7 - 1) % 4"}) == {"result": "2"}
    assert execute_tool("unit_converter", {"value": 100, "from_unit": "公里", "to_unit": "miles"})["result"] == 62.1371
    assert execute_tool("unit_converter", {"value": 30, "from_unit": "celsius", "to_unit": "fahrenheit"})["result"] \
        == 86.0  # 30 * 9 / 5 + 32
    assert execute_tool("unit_converter", {"value": 212, "from_unit": "F", "to_unit": "c"})["result"] == 100.0
    assert execute_tool("get_current_weather", {"location": "北京"}) == \
        {"city": "北京", "temperature": "28°C", "humidity": "65%", "condition": "晴"}
    assert execute_tool("get_current_time", {}) == {"datetime": "2025-03-07 14:30:00", "timezone": "Asia/Shanghai"}
    assert execute_tool("get_exchange_rate", {"from_currency": "usd", "to_currency": "CNY"})["rate"] == 7.21
    assert execute_tool("get_exchange_rate", {"from_currency": "CNY", "to_currency": "USD"})["rate"] == 0.1387
    assert execute_tool("translate_text", {"text": "你好世界", "target_language": "English"}) == \
        {"translated_text": "Hello World"}


@pytest.mark.parametrize("name,arguments,error", [
    ("search_web", {}, "unknown tool: search_web"),
    ("calculate_math", "[1]", "arguments must be a JSON object"),
    ("calculate_math", {}, "missing argument expression"),
    ("calculate_math", {"expression": "__import__('os').system('true')"}, "unsupported expression element Call"),
    ("calculate_math", {"expression": "9**9**9"}, "exponent too large"),
    ("calculate_math", {"expression": "1/0"}, "division by zero"),
    ("unit_converter", {"value": 1, "from_unit": "km", "to_unit": "kg"}, "cannot convert km to kg"),
    ("get_exchange_rate", {"from_currency": "USD", "to_currency": "XYZ"}, "no rate for USD to XYZ"),
])
def test_bad_calls_are_error_results(name, arguments, error):
    result = execute_tool(name, arguments)
    assert list(result) == ["error"] and error in result["error"]


def test_valid_call_checks_offered_tools_and_required_arguments():
    tools = tool_schemas(["unit_converter", "get_current_time"])
    call = {"function": {"name": "unit_converter", "arguments": '{"value": 1, "from_unit": "km", "to_unit": "m"}'}}
    assert valid_call(call, tools)
    assert not valid_call({"function": {"name": "unit_converter", "arguments": {"value": 1, "from_unit": "km"}}},
                          tools)
    assert not valid_call({"function": {"name": "unit_converter", "arguments": {"value": None, "from_unit": "km",
                                                                                "to_unit": "m"}}}, tools)
    assert valid_call({"function": {"name": "get_current_time", "arguments": {}}}, tools)  # nothing required
    assert not valid_call({"function": {"name": "calculate_math", "arguments": {"expression": "1"}}}, tools)


def test_gt_matches():
    assert gt_matches("256 × 37 = 9,472.", ["9472"]) == {"9472"}
    assert gt_matches("About 62.13710 miles", ["62.1371", "km"]) == {"62.1371"}
    assert gt_matches("it says hello world", ["Hello World"]) == {"Hello World"}
    assert gt_matches("It is 28°C, 晴", ["28°C", "晴", "雨"]) == {"28°C", "晴"}
    assert gt_matches("12.5 degrees in 2012, v12", ["12"]) == set()  # digits of other numbers are not the number
    assert gt_matches("-3 and 1e3", ["-3.0"]) == {"-3.0"}


def test_episode_calls_the_tool_and_answers():
    """A scripted model: a call, then an answer. The tool message is the mock's result for Tokyo, written out."""
    texts = iter([WEATHER_CALL, "Tokyo is 12°C and sunny."])
    seen = []

    def generate(messages):
        seen.append(list(messages))
        return next(texts)

    start = [{"role": "user", "content": "Weather in Tokyo?"}]
    turns, messages = run_episode(generate, start, tool_schemas(["get_current_weather"]))
    assert [t.content for t in turns] == ["", "Tokyo is 12°C and sunny."]
    assert messages[2] == {"role": "tool", "tool_call_id": "call_0", "content":
                           '{"city": "Tokyo", "temperature": "12°C", "humidity": "65%", "condition": "晴"}'}
    assert seen[1] == messages[:3] and messages[3]["content"] == "Tokyo is 12°C and sunny."


def test_episode_stops_after_max_turns_and_refuses_tools_not_offered():
    turns, messages = run_episode(lambda m: WEATHER_CALL, [{"role": "user", "content": "?"}],
                                  tool_schemas(["calculate_math"]), max_turns=2)
    assert len(turns) == 2 and all(t.tool_calls for t in turns)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool"]
    assert json.loads(messages[2]["content"]) == {"error": "tool get_current_weather is not available"}


def test_cases_ground_truth_is_what_the_mock_tools_return():
    """Each case's gt appears in the mock result of the expected tool called with the case's obvious arguments."""
    arguments = {"calculate_math": [{"expression": "256*37"}, {"expression": "2**10"}],
                 "get_current_time": [{}], "unit_converter": [{"value": 100, "from_unit": "km", "to_unit": "miles"},
                                                              {"value": 30, "from_unit": "celsius",
                                                               "to_unit": "fahrenheit"}],
                 "get_current_weather": [{"location": "北京"}, {"location": "Tokyo"}],
                 "get_exchange_rate": [{"from_currency": "USD", "to_currency": "CNY"}],
                 "translate_text": [{"text": "你好世界", "target_language": "english"}]}
    for case in TOOL_CASES:
        assert case["tool"] in case["tools"] and set(case["tools"]) <= {t["function"]["name"] for t in TOOLS}
        args = arguments[case["tool"]].pop(0)
        result = json.dumps(execute_tool(case["tool"], args), ensure_ascii=False)
        assert gt_matches(result, case["gt"]) == set(case["gt"]), (case, result)
        assert gt_matches(case["answer"], case["gt"]) == set(case["gt"])


def test_agent_rows_read_as_sft_conversations(tokenizer):
    """MiniMind's agent_rl layout: the SFT reader finds the tools on the system message and the template renders
    them; the last message is the reference answer."""
    rows = agent_rows()
    assert len(rows) == len(TOOL_CASES) and rows[0]["gt"] == ["9472"]
    messages, tools = chat_messages(rows[0]["conversations"])
    assert tools == tool_schemas(["calculate_math", "get_current_time"])
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert '"name": "calculate_math"' in text and text.rstrip().endswith("256 乘以 37 等于 9472。<|im_end|>")
