"""A chat page for the model in the browser (Streamlit), as MiniMind's web demo, over the inference library
(scripts/inference/).

    streamlit run scripts/web_demo.py --browser.gatherUsageStats false -- --weight full_sft
    streamlit run scripts/web_demo.py --browser.gatherUsageStats false -- --load_from out/hf_model --temperature 0

The flags after `--` are eval_llm's (weights, LoRA, model shape, device, sampling defaults); `--weight full_sft`
alone finds out/full_sft_<size>.pth by its sidecar. Streamlit's usage statistics are off: by the flag, and by
.streamlit/config.toml when started from the repository root, which also binds the page to 127.0.0.1 (it has no access
control; any other address shows a warning on the page). The sidebar sets the
sampling, how many earlier rounds the model sees, the thinking switch and which of the six mock tools it may call;
a tool call is answered by the mock tool and the model goes on (up to 3 turns), as in scripts/eval_toolcall.py.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import streamlit as st  # noqa: E402
import torch  # noqa: E402

from dataset.tools import TOOL_NAMES, parse_assistant, run_episode, tool_schemas  # noqa: E402
from model.weights.flag_advice import weights_line  # noqa: E402
from scripts.inference.flags import add_model_args, add_sampling_args, parsed  # noqa: E402
from scripts.inference.generate import render_prompt, stream_ids  # noqa: E402
from scripts.inference.load import LOAD_ERRORS, load_chat_model  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="MiniMind web chat (streamlit run scripts/web_demo.py --browser.gatherUsageStats false -- FLAGS)")
    add_model_args(parser, weight="full_sft")
    add_sampling_args(parser, max_new_tokens=512)
    return parsed(parser, argv)


@st.cache_resource(show_spinner="Loading the model ...")
def load(argv):
    """(model, tokenizer) for these flags, loaded once per server process."""
    args = parse_args(list(argv))
    torch.manual_seed(args.seed)
    return load_chat_model(args)


def show(message):
    """One message of the conversation: the think block folded away, tool calls and results as code."""
    if message["role"] == "tool":
        with st.chat_message("assistant", avatar="🛠️"):
            st.code(message["content"], language="json")
        return
    with st.chat_message(message["role"]):
        if message.get("reasoning_content"):
            with st.expander("Thinking"):
                st.markdown(message["reasoning_content"])
        if message.get("content"):
            st.markdown(message["content"])
        for call in message.get("tool_calls", []):
            st.code(f"{call['function']['name']}({call['function']['arguments']})", language="python")


LOOPBACK = ("127.0.0.1", "localhost", "::1")  # .streamlit/config.toml's server.address
OPEN_NOTE = ("This chat listens beyond this machine (server.address {}) and has no access control: anyone who reaches "
             "the port can use the model. `--server.address 127.0.0.1` keeps it local.")


def context(messages, rounds):
    """The messages the model sees: the last `rounds` earlier rounds and the current one."""
    starts = [i for i, message in enumerate(messages) if message["role"] == "user"]
    return messages[starts[-min(rounds + 1, len(starts))]:]


def main():
    args = parse_args(sys.argv[1:])
    st.set_page_config(page_title="MiniMind", initial_sidebar_state="expanded")
    address = st.get_option("server.address")
    if address not in LOOPBACK:  # unset: Streamlit listens on every interface
        st.warning(OPEN_NOTE.format(address or "unset: every interface"))
    try:
        model, tokenizer = load(tuple(sys.argv[1:]))
    except LOAD_ERRORS as e:
        st.error(f"error: {weights_line(e)}")
        st.stop()

    sidebar = st.sidebar
    # the ranges widen to hold the flags' values, which become the sliders' starting points
    max_new_tokens = sidebar.slider("Max new tokens", 1, max(8192, args.max_new_tokens), args.max_new_tokens,
                                    key="max_new_tokens")
    temperature = sidebar.slider("Temperature (0: greedy)", 0.0, max(1.5, args.temperature), float(args.temperature),
                                 0.05, key="temperature")
    top_p = sidebar.slider("Top p", min(0.05, args.top_p), 1.0, float(args.top_p), 0.05, key="top_p")
    rounds = sidebar.slider("Earlier rounds the model sees", 0, 8, 2, key="rounds")
    thinking = sidebar.checkbox("Thinking", value=bool(args.open_thinking), key="thinking")
    names = sidebar.multiselect("Tools", TOOL_NAMES, default=[], key="tools")
    if sidebar.button("Clear chat"):
        st.session_state.messages = []

    st.title("MiniMind")
    messages = st.session_state.setdefault("messages", [])
    for message in messages:
        show(message)
    prompt = st.chat_input("Send a message")
    if not prompt:
        return
    messages.append({"role": "user", "content": prompt})
    show(messages[-1])
    tools = tool_schemas(names) if names else None

    def generate(conversation):
        """One model turn, streamed into the page as raw text while it is generated."""
        text = render_prompt(tokenizer, conversation, chat=True, open_thinking=thinking, tools=tools)
        placeholder, ids = st.empty(), []
        for token in stream_ids(model, tokenizer, text, max_new_tokens, temperature, top_p):
            ids.append(token)
            placeholder.markdown(tokenizer.decode(ids, skip_special_tokens=True))
        placeholder.empty()
        return tokenizer.decode(ids, skip_special_tokens=True)

    seen = context(messages, rounds)
    if tools:
        added = run_episode(generate, seen, tools, max_turns=3, open_thinking=thinking)[1][len(seen):]
    else:  # no tools offered: one turn, nothing executed
        added = [parse_assistant(generate(seen), thinking).message()]
    for message in added:
        show(message)
    messages.extend(added)


main()
