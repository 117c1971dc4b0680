"""The Ollama Modelfile written beside an exported GGUF: FROM the file, a Go TEMPLATE rendering the chat format of
model/tokenizer_config.json's chat template (system, tools, thinking, tool calls and responses), stop tokens and
sampling parameters.

Ollama's template sees .System, .Messages (.Role, .Content, .Thinking, .ToolCalls), .Tools and .Think, and has no
string functions: JSON inside <tools> and <tool_call> is Go's compact json.Marshal ({"a":1}), where our template's
tojson writes {"a": 1}; the JSON values are equal, the whitespace is not.
"""
import os

# text/template: `{{-`/`-}}` trim the whitespace beside an action; the range keeps the previous role for tool turns
TEMPLATE = """\
{{- $first := "" }}{{ if .Messages }}{{ $first = (index .Messages 0).Role }}{{ end }}
{{- if .Tools }}<|im_start|>system
{{ if eq $first "system" }}{{ (index .Messages 0).Content }}

{{ end }}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{{- range .Tools }}
{{ json . }}
{{- end }}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML \
tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{{ else if eq $first "system" }}<|im_start|>system
{{ (index .Messages 0).Content }}<|im_end|>
{{ end }}
{{- $previous := "" }}
{{- range $i, $m := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if or (eq .Role "user") (and (eq .Role "system") $i) }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
<think>
{{ .Thinking }}
</think>

{{ .Content }}
{{- range $j, $call := .ToolCalls }}{{ if or $m.Content $j }}
{{ end }}<tool_call>
{"name": "{{ .Function.Name }}", "arguments": {{ json .Function.Arguments }}}
</tool_call>
{{- end }}<|im_end|>
{{ else if eq .Role "tool" }}
{{- if ne $previous "tool" }}<|im_start|>user{{ end }}
<tool_response>
{{ .Content }}
</tool_response>
{{- if or $last (ne (index (slice $.Messages $i) 1).Role "tool") }}<|im_end|>
{{ end }}
{{- end }}
{{- $previous = .Role }}
{{- if and $last (ne .Role "assistant") }}<|im_start|>assistant
{{ if $.Think }}<think>
{{ else }}<think>

</think>

{{ end }}
{{- end }}
{{- end }}"""

STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


def modelfile(gguf_name, num_ctx, temperature=0.85, top_p=0.85):
    """The Modelfile text for a GGUF named `gguf_name` in the same folder (sampling: MiniMind's eval defaults)."""
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{TEMPLATE}"""']
    lines += [f'PARAMETER stop "{token}"' for token in STOP_TOKENS]
    lines += [f"PARAMETER temperature {temperature}", f"PARAMETER top_p {top_p}", f"PARAMETER num_ctx {num_ctx}"]
    return "\n".join(lines) + "\n"


def modelfile_target(folder):
    """The GGUF file the Modelfile in `folder` names (its FROM line, as modelfile writes it), or None."""
    path = os.path.join(folder, "Modelfile")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        first = f.readline().split()
    return first[1].removeprefix("./") if first[:1] == ["FROM"] and len(first) == 2 else None
