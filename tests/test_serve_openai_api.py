"""scripts/serve_openai_api.py, in-process through FastAPI's TestClient: the greedy answer is eval_llm's, a stream
concatenates to the non-stream reply, usage counts the tokens, tool calls come back as tool_calls."""
import json

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from dataset.tools import parse_assistant, tool_schemas
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from model.weights.files import save_weights_file
from scripts.eval_llm import main as eval_main
from scripts.inference.load import load_chat_model
from scripts.serve.app import create_app
from scripts.serve_openai_api import parse_args
from tests.helpers.serving import CALL, CONFIG, PROMPT, ScriptedModel, ask, ask_stream, joined, over_http, trained_ids


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny random model saved as the trainer saves it, loaded by the server's own flags."""
    path = str(tmp_path_factory.mktemp("serve") / "full_sft_64.pth")
    config = MiniMindConfig(**CONFIG, initializer_range=0.1)
    torch.manual_seed(1)
    save_weights_file(MiniMindForCausalLM(config).state_dict(), config, path)
    args = parse_args(["--weight", path, "--device", "cpu", "--temperature", "0", "--max_new_tokens", "24"])
    model, tokenizer = load_chat_model(args)
    return path, args, model, tokenizer, TestClient(create_app(model, tokenizer, args))


def test_greedy_answer_equals_eval_llm(served, capsys):
    path, _, _, _, client = served
    eval_main(["--weight", path, "--prompt", PROMPT, "--chat", "1", "--temperature", "0", "--max_new_tokens", "24",
               "--device", "cpu"])
    expected = capsys.readouterr().out.split(f">>> {PROMPT}\n", 1)[1][:-1]  # TextStreamer ends with a newline
    assert expected.strip() and not any(tag in expected for tag in ("<think>", "</think>", "<tool_call>"))
    reply = ask(client, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=24)
    assert reply["object"] == "chat.completion" and reply["model"] == "minimind"
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": expected.strip()}


def reference_greedy_count(model, tokenizer, text, max_tokens):
    """Tokens a greedy decode makes (EOS included), by full forwards without a cache; and whether EOS ended it."""
    ids = torch.tensor([trained_ids(tokenizer, text)])
    for count in range(1, max_tokens + 1):
        with torch.no_grad():
            next_id = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
        if next_id == tokenizer.eos_token_id:
            return count, True
    return max_tokens, False


