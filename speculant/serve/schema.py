"""The OpenAI request bodies the server takes, and its errors in OpenAI's shape."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from speculant.config import MIN_TEMPERATURE, SEEDS
from speculant.errors import ConfigError
from speculant.models.wrappers.constrained import SCHEMA_NAME, Constraint, strict_fault
from speculant.json_text import json_fault
from speculant.serve.tools import DECODER, call_schema

MAX_STOP = 4096  # characters of one stop string: its match tables are built where every request's forwards run

MAX_FORMAT_DEPTH = 32  # levels of nesting a response_format (a JSON schema) may have


MESSAGE_CHARS = 1000  # the longest error message answered


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        if len(message) > MESSAGE_CHARS:  # (a message may quote what the client sent)
            message = message[:MESSAGE_CHARS] + "..."
        message, param = (quoted(text) for text in (message, param))
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def quoted(text: str | None) -> str | None:
    """`text` as it can be answered in JSON: a lone surrogate the client sent (JSON's \\ud800) written as its escape."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def unicode(text: str) -> str:
    """A string that is valid Unicode (JSON's \\ud800 escapes can spell a lone surrogate, which no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode (a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(unicode)]


def texts(value: Any) -> list[str]:
    """Every string in a JSON value, object keys too: what a chat template may write into the prompt."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [text for key, item in value.items() for text in texts(key) + texts(item)]
    if isinstance(value, list):
        return [text for item in value for text in texts(item)]
    return []


def unicode_json(value: Any) -> Any:
    """A JSON value whose every string is valid Unicode (`unicode`): one a chat template writes into the prompt."""
    for text in texts(value):
        unicode(text)
    return value
Number = Annotated[float, Field(allow_inf_nan=False)]


def depth(value: Any) -> int:
    """How deeply a JSON value nests (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if level <= MAX_FORMAT_DEPTH:  # deeper is refused anyway
            children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
            stack.extend((child, level + 1) for child in children)
    return deepest


def body_fault(body: bytes) -> ApiError | None:
    """`json_fault` of a request body, as the 400 that names where."""
    if (fault := json_fault(body)) is None:
        return None
    where, why = fault
    return ApiError(400, f"{where or 'the body'}: {why}", param=where or None)


def given_with(name: str, other: str, message: str, present: bool = True) -> Any:
    """A validator of field `name` that refuses it given unless field `other` (declared before it) is given too, or,
    with `present` false, unless it is not: a field that does nothing alone, or that another replaces, is refused
    with `message`, never dropped."""

    def check(cls: type, value: Any, info: Any) -> Any:
        if value is not None and (info.data.get(other) not in (None, False)) != present:
            raise ValueError(message)
        return value

    return field_validator(name)(check)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False
    include_provenance: bool = Field(False, description="speculant's extension: after each step, a chunk with no "
                                     "choices whose `speculant` field gives the step's tokens, each an accepted "
                                     "draft, a correction or the target's own, and the drafter that drafted them")


class Sampling(BaseModel):
    """Fields both endpoints share. `speculant` (the client's `extra_body={"speculant": {...}}`) picks a
    method and its options for this request, e.g. {"method": "sd", "k": 2}, within the server's models.
    A field the server does not implement (`functions`, `audio`, ...) is refused by name,
    never dropped; `user` is accepted and ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Text
    max_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False,
                               description=f"0 (greedy), or from {MIN_TEMPERATURE} to 2 (OpenAI's range)")
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False,
                         description="taken at temperature 0 too, as OpenAI's API and its clients' defaults take it: "
                         "greedy decoding's token always lies in the nucleus, so there it changes nothing")
    seed: int | None = Field(None, ge=SEEDS.start, lt=SEEDS.stop,
                             description="a 64-bit seed: a sampled reply repeats under one seed for a named method and "
                             "its options; auto's (the default), dsi's and a tree's of auto sizes or depth predicted "
                             "may differ, as their choices follow measured times, and so may a reply drafted by "
                             "suffix, whose history grows with every reply (their distribution never differs)")
    stop: Text | list[Text] | None = Field(None, description=f"up to 4 non-empty strings of at most {MAX_STOP} "
                                           "characters")
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=0, le=0, description="penalties would change the target's distribution")
    frequency_penalty: float = Field(0.0, ge=0, le=0, description="penalties would change the target's distribution")
    logit_bias: dict[str, Number] | None = Field(None, description="{token id: -100..100} added to the target's "
                                                 "logits")
    response_format: dict[str, Any] | None = Field(None, description="text, json_object, json_schema (OpenAI's), or "
                                                   "speculant's grammar (Lark) and regex")
    speculant: dict[str, Any] | None = None
    user: Text | None = Field(None, description="accepted and ignored: the server keeps no per-user state")

    @model_validator(mode="before")
    @classmethod
    def _nulls_mean_defaults(cls, data: Any) -> Any:
        """OpenAI's API takes null for its optional fields (`"temperature": null`, as some clients send): the field's
        default. A field this server does not know is still refused by name, null or not."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None or key not in cls.model_fields}
        return data

    @field_validator("temperature")
    @classmethod
    def _not_tiny(cls, value: float) -> float:
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(stop == "" for stop in stops) or len(stops) > 4:
            raise ValueError("up to 4 stop strings, none empty")
        if too_long := next((stop for stop in stops if len(stop) > MAX_STOP), None):  # (its match tables are built
            raise ValueError(f"a stop string of {len(too_long)} characters: at most {MAX_STOP}")  # where forwards run)
        return value

    _with_stream = given_with("stream_options", "stream", "stream_options needs stream: true")

    @field_validator("response_format")
    @classmethod
    def _format_type(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and not isinstance(value.get("type"), str):
            raise ValueError("must name its type, e.g. {\"type\": \"json_object\"}")
        return value

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def alternatives(self) -> int | None:
        """None: no log-probabilities asked for; n: each token's, with its n likeliest alternatives."""
        return None


