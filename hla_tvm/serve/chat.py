"""Chat messages to a prompt: a Jinja2 chat template rendered as transformers renders a Hugging
Face `chat_template` (a sandboxed environment; variables `messages`, `add_generation_prompt`,
`bos_token`, `eos_token`, and `raise_exception(message)`), and the request's fields to a
completion's.

    template = ChatTemplate(source)           # None: DEFAULT
    text = template.render(messages)          # messages: [{"role", "content"}], as dicts

DEFAULT, for models without a template of their own (byte-level models), writes each message
as "<role>: <content>" on its own line and ends with "assistant:" for the answer."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

DEFAULT = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
           "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


class TemplateError(ValueError):
    """A template that does not compile or render (its message says where)."""


class ChatTemplate:
    def __init__(self, source=None, *, bos_token="", eos_token=""):
        # jinja2 (the serve extra) is imported where a template is made: the package imports
        # without it
        from jinja2 import TemplateError as JinjaError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = DEFAULT if source is None else source
        self.tokens = {"bos_token": bos_token, "eos_token": eos_token}

        def raise_exception(message):
            raise TemplateError(message)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(self.source)
        except JinjaError as err:
            raise TemplateError(f"the chat template does not compile: {err}") from None
        self._errors = JinjaError

    def render(self, messages, add_generation_prompt=True):
        try:
            return self.template.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.tokens)
        except TemplateError:
            raise
        except (self._errors, TypeError, ValueError, KeyError) as err:
            raise TemplateError(f"the chat template failed on these messages: {err}") from None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, list[TextPart]]
    name: Optional[StrictStr] = None

    def text(self):
        return self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content)


class ChatRequest(BaseModel):
    """The body of POST /v1/chat/completions (OpenAI's fields this server implements; tools,
    images and structured output are refused)."""
    model_config = ConfigDict(extra="forbid")
    model: Optional[StrictStr] = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    temperature: Union[StrictInt, StrictFloat] = 1.0
    top_p: Union[StrictInt, StrictFloat] = 1.0
    top_k: StrictInt = 0
    seed: Optional[StrictInt] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stream: StrictBool = False
    stream_options: Optional[dict] = None
    n: StrictInt = 1
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = None
    user: Optional[StrictStr] = None
    presence_penalty: Union[StrictInt, StrictFloat] = 0
    frequency_penalty: Union[StrictInt, StrictFloat] = 0
    repetition_penalty: Union[StrictInt, StrictFloat] = 1.0
    logit_bias: Optional[dict[StrictStr, Union[StrictInt, StrictFloat]]] = None
    min_tokens: StrictInt = 0


UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format",
               "audio", "modalities", "parallel_tool_calls")


def completion_fields(data, template):
    """The /v1/completions body (a dict) that the chat request `data` (a dict) asks for: its
    messages rendered by `template` as the prompt. ValueError naming the field for what this
    server does not do (tools, images, structured output)."""
    for key in UNSUPPORTED:
        if data.get(key) is not None:
            raise ValueError(f"{key}: this server does not support {key} (the model writes "
                             "text only)")
    req = ChatRequest.model_validate(data)
    if req.top_logprobs is not None and not req.logprobs:
        raise ValueError("top_logprobs: give it with logprobs: true")
    out = {key: getattr(req, key) for key in (
        "model", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
        "n", "user", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logit_bias", "min_tokens")}
    out["stream_options"] = req.stream_options
    out["prompt"] = template.render([{"role": m.role, "content": m.text()}
                                     for m in req.messages])
    out["max_tokens"] = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    out["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    return out
