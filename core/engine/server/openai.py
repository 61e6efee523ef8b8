"""Request and response bodies, declared so that /openapi.json describes them exactly.

Unknown fields are kept (extra="allow") so that clients sending newer or vendor-specific fields
get a warning naming them, not a failure. Types are strict (no "5" for 5) and bounds are part of
the schema, so what /openapi.json allows and what the server accepts are the same set; anything
else is a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, model_validator

MAX_N = 128  # OpenAI's own limit on choices per request
MAX_TOP = 20  # top logprobs per token (engine.sampling.params.MAX_TOP_LOGPROBS)
I64 = 2**63
TokenId = Annotated[int, Field(ge=0, lt=I64)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(Body):
    include_usage: bool = False


class JsonSchemaFormat(Body):
    """OpenAI's response_format.json_schema: the schema and its name."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(min_length=1)
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


NonEmpty = Annotated[str, Field(min_length=1)]


class ConstraintFields(Body):
    """Structured output (at most one): SGLang's json_schema / regex / ebnf and vLLM's
    guided_* (engine.server.constraints turns them into one engine Constraint)."""

    json_schema: NonEmpty | dict[str, Any] | None = None
    regex: NonEmpty | None = None
    ebnf: NonEmpty | None = None
    guided_json: NonEmpty | dict[str, Any] | None = None
    guided_regex: NonEmpty | None = None
    guided_choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    guided_grammar: NonEmpty | None = None


class SamplingFields(ConstraintFields):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + SGLang/vLLM extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=I64)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-I64, lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, lt=I64)
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=0, lt=I64)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP)
    echo: bool = False


class TextPart(Body):
    type: Literal["text"] = "text"
    text: str


class FunctionCall(Body):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI: a JSON object's text


class MessageToolCall(Body):
    """A call an earlier assistant message made (sent back with the tools' results)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call it answers
    reasoning_content: str | None = None  # assistant (templates that show past reasoning)


class FunctionDefinition(Body):
    name: NonEmpty
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (None: no arguments)
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Body):
    name: NonEmpty


class NamedToolChoice(Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, lt=I64)
    max_completion_tokens: int | None = Field(None, ge=1, lt=I64)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP)
    add_generation_prompt: bool = True
    # variables for the chat template (only those it uses are passed); a template of the
    # request's own (here or as chat_template_kwargs.chat_template) needs the server's
    # --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    # tools (engine.server.tool_choice): offered to the template; called when the model writes
    # a call (auto: --tool-call-parser reads it) or the grammar makes it (required, a name)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # SGLang's: reasoning as reasoning_content (with --reasoning-parser), or left in content
    separate_reasoning: bool = True
    # SGLang's: stream the reasoning as it comes (False: one reasoning_content delta, sent when
    # the reasoning ends)
    stream_reasoning: bool = True


class GenerateSamplingParams(Body):
    """SGLang's sampling_params (engine.sampling.SamplingParams)."""

    max_new_tokens: int | None = Field(None, ge=0, lt=I64)
    min_new_tokens: int | None = Field(None, ge=0, lt=I64)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=I64)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-I64, lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    skip_special_tokens: bool | None = None
    json_schema: NonEmpty | None = None
    regex: NonEmpty | None = None
    ebnf: NonEmpty | None = None


class GenerateRequest(Body):
    """SGLang's /generate: ``text`` or ``input_ids`` (one prompt or a batch)."""

    model_config = ConfigDict(json_schema_extra={
        "oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]})

    # exactly one of the two is given (an explicit null is refused, as the schema says)
    text: str | Annotated[list[str], Field(min_length=1)] = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)] = None
    sampling_params: GenerateSamplingParams | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP)
    rid: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' and 'input_ids'")
        return self


# -- responses (documented in /openapi.json; tests validate real responses against them) -------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ResponseFunction(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    index: int | None = None


class GenerateOutput(RootModel[GenerateResponse | list[GenerateResponse]]):
    """One output for one prompt with n = 1, else a list (SGLang's shape)."""


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "engine"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
