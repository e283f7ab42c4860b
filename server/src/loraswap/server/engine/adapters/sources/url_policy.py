"""Which URLs the server may fetch adapters from, which addresses it may connect to, and which token each host gets.

Everything here is decided before a connection is made, from the operator's flags alone:

- `--allow-url-host HOST` (repeatable): https:// to HOST; `*.example.com` allows every subdomain of example.com
  (not example.com itself). No host allowed: no URL is fetched.
- `--allow-insecure-url-host HOST`: plain http:// to HOST as well (a test server); https:// to it is allowed too.
- A host *name* is resolved before connecting, and the connection goes to the address that was checked (no second
  lookup a rebinding DNS server could answer differently). Addresses that are not global (loopback, private,
  link-local such as a cloud's metadata endpoint, ...) are refused unless `--allow-url-private-addresses`. A host
  given as an IP address in the allow list is the operator's explicit choice and is connected to as named.
- `--url-token-file FILE`: lines `HOST TOKEN` (or `HOST env:VARIABLE`, the token read from the environment);
  the token goes as `Authorization: Bearer` to that host only, never to a host a redirect leads to.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

from loraswap.server.engine.adapters.sources.url_names import UrlName
from loraswap.server.engine.errors import (
    ErrorReason,
    UrlFetchError,
    UrlRefusedError,
    UrlUnavailableError,
    shorten,
)

TOKEN_FROM_ENVIRONMENT = "env:"


def host_matches(rule: str, host: str) -> bool:
    """Whether `host` (lower case) is allowed by `rule`: the same name, or under it for a `*.` rule."""
    rule = rule.lower().strip("[]")
    if rule.startswith("*."):
        return host.endswith(rule[1:]) and len(host) > len(rule) - 1
    return host == rule


def check_host_rule(rule: str) -> str:
    """A --allow-url-host / --allow-insecure-url-host value, lower case; ValueError for one that cannot match."""
    text = rule.strip().lower()
    bare = text.removeprefix("*.")
    if not bare or "/" in bare or ":" in bare.strip("[]") and not _is_ip(bare.strip("[]")) or "*" in bare:
        raise ValueError(
            f"URL host {rule!r} is not a host name, '*.'-prefixed domain or IP address (no scheme, port or path)"
        )
    return text


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def read_token_file(path: Path, environ=os.environ) -> dict[str, str]:
    """host rule -> bearer token, from `HOST TOKEN` / `HOST env:VARIABLE` lines ('#' starts a comment).

    Raises ValueError with a line number (never the token) for a line that is not one of those."""
    tokens: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith("#"):  # comments are whole lines: a token may hold '#'
            continue
        parts = text.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{number}: expected `HOST TOKEN` or `HOST env:VARIABLE`")
        try:
            host = check_host_rule(parts[0])
        except ValueError:  # never quoted: a line written TOKEN HOST would put the token in the message
            raise ValueError(f"{path}:{number}: the first field is not a host name, *.domain or IP address") from None
        token = parts[1]
        if token.startswith(TOKEN_FROM_ENVIRONMENT):
            variable = token.removeprefix(TOKEN_FROM_ENVIRONMENT)
            if not environ.get(variable):
                raise ValueError(f"{path}:{number}: the environment variable {variable} for {host} is not set")
            token = environ[variable]
        if not all("\x21" <= character <= "\x7e" for character in token):
            raise ValueError(f"{path}:{number}: the token for {host} holds spaces or characters outside ASCII")
        tokens[host] = token
    return tokens


def _resolve(host: str, port: int, timeout_s: float) -> list:
    """getaddrinfo within `timeout_s` (TimeoutError past it): the lookup runs on a daemon thread of its own, which
    a resolver that never answers leaves behind without holding up the download's thread or the process's exit."""
    outcome: dict = {}

    def lookup() -> None:
        try:
            outcome["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as error:
            outcome["error"] = error
        except Exception:  # noqa: BLE001 - whatever else the resolver raises: no address
            outcome["error"] = socket.gaierror(socket.EAI_FAIL, "the lookup failed")

    thread = threading.Thread(target=lookup, name="loraswap-dns", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(host)
    error = outcome.get("error")
    if isinstance(error, UnicodeError):
        raise socket.gaierror(socket.EAI_NONAME, "not a valid host name")
    if error is not None:
        raise error
    return outcome["infos"]


class UrlTokens:
    """The bearer tokens of --url-token-file, by host rule; `reload` re-reads the file (on SIGHUP)."""

    def __init__(self, path: Path | None = None, tokens: dict[str, str] | None = None) -> None:
        self.path = path
        self._tokens = dict(tokens or {}) if path is None else read_token_file(path)

    def __repr__(self) -> str:
        return f"UrlTokens({len(self._tokens)} hosts)"  # never the tokens

    def reload(self) -> None:
        """Read the file again; ValueError or OSError (and the tokens read before stay) for one it cannot use."""
        if self.path is not None:
            self._tokens = read_token_file(self.path)

    def items(self):
        return list(self._tokens.items())


@dataclass(frozen=True)
class UrlPolicy:
    """The hosts, addresses and tokens of URL adapters."""

    allowed_hosts: tuple[str, ...] = ()
    insecure_hosts: tuple[str, ...] = ()
    allow_private_addresses: bool = False
    tokens: UrlTokens = field(default_factory=UrlTokens)

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_hosts or self.insecure_hosts)

    def host_label(self, host: str) -> str | None:
        """The rule that allows `host` over https (the metrics' bounded `host` label), or None."""
        for rule in self.insecure_hosts + self.allowed_hosts:
            if host_matches(rule, host):
                return rule
        return None

    def check(self, url: UrlName, *, redirected_from: str | None = None) -> str:
        """The host label for a URL this server may fetch; UrlRefusedError (nothing sent) for any other."""
        via = f" (a redirect from {redirected_from})" if redirected_from else ""
        where = f"{url.origin}{via}"
        reason = ErrorReason.URL_REDIRECT_REFUSED if redirected_from else None
        if not self.enabled:
            raise UrlRefusedError(
                f"this server fetches no adapter URLs ({where}); its operator allows hosts with --allow-url-host, "
                "or name an adapter under its adapter directory",
                reason=reason or ErrorReason.URL_HOST_NOT_ALLOWED,
                host=url.host,
            )
        if url.scheme == "http" and not any(host_matches(rule, url.host) for rule in self.insecure_hosts):
            raise UrlRefusedError(
                f"plain http:// to {where} is refused; serve the adapter over https:// (only hosts named by "
                "--allow-insecure-url-host, test servers, are fetched over plain HTTP)",
                reason=reason or ErrorReason.URL_INSECURE_NOT_ALLOWED,
                host=url.host,
            )
        label = self.host_label(url.host)
        if label is None:
            raise UrlRefusedError(
                f"{where} is not a host this server fetches adapters from ({len(self.allowed_hosts)} allowed by "
                "--allow-url-host); use a URL on an allowed host, or ask the operator to allow this one",
                reason=reason or ErrorReason.URL_HOST_NOT_ALLOWED,
                host=url.host,
            )
        return label

    def token_for(self, host: str) -> str | None:
        """The token of the most specific rule matching `host`: its own name first, then the longest `*.` domain."""
        rules = self.tokens.items()  # a copy: a reload on another thread swaps the whole mapping
        for rule, token in sorted(rules, key=lambda item: (item[0].startswith("*."), -len(item[0]))):
            if host_matches(rule, host):
                return token
        return None

    def addresses_for(self, url: UrlName, timeout_s: float) -> list[str]:
        """The IP addresses to connect to for `url`'s host, checked, in the resolver's order, looked up within
        `timeout_s`; errors name the host, never the query."""
        if _is_ip(url.host):
            return [url.host]  # allowed as named: an IP in the allow list is the operator's choice
        try:
            infos = _resolve(url.host, url.port, timeout_s)
        except TimeoutError:
            raise UrlUnavailableError(
                f"the DNS lookup of {url.host} took longer than {timeout_s:g} s (--url-timeout-seconds); retry later",
                reason=ErrorReason.URL_DNS_FAILED,
                host=url.host,
            ) from None
        except socket.gaierror as error:
            retryable = error.errno in (socket.EAI_AGAIN,)
            error_class = UrlUnavailableError if retryable else UrlFetchError
            raise error_class(
                f"the adapter URL's host {url.host} does not resolve ({error.strerror or 'DNS failure'}); check the "
                "host name" + (", or retry: the DNS server did not answer" if retryable else ""),
                reason=ErrorReason.URL_DNS_FAILED,
                host=url.host,
            ) from None
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        if not self.allow_private_addresses:
            private = [address for address in addresses if not ipaddress.ip_address(address).is_global]
            if private:
                raise UrlRefusedError(
                    f"{url.host} resolves to {shorten(', '.join(private), 80)}, not a public address (loopback, "
                    "private or link-local); the server connects there only with --allow-url-private-addresses",
                    reason=ErrorReason.URL_ADDRESS_NOT_ALLOWED,
                    host=url.host,
                )
        return addresses
