"""URL adapter names: the grammar, and the identity that stands for a URL everywhere its query (a secret) must not."""

from __future__ import annotations

import pytest

from loraswap.adapter_urls import url_identity
from loraswap.client.aio import _lora_metadata
from loraswap.server.engine.adapters.sources import (
    UrlPolicy,
    check_host_rule,
    host_matches,
    loggable_name,
    parse_url_name,
    public_name,
)
from loraswap.server.engine.errors import AdapterNameError, UrlRefusedError

SECRET = "SECRETSIGNATURE"
S3 = "https://bucket.s3.us-east-1.amazonaws.com/loras/ink.safetensors"
IDENTITIES = [
    # presigned object-store links: every signing parameter goes, nothing is left of the query
    ((f"{S3}?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA%2F&X-Amz-Date=20261204T000000Z"
     f"&X-Amz-Expires=900&X-Amz-SignedHeaders=host&X-Amz-Security-Token=tok&X-Amz-Signature={SECRET}"), S3),
    (f"{S3}?AWSAccessKeyId=AKIA&Expires=1700000000&Signature={SECRET}", S3),
    (("https://storage.googleapis.com/b/ink.safetensors?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=c"
     f"&X-Goog-Date=d&X-Goog-Expires=900&X-Goog-SignedHeaders=host&X-Goog-Signature={SECRET}"),
     "https://storage.googleapis.com/b/ink.safetensors"),
    (f"https://acct.blob.core.windows.net/c/ink.safetensors?sv=2022-11-02&ss=b&srt=o&sp=r&se=2026-12-05&sig={SECRET}",
     "https://acct.blob.core.windows.net/c/ink.safetensors"),
    (f"https://d111.cloudfront.net/ink.safetensors?Expires=1&Signature={SECRET}&Key-Pair-Id=K",
     "https://d111.cloudfront.net/ink.safetensors"),
    # a model site: the token goes, what picks the file stays (as a digest)
    (f"https://civitai.com/api/download/models/123?type=Model&format=SafeTensor&token={SECRET}",
     "https://civitai.com/api/download/models/123?" + url_identity("https://x/?format=SafeTensor&type=Model")[-12:]),
    # case, default ports, IPv6, a pinned hash
    ("HTTPS://Example.COM:443/A.safetensors", "https://example.com/A.safetensors"),
    ("http://127.0.0.1:8080/a.safetensors", "http://127.0.0.1:8080/a.safetensors"),
    ("https://[::1]:8443/a", "https://[::1]:8443/a"),
    ("https://example.com/a#sha256=" + "AB" * 32, "https://example.com/a#sha256=" + "ab" * 32),
    ("https://example.com", "https://example.com/"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "identity"), IDENTITIES)
def test_a_urls_identity_leaves_its_secrets_out_and_is_its_own_identity(name: str, identity: str) -> None:
    parsed = parse_url_name(name)
    assert parsed.identity == identity == public_name(name) == url_identity(name)
    assert SECRET not in parsed.identity and SECRET not in repr(parsed)
    assert parse_url_name(identity).identity == identity  # ListAdapters' ids name the same adapter
    assert parsed.link == name.split("#")[0]


def test_links_signed_anew_are_one_identity_and_other_files_are_not() -> None:
    one = parse_url_name(f"{S3}?X-Amz-Signature=a&X-Amz-Date=1").identity
    assert one == parse_url_name(f"{S3}?X-Amz-Date=2&X-Amz-Signature=b").identity
    site = "https://civitai.com/api/download/models/123"
    safetensors = parse_url_name(f"{site}?format=SafeTensor&token=a").identity
    assert safetensors == parse_url_name(f"{site}?token=b&format=SafeTensor").identity
    assert safetensors != parse_url_name(f"{site}?format=PickleTensor&token=a").identity


