"""Tool calling: `tools`, `tool_choice`, `parallel_tool_calls` on /v1/chat/completions.

Prompt: the tools go to the chat template as its `tools` variable when the template uses one;
otherwise a default system block (DEFAULT_TOOL_BLOCK, below) lists them as JSON and asks for
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; it is prepended to the first system
message (or becomes one).

tool_choice:
- "none": tools are neither shown nor parsed; plain text.
- "auto" (default with tools): free generation, then the gateway's `tool_call_parser` looks for
  calls in the text: "hermes" (`<tool_call>{json}</tool_call>`, any number) or "json" (the whole
  answer is one {"name", "arguments"} object or a list of them). No call found: a plain answer.
- "required" / {"type": "function", "function": {"name"}}: the output is forced by a JSON-schema
  grammar to a list [{"name": <tool>, "arguments": <its parameters>}, ...] (one item for a named
  choice or parallel_tool_calls=false; anyOf the tools for "required"), so the arguments always
  validate against the function's `parameters`.

Responses carry `message.tool_calls` ([{id, type: "function", function: {name, arguments}}],
arguments as a JSON string), content null, and finish_reason "tool_calls". Streams send, per
call, a delta with index, id, type and the name (arguments ""), then the arguments in pieces.
"""

from __future__ import annotations

import json
import re
import uuid

from splitserve.platform.sampling.constraints import StructuredSpec
from splitserve.router.core.prepared import ToolPlan
from splitserve.router.errors import bad_request

PARSERS = ("hermes", "json")
ARGUMENT_PIECE = 16  # characters of arguments per streamed delta
DEFAULT_TOOL_BLOCK = (
    "You may call functions. Available functions (JSON schema of their parameters):\n{tools}\n"
    'To call one, answer only with <tool_call>{{"name": <function name>, "arguments": <arguments object>}}'
    "</tool_call> (one block per call)."
)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def plan_tools(req, parser: str) -> tuple[ToolPlan | None, StructuredSpec | None]:
    """Validate tools/tool_choice; (plan, forcing constraint or None). No tools or "none": (None, None)."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    functions = _functions(tools)
    if choice == "none":
        return None, None
    if not functions:
        raise bad_request(f"tool_choice={choice!r} needs tools", "tool_choice")
    if choice == "auto":
        return ToolPlan(False, parser, tuple(functions)), None
    if choice == "required":
        chosen = list(functions)
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not in tools; allowed: {', '.join(functions)}",
                "tool_choice",
            )
        chosen = [name]
    else:
        raise bad_request(
            f"tool_choice={choice!r} is invalid; allowed: none, auto, required, or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": n}, "arguments": functions[n]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for n in chosen
    ]
    single = isinstance(choice, dict) or req.parallel_tool_calls is False
    schema = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
    if single:
        schema["maxItems"] = 1
    return ToolPlan(True, parser, tuple(functions)), StructuredSpec("json", json.dumps(schema), "tools")


def _functions(tools: list) -> dict[str, dict]:
    """name -> parameters schema, validated."""
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not fn["name"]
        ):
            raise bad_request(
                f'tools[{i}] must be {{"type": "function", "function": {{"name", "description", "parameters"}}}}}}',
                "tools",
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if fn["name"] in functions:
            raise bad_request(f"tools: the function name {fn['name']!r} appears twice", "tools")
        functions[fn["name"]] = params
    return functions


def render_messages(messages: list[dict], tools: list, template: str | None) -> tuple[list[dict], dict]:
    """(messages, template kwargs) with the tools shown to the model (see the module docstring)."""
    if template and "tools" in template:
        return messages, {"tools": tools}
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    block = DEFAULT_TOOL_BLOCK.format(tools=listing)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": block + "\n\n" + messages[0]["content"]}, *messages[1:]], {}
    return [{"role": "system", "content": block}, *messages], {}


def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(content, [{"name", "arguments": JSON text}]) from a finished answer."""
    if plan.forced:
        return None, _calls(json.loads(text), plan)
    if plan.parser == "hermes":
        found = _HERMES.findall(text)
        calls = []
        for body in found:
            try:
                calls += _calls(json.loads(body), plan)
            except ValueError:
                return text, []
        content = _HERMES.sub("", text).strip() or None
        return (content, calls) if calls else (text, [])
    try:
        calls = _calls(json.loads(text), plan)
    except ValueError:
        return text, []
    return (None, calls) if calls else (text, [])


def _calls(value, plan: ToolPlan) -> list[dict]:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not (
            isinstance(item, dict) and item.get("name") in plan.names and isinstance(item.get("arguments"), (dict, str))
        ):
            if plan.forced:
                raise ValueError(f"not a tool call: {item!r}")
            return []
        args = item["arguments"]
        calls.append(
            {"name": item["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}
        )
    return calls


def openai_tool_calls(calls: list[dict]) -> list[dict]:
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c["name"], "arguments": c["arguments"]},
        }
        for c in calls
    ]


def stream_deltas(tool_calls: list[dict]) -> list[dict]:
    """The `delta` objects OpenAI streams for these calls: name first, then arguments in pieces."""
    deltas = []
    for index, call in enumerate(tool_calls):
        deltas.append(
            {
                "tool_calls": [
                    {
                        "index": index,
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["function"]["name"], "arguments": ""},
                    }
                ]
            }
        )
        args = call["function"]["arguments"]
        for start in range(0, len(args), ARGUMENT_PIECE):
            piece = args[start : start + ARGUMENT_PIECE]
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    return deltas
