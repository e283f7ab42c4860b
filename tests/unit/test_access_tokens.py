"""The token file (`ROLE TOKEN` lines), its roles, and who may call what; no server needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraswap.server.access import (
    AccessTokens,
    AdminRequiredError,
    Role,
    TokenInvalidError,
    TokenMissingError,
    parse_token_file,
)
from loraswap.server.config import SettingsError
from loraswap.server.transport.token_auth import ROLE_FOR_RPC, role_needed
from loraswap.v1 import diffusion_service_pb2 as pb

GENERATE_TOKEN = "gen-0123456789abcdef"
ADMIN_TOKEN = "adm-0123456789abcdef"
TOKEN_FILE = f"""# loraswap tokens
generate {GENERATE_TOKEN}

  ADMIN   {ADMIN_TOKEN}
"""


@pytest.fixture
def tokens(tmp_path: Path) -> AccessTokens:
    path = tmp_path / "tokens"
    path.write_text(TOKEN_FILE)
    return AccessTokens(path)


def test_roles_of_listed_tokens(tokens: AccessTokens) -> None:
    assert tokens.token_count == 2
    assert tokens.role_of(GENERATE_TOKEN) is Role.GENERATE
    assert tokens.role_of(ADMIN_TOKEN) is Role.ADMIN
    assert tokens.role_of(GENERATE_TOKEN + "x") is None
    assert tokens.role_of("") is None


@pytest.mark.parametrize(
    ("authorization", "needed", "outcome"),
    [
        (f"Bearer {GENERATE_TOKEN}", Role.GENERATE, Role.GENERATE),
        (f"bearer {GENERATE_TOKEN}", Role.GENERATE, Role.GENERATE),
        (f"Bearer {ADMIN_TOKEN}", Role.GENERATE, Role.ADMIN),
        (f"Bearer {ADMIN_TOKEN}", Role.ADMIN, Role.ADMIN),
        (f"Bearer {GENERATE_TOKEN}", Role.ADMIN, AdminRequiredError),
        (None, Role.GENERATE, TokenMissingError),
        ("", Role.ADMIN, TokenMissingError),
        (f"Bearer {GENERATE_TOKEN}0", Role.GENERATE, TokenInvalidError),
        (GENERATE_TOKEN, Role.GENERATE, TokenInvalidError),
        (f"Basic {GENERATE_TOKEN}", Role.GENERATE, TokenInvalidError),
        ("Bearer ", Role.GENERATE, TokenInvalidError),
    ],
)
def test_authorize(tokens: AccessTokens, authorization: str | None, needed: Role, outcome) -> None:
    if isinstance(outcome, Role):
        assert tokens.authorize(authorization, needed) is outcome
        return
    with pytest.raises(outcome) as refused:
        tokens.authorize(authorization, needed)
    # A refusal never echoes what was sent.
    assert GENERATE_TOKEN not in refused.value.message and ADMIN_TOKEN not in refused.value.message
    assert not refused.value.metadata


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("", "has no tokens"),
        ("# only a comment\n\n", "has no tokens"),
        ("generate\n", "line 1: write `ROLE TOKEN`"),
        (f"generate {GENERATE_TOKEN} extra\n", "line 1: write `ROLE TOKEN`"),
        (f"# c\nowner {GENERATE_TOKEN}\n", "line 2: the role must be generate or admin"),
        ("generate short\n", "line 1: tokens must be at least 16"),
        ("generate tökén-0123456789abcdef\n", "line 1: tokens must be at least 16 visible ASCII"),
        (f"generate {GENERATE_TOKEN}\nadmin {GENERATE_TOKEN}\n", "line 2: the same token is already on line 1"),
    ],
)
def test_malformed_token_files_are_refused_by_line_without_the_token(text: str, complaint: str) -> None:
    with pytest.raises(SettingsError) as refused:
        parse_token_file(text, "tokens.txt")
    message = str(refused.value)
    assert complaint in message and "\n" not in message
    assert GENERATE_TOKEN not in message and "short" not in message


def test_unreadable_token_file_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read --auth-token-file"):
        AccessTokens(tmp_path / "missing")


def test_reload_reads_the_new_file_and_keeps_the_old_one_when_it_is_malformed(
    tokens: AccessTokens, tmp_path: Path
) -> None:
    new_token = "new-0123456789abcdef"
    tokens.path.write_text(f"admin {new_token}\n")
    tokens.reload()
    assert (tokens.role_of(new_token), tokens.role_of(ADMIN_TOKEN)) == (Role.ADMIN, None)

    tokens.path.write_text("admin\n")
    with pytest.raises(SettingsError):
        tokens.reload()
    assert tokens.role_of(new_token) is Role.ADMIN


def test_every_rpc_has_a_role_and_the_control_rpcs_need_admin() -> None:
    rpcs = set(pb.DESCRIPTOR.services_by_name["DiffusionService"].methods_by_name)
    assert set(ROLE_FOR_RPC) == rpcs
    assert {rpc for rpc, role in ROLE_FOR_RPC.items() if role is Role.ADMIN} == {"PreloadAdapter", "Evict"}


@pytest.mark.parametrize(
    ("method", "needed"),
    [
        ("/loraswap.v1.DiffusionService/Generate", Role.GENERATE),
        ("/loraswap.v1.DiffusionService/GetServerInfo", Role.GENERATE),
        ("/loraswap.v1.DiffusionService/Evict", Role.ADMIN),
        ("/loraswap.v1.DiffusionService/SomethingAddedLater", Role.ADMIN),
        ("/some.other.Service/Method", Role.ADMIN),
        ("/grpc.health.v1.Health/Check", None),
        ("/grpc.health.v1.Health/Watch", None),
        ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", None),
        ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", None),
    ],
)
def test_role_needed_by_method(method: str, needed: Role | None) -> None:
    assert role_needed(method) is needed