class CompletionRequest(Sampling):
    prompt: Text | list[int]
    logprobs: int | None = Field(None, ge=0, le=5, description="each token's log-probability and this many "
                                 "likeliest alternatives")
    echo: Literal[False] = False
    best_of: int = Field(1, ge=1, le=1, description="one completion drawn per request (OpenAI's default, n)")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        """OpenAI's prompt may also be a batch (a list of texts or of id lists): refused as such, not as a bad id."""
        if isinstance(value, list) and value and all(isinstance(item, (str, list)) for item in value):
            raise ValueError("one prompt per request: a text or a list of token ids, not a list of prompts")
        return value

    @property
    def alternatives(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]
    text: Text


FUNCTION_NAME = f"^{SCHEMA_NAME.pattern}$"  # (a function's name is a schema's)


def json_object_text(text: str) -> str:
    """A call's `arguments`: JSON text of an object, strict (no NaN or infinities: `tools.DECODER`), as a reply's, and
    read as written (`json_fault`: no key given twice, no number read as another)."""
    try:
        value = DECODER.decode(text)
    except (ValueError, RecursionError):
        value = None  # (no JSON, NaN or an infinity; or an integer too long to read, which `json_fault` names)
    if (fault := json_fault(text)) is not None:
        raise ValueError(f"must be JSON text of an object, read as written ({fault[0] or 'the text'}: {fault[1]})")
    if value is None:
        raise ValueError("must be JSON text of an object")
    if not isinstance(value, dict) or depth(value) > MAX_FORMAT_DEPTH:
        raise ValueError(f"must be JSON text of an object, at most {MAX_FORMAT_DEPTH} levels deep")
    unicode_json(value)  # (its escapes can spell a lone surrogate, which the template cannot write)
    return text


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    arguments: Annotated[Text, AfterValidator(json_object_text)]


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    id: Text
    type: Literal["function"]
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's calls, in a later turn")
    content: Text | list[TextPart] | None = Field(None, validate_default=True)  # (after tool_calls: `_parts` reads it)
    name: Text | None = Field(None, description="the participant's name, where the model's chat template writes it "
                              "(elsewhere refused: a name the model never reads is not dropped unsaid)")
    tool_call_id: Text | None = Field(None, description="a tool message: the call it answers")
    # null only: OpenAI's own replies carry them so, and a client replays its history as it got it
    refusal: None = Field(None, description="null only (a reply's refusal, replayed)")
    function_call: None = Field(None, description="null only (the deprecated call field, replayed)")
    audio: None = Field(None, description="null only (a reply's audio, replayed)")
    annotations: Annotated[list[Any], Field(max_length=0)] | None = Field(
        None, description="null or empty only (a reply's citations, replayed)")

    @field_validator("content")
    @classmethod
    def _parts(cls, content: str | list[TextPart] | None, info: ValidationInfo) -> str | list[TextPart] | None:
        if content == []:
            raise ValueError("a text or a list of at least one part, not an empty list (as OpenAI's)")
        if content is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("content is required (an assistant's may be null where it has tool_calls)")
        return content

    @model_validator(mode="after")
    def _roles(self) -> Message:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant's message has tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only a tool message, names its tool_call_id")
        return self