REFUSED = [
    ("ftp://example.com/a", "URL_SCHEME_UNSUPPORTED"),
    ("file:///etc/passwd", "URL_SCHEME_UNSUPPORTED"),
    (f"https://user:{SECRET}@example.com/a", "URL_CREDENTIALS_IN_NAME"),
    ("https:///a", "INVALID_ADAPTER_NAME"),
    ("https://exa mple.com/a", "INVALID_ADAPTER_NAME"),
    ("https://example.com:99999/a", "INVALID_ADAPTER_NAME"),
    ("https://bad_host.com/a", "INVALID_ADAPTER_NAME"),
    (f"https://example.com/a?token={SECRET}#section", "INVALID_ADAPTER_NAME"),
    ("https://example.com/" + "a" * 9000, "INVALID_ADAPTER_NAME"),
    ("https://[::1/x", "INVALID_ADAPTER_NAME"),
    ("https://[1.2.3.4]/x", "INVALID_ADAPTER_NAME"),
    ("https://[v1.abc]/x", "INVALID_ADAPTER_NAME"),
    ("https://" + "a" * 64 + ".example.com/x", "INVALID_ADAPTER_NAME"),
    ("https://example.com/caf\u00e9.safetensors", "INVALID_ADAPTER_NAME"),
    ("https://example.com./x", "INVALID_ADAPTER_NAME"),
]


@pytest.mark.parametrize(("name", "reason"), REFUSED)
def test_a_malformed_url_is_refused_without_quoting_its_query(name: str, reason: str) -> None:
    with pytest.raises(AdapterNameError) as refused:
        parse_url_name(name)
    assert refused.value.reason == reason
    assert SECRET not in refused.value.message
    assert loggable_name(name) == "<invalid URL>"


HOSTS = [
    ("example.com", "example.com", True),
    ("example.com", "a.example.com", False),
    ("*.example.com", "a.example.com", True),
    ("*.example.com", "a.b.example.com", True),
    ("*.example.com", "example.com", False),
    ("*.example.com", "badexample.com", False),
    ("127.0.0.1", "127.0.0.1", True),
    ("[::1]", "::1", True),
]


@pytest.mark.parametrize(("rule", "host", "allowed"), HOSTS)
def test_host_rules_match_a_name_or_its_subdomains(rule: str, host: str, allowed: bool) -> None:
    assert host_matches(check_host_rule(rule), host) is allowed


def test_the_policy_refuses_before_any_connection() -> None:
    policy = UrlPolicy(allowed_hosts=("*.example.com",), insecure_hosts=("test.local",))
    assert policy.check(parse_url_name("https://a.example.com/x")) == "*.example.com"
    assert policy.check(parse_url_name("http://test.local/x")) == "test.local"
    for url, reason in [
        ("https://other.com/x", "URL_HOST_NOT_ALLOWED"),
        ("http://a.example.com/x", "URL_INSECURE_NOT_ALLOWED"),
    ]:
        with pytest.raises(UrlRefusedError) as refused:
            policy.check(parse_url_name(url))
        assert refused.value.reason == reason
    with pytest.raises(UrlRefusedError) as refused:
        UrlPolicy().check(parse_url_name("https://a.example.com/x"))
    assert "--allow-url-host" in refused.value.message


def test_a_client_routes_a_url_by_its_identity_never_its_query() -> None:
    url = f"{S3}?X-Amz-Signature={SECRET}"
    assert _lora_metadata([url, "outline"]) == (("lora", f"{S3},outline"),)


def test_a_comma_inside_a_urls_query_does_not_split_it() -> None:
    from loraswap.server.engine.adapters.sources import split_names

    # Once a URL's query is open, no later piece but another URL is a name: none is echoed as one.
    assert split_names(f"outline,https://h/x?ids=1,2,3&sig={SECRET},purple,https://b/y") == (
        "outline",
        f"https://h/x?ids=1,2,3&sig={SECRET},purple",
        "https://b/y",
    )
    # Identities (what clients send) end at their digest; a URL without a query at its path.
    assert split_names("https://h/p?0123456789ab,outline,https://b/y,purple") == (
        "https://h/p?0123456789ab",
        "outline",
        "https://b/y",
        "purple",
    )
    assert split_names("outline, ,purple") == ("outline", "purple")


def test_preload_and_evict_take_a_url_with_its_identity_as_the_lora_metadata() -> None:
    from loraswap.server.engine.errors import InvalidRequestError
    from loraswap.server.transport.convert import adapter_with_lora_metadata

    url = f"{S3}?X-Amz-Signature={SECRET}"
    assert adapter_with_lora_metadata(url, (S3,)) == url  # the field's full URL is the one that can be fetched
    assert adapter_with_lora_metadata("", (S3,)) == S3
    with pytest.raises(InvalidRequestError) as mismatch:
        adapter_with_lora_metadata(url, ("https://other.example.com/x",))
    assert mismatch.value.reason == "ADAPTER_MISMATCH" and SECRET not in mismatch.value.message
