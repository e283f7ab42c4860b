"""Who may call what: bearer tokens with roles, read from --auth-token-file, and the errors for calls refused.

The token file holds one `ROLE TOKEN` per line (ROLE `generate` or `admin`); blank lines and lines starting
with `#` are ignored. Nothing here knows gRPC: the transport's interceptor hands over the call's
`authorization` value and the role its RPC needs.

Tokens are kept only as SHA-256 digests, compared in constant time, and never logged or put in a message.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import re
from pathlib import Path

from loraswap.server.config import SettingsError
from loraswap.server.engine.errors import EngineError, ErrorReason

log = logging.getLogger(__name__)

# Long enough that guessing is hopeless, short enough for any random generator's output (32 hex digits is 16 bytes).
MIN_TOKEN_CHARS = 16
# Visible ASCII, which is what gRPC metadata values may carry unencoded.
_TOKEN_PATTERN = re.compile(r"[\x21-\x7e]+")
_BEARER_PREFIX = "bearer "


class Role(enum.Enum):
    """What a token lets its holder do: `generate` images and read state, or `admin` everything."""

    GENERATE = "generate"
    ADMIN = "admin"

    def permits(self, needed: Role) -> bool:
        """Whether a token of this role may call an RPC that needs `needed`."""
        return self is Role.ADMIN or needed is Role.GENERATE


class TokenMissingError(EngineError):
    """The server wants a bearer token and the call carries none."""

    reason = ErrorReason.TOKEN_MISSING


class TokenInvalidError(EngineError):
    """The call's bearer token is not in the token file, or is not written as `Bearer <token>`."""

    reason = ErrorReason.TOKEN_INVALID


class AdminRequiredError(EngineError):
    """The RPC needs an `admin` token and the call's token has role `generate`."""

    reason = ErrorReason.ADMIN_REQUIRED


def _digest(token: str) -> bytes:
    # Listed tokens are ASCII; a presented one holds whatever gRPC decoded (UTF-8, or Latin-1 where the bytes are
    # not UTF-8), and must digest, to match nothing, rather than raise.
    return hashlib.sha256(token.encode("utf-8", errors="surrogatepass")).digest()


def parse_token_file(text: str, source: str) -> dict[bytes, Role]:
    """The roles of the tokens in a token file's text, by token digest.

    Raises:
        SettingsError: a line is not `ROLE TOKEN`, a role is unknown, a token is too short, has characters
            metadata cannot carry or appears twice, or there are no tokens at all. The message names the
            line, never the token.
    """
    roles: dict[bytes, Role] = {}
    first_line: dict[bytes, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"{source} line {number}"
        parts = stripped.split()
        if len(parts) != 2:
            raise SettingsError(f"{where}: write `ROLE TOKEN` (ROLE generate or admin), one token per line")
        role_name, token = parts
        try:
            role = Role(role_name.lower())
        except ValueError:
            raise SettingsError(f"{where}: the role must be generate or admin") from None
        if not _TOKEN_PATTERN.fullmatch(token) or len(token) < MIN_TOKEN_CHARS:
            raise SettingsError(f"{where}: tokens must be at least {MIN_TOKEN_CHARS} visible ASCII characters")
        digest = _digest(token)
        if digest in roles:
            raise SettingsError(f"{where}: the same token is already on line {first_line[digest]}")
        roles[digest] = role
        first_line[digest] = number
    if not roles:
        raise SettingsError(f"{source} has no tokens; add `generate TOKEN` or `admin TOKEN` lines")
    return roles


def _read_token_file(path: Path) -> dict[bytes, Role]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise SettingsError(f"cannot read --auth-token-file {path}: {getattr(error, 'strerror', None) or error}")
    return parse_token_file(text, f"--auth-token-file {path}")


class AccessTokens:
    """The tokens of one token file and their roles; `reload` re-reads the file (on SIGHUP)."""

    def __init__(self, path: Path) -> None:
        """Reads `path` now.

        Raises:
            SettingsError: the file is unreadable or malformed (see `parse_token_file`).
        """
        self.path = path
        self._roles = _read_token_file(path)

    @property
    def token_count(self) -> int:
        return len(self._roles)

    def reload(self) -> None:
        """Re-reads the file; while it is unreadable or malformed the tokens read before stay in force.

        Raises:
            SettingsError: the new file is unusable (nothing changed).
        """
        self._roles = _read_token_file(self.path)

    def role_of(self, token: str) -> Role | None:
        """The token's role, or None when the file does not list it; in time independent of which token matched."""
        presented = _digest(token)
        found: Role | None = None
        # Every digest is compared, whatever matched, so timing tells nothing about the table.
        for digest, role in self._roles.items():
            if hmac.compare_digest(presented, digest):
                found = role
        return found

    def authorize(self, authorization: str | None, needed: Role) -> Role:
        """The role of the call whose `authorization` value is given, when it may call an RPC that needs `needed`.

        Raises:
            TokenMissingError: no authorization value.
            TokenInvalidError: the value is not `Bearer <token>` with a listed token.
            AdminRequiredError: the token's role does not permit `needed`.
        """
        if not authorization:
            raise TokenMissingError(
                "this server requires a bearer token: send `authorization: Bearer <token>` call metadata"
            )
        if authorization[: len(_BEARER_PREFIX)].lower() != _BEARER_PREFIX:
            raise TokenInvalidError("the authorization metadata must read `Bearer <token>`")
        role = self.role_of(authorization[len(_BEARER_PREFIX) :].strip())
        if role is None:
            raise TokenInvalidError("the bearer token is not one this server accepts; check the token")
        if not role.permits(needed):
            raise AdminRequiredError(f"this call needs a token of role admin; the token sent has role {role.value}")
        return role
