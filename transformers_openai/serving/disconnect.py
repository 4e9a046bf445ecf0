"""Waits for a response while watching the client: a client that leaves cancels the work (and its engine rows)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
WaitDisconnect = Callable[[], Awaitable[None]]


class ClientDisconnected(Exception):
    """The client went away before a non-streaming response was ready."""


async def until_disconnect(work: Awaitable[T], wait_disconnect: WaitDisconnect, request_id: str) -> T:
    """The result of `work`, or `ClientDisconnected` once the client is gone (`work` is cancelled first)."""
    task = asyncio.ensure_future(work)
    disconnected = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnected.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            logger.warning("request %s: client disconnected before the response; aborted", request_id)
            raise ClientDisconnected(request_id)
    return task.result()