@pytest.mark.parametrize("thinking", [False, True])
def test_stream_concatenates_to_the_reply_and_usage_counts_tokens(served, thinking):
    _, _, model, tokenizer, client = served
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": PROMPT}]
    request = dict(messages=messages, temperature=0, max_tokens=20, chat_template_kwargs={"enable_thinking": thinking})
    reply = ask(client, **request)
    chunks = ask_stream(client, stream_options={"include_usage": True}, **request)
    message = reply["choices"][0]["message"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert joined(chunks, "content") == message["content"]
    assert joined(chunks, "reasoning_content") == (message.get("reasoning_content") or "")
    assert (message.get("reasoning_content") is not None) == thinking  # the open think block is reasoning
    assert chunks[-2]["choices"][0]["finish_reason"] == reply["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == reply["usage"]
    # usage: the prompt as the template renders it (written out here), the completion as a greedy decode counts it
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, open_thinking=thinking)
    assert text.endswith("<think>\n" if thinking else "</think>\n\n")
    prompt_tokens = len(trained_ids(tokenizer, text))
    completion_tokens, ended = reference_greedy_count(model, tokenizer, text, 20)
    assert reply["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens}
    assert reply["choices"][0]["finish_reason"] == ("stop" if ended else "length")


@pytest.fixture(scope="module")
def scripted(served):
    _, args, model, tokenizer, _ = served
    scripted = ScriptedModel(model.config).eval()
    scripted.load_state_dict(model.state_dict())
    scripted.tokenizer, scripted.prompts = tokenizer, []
    return scripted, TestClient(create_app(scripted, tokenizer, args))


@pytest.mark.parametrize("thinking", [False, True])
def test_tool_call_comes_back_as_tool_calls(scripted, thinking):
    model, client = scripted
    reasoning = "The user wants the weather in Tokyo." if thinking else None
    model.script = (f"{reasoning}\n</think>\n\n" if thinking else "") + "Let me check.\n" + CALL
    script_tokens = len(model.tokenizer(model.script, add_special_tokens=False).input_ids)
    assert model.tokenizer.decode(model.tokenizer(model.script, add_special_tokens=False).input_ids) == model.script
    tools = tool_schemas(["get_current_weather", "get_current_time"])
    request = dict(messages=[{"role": "user", "content": "Weather in Tokyo?"}], tools=tools, open_thinking=thinking,
                   max_tokens=64)
    reply = ask(client, **request)
    assert '"name": "get_current_weather"' in model.prompts[-1] and "# Tools" in model.prompts[-1]  # tools rendered
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    assert choice["message"].get("reasoning_content") == reasoning
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_current_weather"
    assert json.loads(call["function"]["arguments"]) == {"location": "Tokyo"}
    assert reply["usage"]["completion_tokens"] == script_tokens + 1  # the script, then EOS

    chunks = ask_stream(client, **request)
    assert joined(chunks, "content") == "Let me check." and "<tool_call>" not in joined(chunks, "content")
    assert joined(chunks, "reasoning_content") == (reasoning or "")
    [streamed] = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert streamed[0]["index"] == 0 and streamed[0]["function"] == call["function"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_result_goes_back_through_the_template(scripted):
    """The client's next request (OpenAI shape: the assistant's tool_calls with JSON-text arguments, then the tool
    message) reaches the model as the template's <tool_call> and <tool_response> blocks."""
    model, client = scripted
    model.script = "Tokyo is 12°C."
    call = {"id": "call_abc", "type": "function",
            "function": {"name": "get_current_weather", "arguments": '{"location": "Tokyo"}'}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather in Tokyo?"}]},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": "12°C"}'}]
    reply = ask(client, messages=messages, tools=tool_schemas(["get_current_weather"]), max_tokens=64)
    assert reply["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "Tokyo is 12°C."},
                                   "logprobs": None, "finish_reason": "stop"}
    prompt = model.prompts[-1]
    assert "<|im_start|>user\nWeather in Tokyo?<|im_end|>" in prompt
    assert CALL in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temperature": "12°C"}\n</tool_response><|im_end|>' in prompt


def test_models_lists_the_served_name(served):
    response = served[4].get("/v1/models")
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == ["minimind"]


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -1, "temperature must be a finite number, 0 (greedy) or more (got -1"),
    ("top_p", 0, "top_p must be in (0, 1] (got 0"),
    ("max_tokens", 0, "max_tokens must be at least 1 (got 0)"),
    ("messages", [], "messages must hold at least one message"),
    ("messages", [{"content": "no role"}], "messages[0].role must be one of system, user, assistant, tool (got None)"),
    ("messages", [{"role": "user", "content": "hi"}, {"role": "developer", "content": "x"}],
     "messages[1].role must be one of system, user, assistant, tool (got 'developer')"),
])
def test_bad_request_is_a_400_naming_the_field(served, field, value, message):
    request = {"model": "minimind", "messages": [{"role": "user", "content": "hi"}], field: value}
    response = served[4].post("/v1/chat/completions", json=request)
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == field and error["type"] == "invalid_request_error"


