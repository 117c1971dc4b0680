"""Chat rows with tool calls that the dataset and SFT tests share, and the token ids of their pieces."""
import json

# MiniMind-3 sft_t2t style: schema on the system message, reasoning, a tool call, its result, the answer;
# tools and tool_calls as JSON strings, as MiniMind-3's files store them
GCD_TOOLS = [{"type": "function", "function": {"name": "gcd", "description": "Greatest common divisor.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


GCD_CALLS = [{"name": "gcd", "arguments": {"a": 12, "b": 18}}]


TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant.", "tools": json.dumps(GCD_TOOLS)},
    {"role": "user", "content": "gcd(12, 18)?"},
    {"role": "assistant", "content": "", "reasoning_content": "Call the gcd tool.",
     "tool_calls": json.dumps(GCD_CALLS)},
    {"role": "tool", "content": '{"gcd": 6}'},
    {"role": "assistant", "content": "It is 6.", "reasoning_content": "The tool says 6."},
]


# its rendering, written out by hand from MiniMind-3's template; True marks what the assistant generates
TOOL_CONVERSATION_PIECES = [
    ("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n"
     "You may call one or more functions to assist with the user query.\n\n"
     "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
     '{"type": "function", "function": {"name": "gcd", "description": "Greatest common divisor.", "parameters": '
     '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}'
     "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
     "<tool_call></tool_call> XML tags:\n<tool_call>\n"
     '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
     "<|im_start|>user\ngcd(12, 18)?<|im_end|>\n<|im_start|>assistant\n", False),
    ('<think>\nCall the gcd tool.\n</think>\n\n<tool_call>\n{"name": "gcd", "arguments": {"a": 12, "b": 18}}\n'
     "</tool_call><|im_end|>", True),
    ('\n<|im_start|>user\n<tool_response>\n{"gcd": 6}\n</tool_response><|im_end|>\n<|im_start|>assistant\n', False),
    ("<think>\nThe tool says 6.\n</think>\n\nIt is 6.<|im_end|>", True),
    ("\n", False),
]


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


CUT = ("", None)  # where SFT cuts a row, after a turn's generation prompt (dataset/chat.py): each side tokenized apart


def pieces_to_ids(tokenizer, pieces):
    """(ids, labels) of (text, labelled) pieces; boundaries fall on added tokens or before '\\n<|im_start|>', or are
    a CUT, where SFT tokenizes the two sides apart."""
    ids, labels, group = [], [], []
    for text, labelled in [*pieces, CUT]:
        if labelled is None:  # the group's pieces tokenize the same separately as together: the dataset's tokens
            assert ids[len(ids) - sum(len(encode(tokenizer, t)) for t in group):] == encode(tokenizer, "".join(group))
            group = []
            continue
        piece_ids = encode(tokenizer, text)
        ids += piece_ids
        labels += piece_ids if labelled else [-100] * len(piece_ids)
        group.append(text)
    return ids, labels
