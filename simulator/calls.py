"""The record of every RPC the simulated kubelet made or served, and Go-style error texts.

Tests assert on call order and arguments ("GetDevicePluginOptions ended before Register returned",
"exactly one ContainerAllocateRequest"), so each call keeps its request, its response or error,
and monotonic start/end times.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

__all__ = ["CallLog", "RpcCall", "describe_error", "message_dict"]

# Go's codes.Code.String() spellings, used in "rpc error: code = X desc = Y".
_GO_CODE_NAMES = {grpc.StatusCode.CANCELLED: "Canceled"}


@dataclass
class RpcCall:
    """One call. Its request and response are kept as the messages themselves and turned into dicts
    when first read: a kubelet keeps no such record, so converting (``MessageToDict`` is slow) must
    not sit inside a call's timed window or delay what the simulated kubelet serves."""

    method: str  # "Register", "Allocate", "List", ...
    resource: str  # resource name for device-plugin calls, "" for PodResources
    raw_request: Message | dict[str, Any]
    peer: str = ""  # the socket the call went to or came in on
    raw_response: Message | dict[str, Any] | None = None
    error: str | None = None
    start: float = field(default_factory=time.monotonic)
    end: float | None = None

    @property
    def request(self) -> dict[str, Any]:
        if isinstance(self.raw_request, Message):
            self.raw_request = message_dict(self.raw_request)
        return self.raw_request

    @property
    def response(self) -> dict[str, Any] | None:
        if isinstance(self.raw_response, Message):
            self.raw_response = message_dict(self.raw_response)
        return self.raw_response

    @response.setter
    def response(self, value: Message | dict[str, Any] | None) -> None:
        self.raw_response = value

    @property
    def ok(self) -> bool:
        return self.end is not None and self.error is None

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "resource": self.resource, "request": self.request, "peer": self.peer,
                "response": self.response, "error": self.error, "start": self.start, "end": self.end}


def message_dict(msg: Message) -> dict[str, Any]:
    """Proto field names (`devices_ids`, `ID`), defaults included, int64 as numbers."""
    return MessageToDict(
        msg,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )


def go_code_name(code: grpc.StatusCode) -> str:
    return _GO_CODE_NAMES.get(code) or "".join(part.capitalize() for part in code.name.split("_"))


def describe_error(err: BaseException) -> str:
    """The text a Go kubelet would show for this error (`rpc error: code = ... desc = ...`)."""
    if isinstance(err, grpc.aio.AioRpcError):
        return f"rpc error: code = {go_code_name(err.code())} desc = {err.details()}"
    if isinstance(err, TimeoutError) and not str(err):
        return "timed out"
    return str(err) or type(err).__name__


class CallLog:
    """Append-only list of `RpcCall`s shared by every part of the simulated kubelet."""

    def __init__(self) -> None:
        self.calls: list[RpcCall] = []

    def begin(self, method: str, resource: str, request: Message | dict[str, Any], peer: str = "") -> RpcCall:
        call = RpcCall(method=method, resource=resource, raw_request=request, peer=peer)
        self.calls.append(call)
        return call

    @contextmanager
    def record(
        self, method: str, resource: str, request: Message | dict[str, Any], peer: str = ""
    ) -> Iterator[RpcCall]:
        """Time one call; an exception escaping the block is stored as its error text."""
        call = self.begin(method, resource, request, peer)
        try:
            yield call
        except BaseException as err:
            if call.error is None:
                call.error = describe_error(err)
            raise
        finally:
            call.end = time.monotonic()
