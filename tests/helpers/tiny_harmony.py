"""A tiny model that speaks harmony (gpt-oss's format) as far as the server can tell, and a scripted engine.

`make_harmony_model` saves a tiny random Llama whose tokenizer (SmolLM2's) has harmony's special tokens added
and whose chat template is TEMPLATE: our own few lines rendering what gpt-oss's does (a system message with the
reasoning effort, a developer message with the instructions and the functions, user turns, assistant turns'
thinking, tool calls and answers, tool results, the trailing `<|start|>assistant`).

`ScriptedEngine` stands at the engine boundary (a ReplicaSet's surface): the output it writes is SCRIPTS[the
last user message], tokenized by the real tokenizer and handed out 1-3 tokens a step, cut where the request's
stop_token_ids or max_tokens say (so what the server asks of the engine is what decides the answer); it keeps
each request's prompt text and params.
"""
from __future__ import annotations

import asyncio

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]

TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{%- set sys = messages[0].content if messages[0].role in ('system', 'developer') else '' %}"
    "{%- if sys or tools %}<|start|>developer<|message|>"
    "{%- if sys %}# Instructions\n\n{{ sys }}\n\n{% endif %}"
    "{%- if tools %}# Tools\n\nnamespace functions {\n"
    "{%- for t in tools %}\ntype {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;"
    "{%- endfor %}\n} // namespace functions{% endif %}<|end|>{% endif %}"
    "{%- set last = namespace(name='') %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' and m.tool_calls %}"
    "{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "{%- for c in m.tool_calls %}<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json"
    "<|message|>{{ c.function.arguments | tojson }}<|call|>{% set last.name = c.function.name %}{% endfor %}"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ last.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content | tojson }}<|end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}")

THINK = "<|channel|>analysis<|message|>"
SCRIPTS = {
    "hello": THINK + "The user greets me. Greet back.<|end|><|start|>assistant<|channel|>final<|message|>"
                     "Hello! How can I help?<|return|>",
    # a tool call, recipient after the channel, then what a model would go on to write if <|call|> did not stop it
    "weather": THINK + "They want Paris's weather: call get_weather.<|end|><|start|>assistant<|channel|>commentary "
                       'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
                       "<|start|>assistant<|channel|>final<|message|>not to be seen<|return|>",
    # a preamble (commentary to the user), then a call with the recipient before the channel
    "time": THINK + "Need the time.<|end|><|start|>assistant<|channel|>commentary<|message|>Let me look.<|end|>"
                    '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "cet"}'
                    "<|call|>",
    "json": THINK + "Answer in JSON.<|end|><|start|>assistant<|channel|>final<|message|>"
                    '{"answer": 42}<|return|>',
}


def harmony_tokenizer(base):
    """A copy of tokenizer `base` with harmony's special tokens and TEMPLATE."""
    import copy
    tok = copy.deepcopy(base)
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.chat_template = TEMPLATE
    return tok


def make_harmony_model(tmp_dir) -> str:
    """A tiny random Llama (tests/helpers/tiny_models.py) whose tokenizer speaks harmony; returns its folder."""
    from tests.helpers.tiny_models import make_tiny_model, smollm2_tokenizer
    tok = harmony_tokenizer(smollm2_tokenizer())
    path = make_tiny_model(tmp_dir, "llama", vocab_size=len(tok))
    tok.save_pretrained(path)
    return path


class ScriptedEngine:
    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.requests: list[tuple[str, dict]] = []       # (prompt text, params) of each request

    def refusal(self):
        return None

    async def submit(self, rid, ids, params, arrival):
        from tandem.replicas.engine_client import RequestStream
        st = RequestStream(rid, arrival, asyncio.get_running_loop().create_future())
        st.prompt, st.params = self.tok.decode(ids), params
        self.requests.append((st.prompt, params))
        return st

    def abort(self, rid: str) -> None:
        pass

    def script(self, prompt: str) -> str:
        last = prompt.rsplit("<|start|>user<|message|>", 1)[1].split("<|end|>", 1)[0]
        return SCRIPTS[last]

    async def outputs(self, st):
        from tandem.request import StepOutput
        ids = self.tok.encode(self.script(st.prompt), add_special_tokens=False)
        stops, limit = set(st.params["stop_token_ids"]), st.params["max_tokens"] or len(ids)
        end = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
        reason = "stop"
        if end > limit:
            end, reason = limit, "length"
        i = k = 0
        while i < end:
            new, i, k = ids[i:min(end, i + 1 + k % 3)], min(end, i + 1 + k % 3), k + 1
            await asyncio.sleep(0)
            yield StepOutput(st.rid, new, i >= end, reason if i >= end else None, num_output_tokens=i)
