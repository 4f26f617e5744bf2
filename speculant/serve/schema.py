"""The OpenAI request bodies the server takes, and its errors in OpenAI's shape."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """Fields both endpoints share. `speculant` (the client's `extra_body={"speculant": {...}}`) picks a
    method and its options for this request, e.g. {"method": "sd", "k": 2}, within the server's models.
    A field the server does not implement (`tools`, `tool_choice`, ...) is refused by name,
    never dropped; `user` is accepted and ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    max_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=0, le=0, description="penalties would change the target's distribution")
    frequency_penalty: float = Field(0.0, ge=0, le=0, description="penalties would change the target's distribution")
    logit_bias: dict[str, float] | None = Field(None, description="{token id: -100..100} added to the target's logits")
    response_format: dict[str, Any] | None = Field(None, description="text, json_object, json_schema (OpenAI's), or "
                                                   "speculant's grammar (Lark) and regex")
    speculant: dict[str, Any] | None = None
    user: str | None = Field(None, description="accepted and ignored: the server keeps no per-user state")

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def alternatives(self) -> int | None:
        """None: no log-probabilities asked for; n: each token's, with its n likeliest alternatives."""
        return None


class CompletionRequest(Sampling):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=5, description="each token's log-probability and this many "
                                 "likeliest alternatives")
    echo: Literal[False] = False

    @property
    def alternatives(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = Field(None, description="accepted and ignored: chat templates have no place for it")

    def as_template(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = Field(False, description="each token's log-probability under the target")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="with logprobs: this many likeliest alternatives")
    max_completion_tokens: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _alternatives_need_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
