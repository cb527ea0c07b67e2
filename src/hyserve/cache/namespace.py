"""Cache namespaces. A salt is `tenant:request_salt`: the tenant (an API key's hash, "" without keys)
owns every salt that starts with it, so admin actions can be scoped to one tenant's salts."""

from __future__ import annotations


def make_salt(tenant: str, request_salt: str | None) -> str:
    """The prefix-cache salt of a request: "" for a keyless request with no `cache_salt`."""
    return f"{tenant}:{request_salt or ''}" if (tenant or request_salt) else ""


def tenant_of(salt: str) -> str:
    return salt.partition(":")[0]