def sampled(model, tokenizer, messages, seed, n, temperature, max_tokens, top_p=0.9):
    """transformers' own generate() on the chat template after torch.manual_seed(seed): n sampled replies in a row,
    parsed as the server parses a reply."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, open_thinking=False)
    ids = torch.tensor([trained_ids(tokenizer, text)])
    torch.manual_seed(seed)
    replies = []
    for _ in range(n):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature,
                                 top_p=top_p, max_new_tokens=max_tokens, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
        replies.append(parse_assistant(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)).content)
    return replies


def test_seed_temperature_and_n_choose_the_samples(served):
    """A seeded request's n choices are transformers' n samples in a row after manual_seed(seed); another seed or
    another temperature gives other replies (so neither is ignored), and the stream carries the same choices."""
    _, _, model, tokenizer, client = served
    messages = [{"role": "user", "content": PROMPT}]
    request = dict(messages=messages, top_p=0.9, max_tokens=16)
    want = sampled(model, tokenizer, messages, 7, 3, 1.0, 16)
    other_seed, cooler = sampled(model, tokenizer, messages, 8, 1, 1.0, 16), sampled(model, tokenizer, messages, 7, 1,
                                                                                      0.3, 16)
    assert len(set(want)) == 3 and other_seed[0] != want[0] and cooler[0] != want[0]  # the checks below have teeth
    reply = ask(client, seed=7, n=3, temperature=1.0, **request)
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in reply["choices"]] == want
    assert ask(client, seed=8, temperature=1.0, **request)["choices"][0]["message"]["content"] == other_seed[0]
    assert ask(client, seed=7, temperature=0.3, **request)["choices"][0]["message"]["content"] == cooler[0]
    chunks = ask_stream(client, seed=7, n=3, temperature=1.0, **request)
    streamed = ["".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"][0]["index"] == i)
                for i in range(3)]
    assert [s.strip() for s in streamed] == want
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == [
        c["finish_reason"] for c in reply["choices"]]


def test_the_openai_client_reads_the_reply_the_stream_and_the_usage(served):
    """The official `openai` client over real HTTP: its parsed reply is the server's JSON reply (eval_llm's greedy
    answer, tested above), its stream joins to the same text with the same usage, and it lists the model."""
    _, args, model, tokenizer, client = served
    request = dict(messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=24)
    want = ask(client, **request)
    with over_http(create_app(model, tokenizer, args)) as base_url:
        api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        reply = api.chat.completions.create(model="minimind", **request)
        chunks = list(api.chat.completions.create(model="minimind", stream=True,
                                                  stream_options={"include_usage": True}, **request))
        models = [m.id for m in api.models.list()]
        with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
            api.chat.completions.create(model="minimind", messages=request["messages"], max_tokens=0)
    message = want["choices"][0]["message"]
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == message["content"]
    assert reply.choices[0].finish_reason == want["choices"][0]["finish_reason"]
    assert reply.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == want["usage"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message["content"]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == want["usage"]["total_tokens"]
    assert models == ["minimind"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_client_parses_tool_calls_and_reasoning(served, scripted, stream):
    """A scripted tool call (with a think block) through the `openai` client: tool_calls parsed into its objects with
    JSON-text arguments, the reasoning in `reasoning_content` (an extra field it keeps), the text without tags."""
    model, _ = scripted
    model.script = "The user wants the weather in Tokyo.\n</think>\n\nLet me check.\n" + CALL
    with over_http(create_app(model, model.tokenizer, served[1])) as base_url:
        api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        request = dict(model="minimind", messages=[{"role": "user", "content": "Weather in Tokyo?"}], max_tokens=64,
                       tools=tool_schemas(["get_current_weather"]), extra_body={"open_thinking": True})
        if stream:
            chunks = list(api.chat.completions.create(stream=True, **request))
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            content = "".join(d.content or "" for d in deltas)
            reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
            [calls] = [d.tool_calls for d in deltas if d.tool_calls]
            finish = chunks[-1].choices[0].finish_reason
        else:
            choice = api.chat.completions.create(**request).choices[0]
            content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
            reasoning = choice.message.model_extra["reasoning_content"]
    assert content == "Let me check." and reasoning == "The user wants the weather in Tokyo."
    assert finish == "tool_calls" and len(calls) == 1 and calls[0].function.name == "get_current_weather"
    assert json.loads(calls[0].function.arguments) == {"location": "Tokyo"}
