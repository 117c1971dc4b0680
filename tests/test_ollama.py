"""model/export/ollama.py: the Modelfile's Go TEMPLATE, evaluated with Go's text/template semantics
(tests/helpers/gotemplate.py; Ollama cannot run here), renders a chat as our chat template
(model/tokenizer_config.json via
transformers) does."""
import json
import os

import pytest
from transformers import AutoTokenizer

from model.export.ollama import STOP_TOKENS, TEMPLATE, modelfile
from tests.helpers.gotemplate import go_json, render
from tests.helpers.launch import ROOT

TOOLS = [{"type": "function", "function": {
    "name": "gcd", "description": "Greatest common divisor of a & b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
CHAT = [{"role": "system", "content": "You are MiniMind."},
        {"role": "user", "content": "What is the gcd of 12 and 18?"},
        {"role": "assistant", "content": "Let me compute it.", "reasoning_content": "Use the gcd tool.",
         "tool_calls": [{"type": "function", "function": {"name": "gcd", "arguments": {"a": 12, "b": 18}}},
                        {"type": "function", "function": {"name": "gcd", "arguments": {"a": 6, "b": 6}}}]},
        {"role": "tool", "content": "6"}, {"role": "tool", "content": "6"},
        {"role": "assistant", "content": "It is 6.", "reasoning_content": "Both say 6."},
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "And of 7 and 5? 谢谢"}]


def ollama_values(messages, tools=None, think=False):
    """What Ollama's template.Execute passes: messages with Go's field names, tools, think."""
    converted = [{"Role": m["role"], "Content": m["content"], "Thinking": m.get("reasoning_content", ""),
                  "ToolCalls": [{"Function": {"Name": c["function"]["name"], "Arguments": c["function"]["arguments"]}}
                                for c in m.get("tool_calls", [])]} for m in messages]
    return {"Messages": converted, "Tools": tools or [], "Think": think}


def ours(messages, tools=None, think=False):
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "model"))
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                         open_thinking=think)


@pytest.mark.parametrize("think", [False, True])
def test_template_renders_our_chat_with_tool_calls_exactly_when_arguments_are_compact(think):
    """Ollama's json is Go's json.Marshal (compact): a chat whose tool-call arguments our template receives as that
    same compact text (OpenAI clients send arguments as a JSON string) renders to the same characters."""
    compact = [dict(m, tool_calls=[{"type": "function", "function": dict(c["function"], arguments=go_json(
        c["function"]["arguments"]))} for c in m["tool_calls"]]) if "tool_calls" in m else m for m in CHAT]
    assert render(TEMPLATE, ollama_values(CHAT, think=think)) == ours(compact, think=think)


def test_template_with_tools_differs_from_ours_only_in_json_whitespace():
    """With tools and dict arguments our tojson writes {"a": 12}, Go {"a":12}: every other line is the same, and each
    differing line holds the same JSON value (a <tools> entry or a tool call)."""
    theirs, reference = render(TEMPLATE, ollama_values(CHAT, TOOLS)), ours(CHAT, TOOLS)
    assert theirs != reference
    their_lines, our_lines = theirs.split("\n"), reference.split("\n")
    assert len(their_lines) == len(our_lines)
    differing = [(a, b) for a, b in zip(their_lines, our_lines) if a != b]
    assert len(differing) == 3  # one tool schema, two tool calls
    for their_line, our_line in differing:
        assert json.loads(their_line) == json.loads(our_line)
    assert our_lines[our_lines.index("<tools>") + 1] == json.dumps(TOOLS[0])  # our template's tojson


def test_chat_without_system_or_tools_and_an_open_thinking_prompt():
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "  spaces\n\nand lines  "}]
    assert render(TEMPLATE, ollama_values(chat, think=True)) == ours(chat, think=True)
    assert render(TEMPLATE, ollama_values(chat)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_modelfile_names_the_gguf_template_stops_and_parameters():
    text = modelfile("minimind-q8_0.gguf", 2048)
    assert text.startswith("FROM ./minimind-q8_0.gguf\n")
    assert f'TEMPLATE """{TEMPLATE}"""' in text and '"""' not in TEMPLATE
    for token in STOP_TOKENS:
        assert f'PARAMETER stop "{token}"' in text
    assert "PARAMETER num_ctx 2048" in text
