"""What each tenant got from the gate, for metrics: requests by outcome and tokens of service.

A pure, bounded table. Rules:

1. At most ``limit`` tenants are kept by name, in order of first appearance; every later tenant
   is counted under the one shared account ``other`` (so the label set of the per-tenant metric
   families never grows past ``limit + 1``, whatever clients send).
2. Accounts are never forgotten (they are counters: a series that vanished would read as a
   reset), which is what makes the bound necessary.
3. The gate bumps the fields directly; the table only hands out accounts (one dict lookup).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

__all__ = ["OTHER_TENANT", "TenantAccount", "TenantLedger"]

#: The label of the account shared by tenants beyond the limit.
OTHER_TENANT: Final = "other"


class TenantAccount:
    """One tenant's counters (or the shared ``other`` account's).

    Attributes:
        admitted: Requests that started in the engine.
        rejected: Requests turned away (queue full, displaced, timed out, SLO, draining).
        cancelled: Requests withdrawn while queued.
        service_tokens: Service attained, unweighted, by the one rule of
            :func:`~worker_ingress._fair_queue.service_tokens`.
    """

    __slots__ = ("admitted", "cancelled", "rejected", "service_tokens")

    def __init__(self) -> None:
        self.admitted = 0
        self.rejected = 0
        self.cancelled = 0
        self.service_tokens = 0


class TenantLedger:
    """Accounts by tenant name, at most ``limit`` by name plus ``other``.

    Args:
        limit: Tenants kept by name (>= 0).
    """

    __slots__ = ("_accounts", "_other", "limit")

    def __init__(self, limit: int = 50) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit: Final = limit
        self._accounts: dict[str, TenantAccount] = {}
        self._other = TenantAccount()

    def account(self, tenant: str) -> TenantAccount:
        """The account of ``tenant`` (created on first appearance while under the limit)."""
        account = self._accounts.get(tenant)
        if account is None:
            if len(self._accounts) >= self.limit:
                return self._other
            account = self._accounts[tenant] = TenantAccount()
        return account

    def items(self) -> Iterator[tuple[str, TenantAccount]]:
        """``(label, account)`` in order of first appearance, then ``other``.

        A tenant literally named ``other`` shares its label with the overflow account; both are
        reported, summed, so the label set stays unique.
        """
        other = self._other
        named = self._accounts.get(OTHER_TENANT)
        for name, account in self._accounts.items():
            if name != OTHER_TENANT:
                yield name, account
        if named is None:
            yield OTHER_TENANT, other
            return
        both = TenantAccount()
        for field in TenantAccount.__slots__:
            setattr(both, field, getattr(named, field) + getattr(other, field))
        yield OTHER_TENANT, both
