"""Chat templates written for the tests, each rendering tools the way one model family's does (no vendor's
template is copied: these are minimal ones in the same format), and the helpers the template tests share.

- ``HERMES_STYLE``: Qwen2.5/Hermes, ``<tool_call>`` blocks, results in ``<tool_response>`` tags;
- ``LLAMA3_STYLE``: Llama 3.1+, the tools and the call format in the first user turn, the system turn
  saying ``Environment: ipython``, a call as bare JSON with ``"parameters"``, one call per turn,
  results in the ``ipython`` role;
- ``MISTRAL_STYLE``: Mistral, ``[AVAILABLE_TOOLS]`` before the last user turn, calls as
  ``[TOOL_CALLS] [...]`` with 9-character ids (anything else is refused), results in ``[TOOL_RESULTS]``.
"""

from __future__ import annotations

import copy
from typing import Any

from cachegw.backend.core.sampling_params import StructuredOutput
from cachegw.backend.core.structured import GrammarCompiler
from cachegw.backend.entrypoints.tools import ToolRequest

HERMES_STYLE = """
{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are helpful.{% endif %}
Functions you may call, inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each call, answer with <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{% if not tools %}<|im_start|>system
{{ message.content }}<|im_end|>
{% endif %}
{%- elif message.role == 'assistant' -%}
<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""

LLAMA3_STYLE = """
{%- set ns = namespace(system='', first_user=true) -%}
{%- if messages[0].role == 'system' %}{% set ns.system = messages[0].content %}{% endif -%}
<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
{% endif %}{{ ns.system }}<|eot_id|>
{%- for message in messages if message.role != 'system' -%}
{%- if message.role == 'user' and ns.first_user and tools -%}
{%- set ns.first_user = false -%}
<|start_header_id|>user<|end_header_id|>

Call a function by answering {"name": function name, "parameters": its arguments}. Functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}
{{ message.content }}<|eot_id|>
{%- elif message.role == 'assistant' and message.tool_calls -%}
{%- if message.tool_calls | length != 1 %}{{ raise_exception('one call per turn') }}{% endif -%}
{%- set call = message.tool_calls[0].function -%}
<|start_header_id|>assistant<|end_header_id|>

{"name": "{{ call.name }}", "parameters": {{ call.arguments | tojson }}}<|eot_id|>
{%- elif message.role in ['tool', 'ipython'] -%}
<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else -%}
<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|start_header_id|>assistant<|end_header_id|>

{% endif -%}
"""

MISTRAL_STYLE = """
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
{%- if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif -%}
{%- endfor -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}
{%- if tools and loop.index0 == ns.last_user -%}
[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]
{%- endif -%}
[INST] {{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls -%}
[TOOL_CALLS] [
{%- for call in message.tool_calls -%}
{%- if call.id | length != 9 %}{{ raise_exception('Tool call ids must be 9 characters') }}{% endif -%}
{%- set fn = call.function -%}
{"name": "{{ fn.name }}", "arguments": {{ fn.arguments | tojson }}, "id": "{{ call.id }}"}
{%- if not loop.last %}, {% endif -%}
{%- endfor -%}
]</s>
{%- elif message.role == 'assistant' %} {{ message.content }}</s>
{%- elif message.role == 'tool' -%}
[TOOL_RESULTS] {"content": {{ message.content | tojson }}, "call_id": "{{ message.tool_call_id }}"}
{%- raw %}[/TOOL_RESULTS]{% endraw -%}
{%- endif -%}
{%- endfor -%}
"""


def with_template(tokenizer: Any, template: str, special: tuple[str, ...] = ()) -> Any:
    """A copy of ``tokenizer`` with ``template`` as its chat template (and ``special`` as special tokens)."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    if special:
        tok.add_special_tokens({"additional_special_tokens": list(special)})
    return tok


def accepts(
    compiler: GrammarCompiler, req: ToolRequest, ids: list[int], answer: StructuredOutput | None = None
) -> bool:
    """Whether the grammar of ``req`` lets the model write the tokens ``ids`` and stop there."""
    spec = req.grammar(answer)
    assert isinstance(spec, StructuredOutput)
    matcher = compiler.grammar(spec)._matcher
    if matcher.validate_tokens(ids) != len(ids):
        return False
    assert matcher.consume_tokens(ids)
    return bool(matcher.is_accepting())
