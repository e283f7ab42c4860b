"""Fixtures the unit tests share."""

from __future__ import annotations

import socket

import huggingface_hub.constants
import pytest


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline mode plus a hard guard: any attempt to open a connection fails."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
