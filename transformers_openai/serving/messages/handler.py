"""POST /v1/messages and /v1/messages/count_tokens: an Anthropic request becomes a chat request run (or rendered) by
the chat handler; its answer becomes a message, or the message's events."""

from __future__ import annotations

from transformers_openai.protocol import ChatCompletionResponse
from transformers_openai.protocol.messages import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from transformers_openai.serving.disconnect import WaitDisconnect
from transformers_openai.serving.messages.answer import message_of
from transformers_openai.serving.messages.convert import chat_request_of
from transformers_openai.serving.messages.stream import MessageStream
from transformers_openai.serving.text.chat import ChatHandler


class MessagesHandler:
    endpoint = "messages"  # its name in the metrics

    def __init__(self, chat: ChatHandler) -> None:
        self.chat = chat

    async def create(
        self, request: MessagesRequest, wait_disconnect: WaitDisconnect, request_id: str | None = None
    ) -> MessageResponse | MessageStream:
        chat_request = chat_request_of(request, self.chat.reasoning is not None)
        result = await self.chat.create(chat_request, wait_disconnect, request_id)
        if isinstance(result, ChatCompletionResponse):
            return message_of(result, request.model)
        return MessageStream(request.model, result)  # type: ignore[arg-type]

    async def count_tokens(self, request: CountTokensRequest) -> CountTokensResponse:
        """The prompt's length in tokens, as a message request with this conversation would count its input."""
        self.chat.ctx.check_model(request.model)
        prompts = await self.chat.prompts(chat_request_of(request, self.chat.reasoning is not None))
        return CountTokensResponse(input_tokens=len(prompts[0].token_ids))