class Function(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: Text | None = None
    parameters: Annotated[dict[str, Any], AfterValidator(unicode_json)] | None = Field(
        None, description="a JSON schema of the arguments (an object)")
    strict: bool | None = Field(None, description="arguments always follow the schema when a call is constrained; "
                                "strict: its parameters must leave nothing out, as OpenAI's (`strict_fault`)")

    @model_validator(mode="after")
    def _strict(self) -> Function:
        if self.strict and depth(self.parameters or {}) <= MAX_FORMAT_DEPTH and \
                (fault := strict_fault(self.parameters or {}, "parameters")):  # (deeper: refused as too deep)
            raise ValueError(f"strict, and {fault}")
        return self


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    function: Function


def refused_parameters(tools: Sequence[Tool]) -> tuple[str, str] | None:
    """The first function's `parameters` that are not a JSON schema, not too deep, that some object matches and that
    compiles as a call's arguments (a call's arguments are constrained to it, and are an object whatever it says:
    `tools.call_schema`), as (its field, why); None where all are. Not a validator: a client's schemas may take
    seconds to compile, which the app spends off the event loop."""
    for i, tool in enumerate(tools):
        parameters, field = tool.function.parameters, f"tools.{i}.function.parameters"
        if parameters is None:
            continue
        if depth(parameters) > MAX_FORMAT_DEPTH:
            return field, f"must be an object's JSON schema, at most {MAX_FORMAT_DEPTH} levels deep"
        try:
            Constraint("json_schema", call_schema(tool.function.name, parameters))
        except ConfigError as error:
            return field, f"must be an object's JSON schema, one that compiles as a call's arguments ({error})"
    return None


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: Text


class NamedTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = Field(False, description="each token's log-probability under the target")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="with logprobs: this many likeliest alternatives")
    max_completion_tokens: int | None = Field(None, gt=0)
    tools: list[Tool] | None = Field(None, min_length=1, max_length=128, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = Field(
        None, description="none (the tools left out of the prompt), auto (the default with tools), required, or a "
        "named function")
    parallel_tool_calls: bool = Field(True, description="false: at most one call per reply")

    @field_validator("messages")
    @classmethod
    def _answers(cls, value: list[Message]) -> list[Message]:
        """A tool message answers a call an earlier assistant message made (OpenAI's rule): a template would write
        a result of nothing into the prompt."""
        called: set[str] = set()
        for i, message in enumerate(value):
            ids = [call.id for call in message.tool_calls or ()]
            if len(set(ids)) < len(ids):  # (which result answers which call?)
                raise ValueError(f"message {i} makes two tool calls of one id")
            called.update(ids)
            if message.role == "tool" and message.tool_call_id not in called:
                raise ValueError(f"message {i} answers tool call '{message.tool_call_id}', which no assistant message "
                                 "before it made")
        return value

    # (OpenAI's chat takes max_completion_tokens for max_tokens: given both, one would be dropped)
    _one_limit = given_with("max_completion_tokens", "max_tokens", "give max_completion_tokens or max_tokens, not both",
                            present=False)
    _alternatives_need_logprobs = given_with("top_logprobs", "logprobs", "top_logprobs needs logprobs: true")
    _parallel_needs_tools = given_with("parallel_tool_calls", "tools", "parallel_tool_calls needs tools (as OpenAI's)")

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [tool.function.name for tool in value or ()]
        if len(set(names)) < len(names):
            raise ValueError("function names must differ")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, value: Any, info: Any) -> Any:
        tools = info.data.get("tools")
        if value not in (None, "none") and not tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(value, NamedTool) and value.function.name not in [t.function.name for t in tools]:
            raise ValueError(f"names '{value.function.name}', which is not among the tools")
        return value

    @property
    def choice(self) -> Any:
        """tool_choice as data: "none" (no tools), "auto", "required" or {"function": {"name": ...}}."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedTool):
            return self.tool_choice.model_dump()
        return self.tool_choice or "auto"

    @property
    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
