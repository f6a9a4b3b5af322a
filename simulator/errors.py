"""Kubernetes `Status` errors of the simulated API server."""

from __future__ import annotations

from typing import Any

__all__ = ["ApiError", "status_body"]


def status_body(
    code: int, reason: str, message: str, details: dict[str, Any] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = details
    return body


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        return status_body(self.code, self.reason, self.message, self.details)

    @classmethod
    def not_found(cls, kind: str, name: str) -> ApiError:
        return cls(404, "NotFound", f'{kind} "{name}" not found', {"name": name, "kind": kind})

    @classmethod
    def already_exists(cls, kind: str, name: str) -> ApiError:
        return cls(409, "AlreadyExists", f'{kind} "{name}" already exists', {"name": name, "kind": kind})

    @classmethod
    def conflict(cls, kind: str, name: str) -> ApiError:
        return cls(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on {kind} "{name}": the object has been modified; '
            "please apply your changes to the latest version and try again",
            {"name": name, "kind": kind},
        )

    @classmethod
    def bad_request(cls, message: str) -> ApiError:
        return cls(400, "BadRequest", message)

    @classmethod
    def invalid(cls, kind: str, name: str, message: str) -> ApiError:
        return cls(422, "Invalid", f'{kind[:-1].capitalize()} "{name}" is invalid: {message}',
                   {"name": name, "kind": kind})

    @classmethod
    def expired(cls, message: str) -> ApiError:
        return cls(410, "Expired", message)

    @classmethod
    def unsupported_media(cls, content_type: str) -> ApiError:
        return cls(
            415,
            "UnsupportedMediaType",
            "the body of the request was in an unknown format - accepted media types include: "
            "application/json-patch+json, application/merge-patch+json, "
            f"application/strategic-merge-patch+json, application/apply-patch+yaml (got {content_type!r})",
        )
