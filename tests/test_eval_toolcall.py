"""scripts/eval_toolcall.py: the counting on fixed model outputs (hand-scored), and one run of the script on a tiny
random model whose report must add up."""
import json
import re

import pytest
import torch

from dataset.tools import TOOL_CASES
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights.files import save_weights_file
from scripts.eval_toolcall import empty_note, evaluate, main, summary


def call(name, **arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)}\n</tool_call>'


# scripted model turns per case prompt: what a model said, turn after turn
SCRIPTS = {
    # a perfect episode: call, then the answer with the ground truth
    "帮我算一下 256 乘以 37 等于多少": [call("calculate_math", expression="256*37"), "256 × 37 = 9,472。"],
    # answers without calling: right number, but no valid call and not the expected tool
    "What is 2 to the power of 10?": ["It is 1024."],
    # calls an offered but wrong tool, then answers with the truth anyway
    "现在几点了？": [call("get_current_weather", location="北京"), "现在 14:30。"],
    # a well-formed call missing a required argument
    "帮我把100公里换算成英里": [call("unit_converter", value=100, from_unit="km"), "约 62.1371 英里"],
    # right call, wrong answer (32 is not 86)
    "Convert 30 celsius to fahrenheit.": [call("unit_converter", value=30, from_unit="celsius",
                                               to_unit="fahrenheit"), "That is 32 fahrenheit."],
    # a malformed call next to a right one
    "北京今天天气怎么样？": [call("get_current_weather", location="北京") + "\n<tool_call>{oops}</tool_call>",
                        "北京 28°C，晴。"],
    # keeps calling: three turns used, never answers
    "What is the weather in Tokyo?": [call("get_current_weather", location="Tokyo")] * 3,
    # thinking before a right call, and the answer after
    "查一下美元兑人民币汇率": ["<think>\nNeed the rate.\n</think>\n\n" + call("get_exchange_rate", from_currency="USD",
                                                                         to_currency="CNY"), "汇率是 7.21。"],
    # a tool that was not offered
    "把'你好世界'翻译成英文": [call("get_current_time"), "Hello World"],
}
# hand-scored: (valid_call, right_tool, gt found, passed)
EXPECTED = [(True, True, 1, True), (False, False, 1, False), (True, False, 1, False), (False, True, 1, False),
            (True, True, 0, False), (False, True, 1, False), (True, True, 0, False), (True, True, 1, True),
            (False, False, 1, False)]


def scripted_generate():
    turns = {prompt: iter(texts) for prompt, texts in SCRIPTS.items()}

    def generate(messages, tools):
        return next(turns[messages[0]["content"]])
    return generate


def test_counting_on_fixed_outputs():
    assert [case["prompt"] for case in TOOL_CASES] == list(SCRIPTS)
    results = [result for _, result in evaluate(TOOL_CASES, scripted_generate(), max_turns=3, open_thinking=False)]
    got = [(r["valid_call"], r["right_tool"], r["gt_found"], r["passed"]) for r in results]
    assert got == EXPECTED
    assert results[6]["finished"] is False and results[6]["answer"] == ""
    assert results[0]["calls"] == ['calculate_math({"expression": "256*37"})']
    assert summary(results) == "tool-call eval: 2/9 passed (valid call 5/9, right tool 6/9, ground truth 7/9)"


def test_end_to_end_on_a_random_model(tmp_path, capsys):
    """A random model calls no tool: 0 passes, one line per case, and the summary counts what the lines say."""
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    save_weights_file(MiniMindForCausalLM(config).state_dict(), config, str(tmp_path / "full_sft_64.pth"))
    assert main(["--save_dir", str(tmp_path), "--hidden_size", "64", "--max_new_tokens", "8", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.strip().split("\n")
    case_lines = [line for line in lines if line.startswith("[")]
    assert [line.split()[0] for line in case_lines] == [f"[{i}/9]" for i in range(1, 10)]
    pattern = r"(PASS|FAIL) valid_call=(\d) right_tool=(\d) gt=(\d)/(\d)"
    flags = [re.search(pattern, line).groups() for line in case_lines]
    passed = sum(f[0] == "PASS" for f in flags)
    valid, right = sum(int(f[1]) for f in flags), sum(int(f[2]) for f in flags)
    truth = sum(f[3] == f[4] for f in flags)
    assert passed == 0
    assert lines[-1] == (f"tool-call eval: {passed}/9 passed (valid call {valid}/9, right tool {right}/9, "
                         f"ground truth {truth}/9)")


def test_a_score_of_empty_turns_says_what_it_means():
    """Cases with no call and an empty answer (the README chain's agent: 0/9, every answer "") are counted in a note;
    an answer or a call in every case: no note."""
    empty, answered, called = (dict(calls=[], answer=" "), dict(calls=[], answer="12"),
                               dict(calls=['get_weather({"city": "Paris"})'], answer=""))
    assert empty_note([empty, answered, called, empty]).startswith(
        "note: 2/4 cases got no tool call and an empty answer: the model closed its turn at once")
    assert empty_note([answered, called]) is None


def test_bad_max_turns_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["--max_turns", "0", "--device", "cpu"])
    assert caught.value.code == 2
    assert capsys.readouterr().err == "error: --max_turns must be at least 1 (got 0)\n"
