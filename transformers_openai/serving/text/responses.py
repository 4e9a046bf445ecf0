"""POST /v1/responses: a Responses request becomes a chat request run by the chat handler (the one path for
templating, sampling, tools and structured output); its answer becomes a response object or the Responses events."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import ValidationError

from transformers_openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    StreamOptions,
)
from transformers_openai.protocol.response_input import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ReasoningItem,
)
from transformers_openai.protocol.responses import (
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputReasoningText,
    OutputText,
    ResponseObject,
    ResponsesRequest,
)
from transformers_openai.protocol.text import ResponseFormat
from transformers_openai.protocol.tools import ChosenFunction, FunctionDefinition, NamedToolChoice, Tool, ToolChoice
from transformers_openai.serving.disconnect import WaitDisconnect
from transformers_openai.serving.errors import BadRequestError, NotFoundError
from transformers_openai.serving.text.chat import ChatHandler
from transformers_openai.serving.text.response_store import ResponseStore, StoredResponse
from transformers_openai.serving.text.response_stream import ResponseStream, reasoning_of, response_usage

# The chat request's fields as this endpoint names them, for the `param` of a 400.
_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


class ResponsesHandler:
    endpoint = "responses"  # its name in the metrics

    def __init__(self, chat: ChatHandler, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create(
        self,
        request: ResponsesRequest,
        wait_disconnect: WaitDisconnect,
        request_id: str | None = None,
        owner: str | None = None,
    ) -> ResponseObject | ResponseStream:
        """`owner`: the asking API key's `owner_of_key` (None on a server without keys); the response is stored as
        theirs, and `previous_response_id` finds only their responses."""
        history = self._history(request.previous_response_id, owner)
        new_messages = input_messages(request.input, history)
        chat_request = chat_request_of(request, [*instructions_messages(request), *history, *new_messages])
        skeleton = self._skeleton(request)
        try:
            result = await self.chat.create(chat_request, wait_disconnect, request_id)
        except BadRequestError as exc:
            exc.param = _PARAMS.get(exc.param or "", exc.param)
            raise
        conversation = (*history, *new_messages)
        if not isinstance(result, AsyncIterator):
            assert isinstance(result, ChatCompletionResponse)
            response = finished_response(skeleton, result)
            self._remember(request, response, conversation, owner)
            return response
        chunks: AsyncIterator[Any] = result  # chat's chunks
        return ResponseStream(skeleton, chunks, lambda done: self._remember(request, done, conversation, owner))

    def get(self, response_id: str, owner: str | None = None) -> ResponseObject:
        """A response `owner` stored; another key's is not found, as one that never existed."""
        entry = self.store.get(response_id, owner)
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    def delete(self, response_id: str, owner: str | None = None) -> None:
        if not self.store.delete(response_id, owner):
            raise _not_found(response_id)

    def _history(self, previous_response_id: str | None, owner: str | None) -> tuple[ChatMessage, ...]:
        if previous_response_id is None:
            return ()
        entry = self.store.get(previous_response_id, owner)
        if entry is None:
            raise BadRequestError(
                f"Previous response with id '{previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return entry.conversation

    def _skeleton(self, request: ResponsesRequest) -> ResponseObject:
        """The response before its output: an id and the request's settings, echoed."""
        return ResponseObject(
            id=f"resp_{uuid.uuid4().hex}",
            status="in_progress",
            model=request.model,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            metadata=request.metadata or {},
            parallel_tool_calls=request.parallel_tool_calls is not False,
            previous_response_id=request.previous_response_id,
            store=request.is_stored() and self.store.capacity > 0,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            text=request.text.model_dump(by_alias=True, exclude_none=True)
            if request.text
            else {"format": {"type": "text"}},
            tool_choice=_dumped(request.tool_choice) if request.tool_choice is not None else "auto",
            tools=[tool.model_dump(exclude_none=True) for tool in request.tools or []],
            user=request.user,
            reasoning=request.reasoning.model_dump(exclude_none=True) if request.reasoning else None,
        )

    def _remember(
        self,
        request: ResponsesRequest,
        response: ResponseObject,
        conversation: Sequence[ChatMessage],
        owner: str | None,
    ) -> None:
        if request.is_stored():
            self.store.put(StoredResponse(response, (*conversation, *output_messages(response.output)), owner))


def _dumped(choice: Any) -> Any:
    return choice if isinstance(choice, str) else choice.model_dump()


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")


# ---------------------------------------------------------------- the request as a chat request


def instructions_messages(request: ResponsesRequest) -> list[ChatMessage]:
    if request.instructions is None:
        return []
    return [ChatMessage(role="system", content=request.instructions)]


def input_messages(items: str | list[InputItem], history: Sequence[ChatMessage]) -> list[ChatMessage]:
    """The input as chat messages: a model's thought and calls join its assistant message, each output a tool
    message."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    names = {call.id: call.function.name for m in history for call in m.tool_calls or []}
    messages: list[dict[str, Any]] = []
    thought: ReasoningItem | None = None  # a thought whose answer has not come yet
    for item in items:
        if thought is not None and not isinstance(item, ReasoningItem) and not _answers(item):
            raise _lone_thought(thought)
        thought = item if isinstance(item, ReasoningItem) else None
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if isinstance(item, MessageItem):
            if item.role == "assistant" and last is not None and not last["content"] and not last.get("tool_calls"):
                last["content"] = item.chat_content()  # the answer after its thought
            else:
                messages.append({"role": item.role, "content": item.chat_content()})
        elif isinstance(item, ReasoningItem):
            if last is not None and not last["content"] and not last.get("tool_calls"):
                last["reasoning_content"] = last.get("reasoning_content", "") + item.text()
            else:
                messages.append({"role": "assistant", "content": "", "reasoning_content": item.text()})
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            call = {"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}}
            if last is not None:
                last["tool_calls"] = [*last.get("tool_calls", []), call]
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in names:
                raise BadRequestError(
                    f"No tool call found for function call output with call_id '{item.call_id}'.", param="input"
                )
            messages.append(
                {"role": "tool", "content": item.text(), "tool_call_id": item.call_id, "name": names[item.call_id]}
            )
    if thought is not None:
        raise _lone_thought(thought)
    return [_chat_message(message) for message in messages]


def _answers(item: InputItem) -> bool:
    return isinstance(item, FunctionCallItem) or (isinstance(item, MessageItem) and item.role == "assistant")


def _lone_thought(item: ReasoningItem) -> BadRequestError:
    """OpenAI's rule: a thought is given back with what the model answered after it."""
    return BadRequestError(
        f"Item '{item.id or 'reasoning'}' of type 'reasoning' was provided without its required following item "
        "(the assistant message or function call that came after it).",
        param="input",
    )


def _chat_message(message: dict[str, Any]) -> ChatMessage:
    try:
        return ChatMessage.model_validate(message)
    except ValidationError as exc:  # e.g. an image part the chat protocol refuses
        raise BadRequestError(_first_error(exc), param="input", code="invalid_value") from None


def _first_error(exc: ValidationError) -> str:
    return str(exc.errors()[0]["msg"]).removeprefix("Value error, ")


def _as_dict(message: ChatMessage) -> dict[str, Any]:
    return message.model_dump(exclude_none=True)


def output_messages(output: Sequence[OutputItem]) -> list[ChatMessage]:
    """A response's output as the assistant message it continues the conversation with."""
    text = "".join(part.text for item in output if isinstance(item, OutputMessage) for part in item.content)
    calls = [
        {"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}}
        for item in output
        if isinstance(item, OutputFunctionCall)
    ]
    thought = "".join(part.text for item in output if isinstance(item, OutputReasoning) for part in item.content)
    message: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": calls or None}
    if thought:
        message["reasoning_content"] = thought  # for the template, which drops it in later turns
    return [ChatMessage.model_validate(message)]


def chat_request_of(request: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    tools = [
        Tool(
            type="function",
            function=FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
            ),
        )
        for tool in request.tools or []
    ]
    response_format = _response_format(request)
    _one_constraint(response_format, request)
    choice: ToolChoice | None = None
    if isinstance(request.tool_choice, str):
        choice = request.tool_choice
    elif request.tool_choice is not None:
        choice = NamedToolChoice(type="function", function=ChosenFunction(name=request.tool_choice.name))
    try:
        fields: dict[str, Any] = {
            "model": request.model,
            "messages": messages,
            "max_completion_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "tools": tools or None,
            "tool_choice": choice,
            "parallel_tool_calls": request.parallel_tool_calls,
            "response_format": response_format,
            "structured_outputs": request.structured_outputs,
            "stream": bool(request.stream),
            "stream_options": StreamOptions(include_usage=True) if request.stream else None,
            "user": request.user,
        }
        if request.reasoning is not None and request.reasoning.effort is not None:
            fields["reasoning_effort"] = request.reasoning.effort
        # The priority as given: a Batch API line's is past what a client may send, so it is not validated again.
        return ChatCompletionRequest.model_validate(fields).model_copy(update={"priority": request.priority})
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else None
        raise BadRequestError(_first_error(exc), param=_PARAMS.get(field or "", field), code="invalid_value") from None


def _one_constraint(response_format: ResponseFormat | None, request: ResponsesRequest) -> None:
    """`text.format` and `structured_outputs` both constraining the answer: a 400 naming both (by this API's
    names; the chat handler refuses two constraints of `structured_outputs` itself)."""
    given = request.structured_outputs.constraints() if request.structured_outputs is not None else []
    if response_format is not None and given:
        message = (
            f"only one constraint on the answer can be given, but both 'text.format' and '{given[0].param}' were given"
        )
        raise BadRequestError(message, param=given[0].param, code="conflicting_constraints")


def _response_format(request: ResponsesRequest) -> ResponseFormat | None:
    form = request.text.format if request.text else None
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return ResponseFormat(type="json_object")
    schema = {"name": form.name, "schema": form.schema_, "description": form.description, "strict": form.strict}
    return ResponseFormat.model_validate({"type": "json_schema", "json_schema": schema})


# ---------------------------------------------------------------- the chat answer as a response


def finished_response(skeleton: ResponseObject, completion: ChatCompletionResponse) -> ResponseObject:
    choice = completion.choices[0]
    cut = choice.finish_reason == "length"
    status: ItemStatus = "incomplete" if cut else "completed"
    output: list[OutputItem] = []
    thought = reasoning_of(choice.message)
    if thought:
        content = [OutputReasoningText(text=thought)]
        output.append(OutputReasoning(id=f"rs_{uuid.uuid4().hex}", content=content, status=status))
    calls = choice.message.tool_calls or []
    if choice.message.content or not calls:
        text = OutputText(text=choice.message.content or "")
        output.append(OutputMessage(id=f"msg_{uuid.uuid4().hex}", status=status, content=[text]))
    for call in calls:
        function = call.function
        item = OutputFunctionCall(
            id=f"fc_{uuid.uuid4().hex}",
            call_id=call.id,
            name=function.name,
            arguments=function.arguments,
            status=status,
        )
        output.append(item)
    return skeleton.concluded(output, cut, response_usage(completion.usage))
