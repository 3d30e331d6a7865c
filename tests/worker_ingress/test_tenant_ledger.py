"""The per-tenant ledger (worker_ingress/_tenant_ledger.py): bounded labels, nothing lost."""

from __future__ import annotations

import pytest

from worker_ingress._tenant_ledger import OTHER_TENANT, TenantLedger


def test_tenants_beyond_the_limit_share_other_in_order_of_first_appearance() -> None:
    ledger = TenantLedger(limit=2)
    for name in ("b", "a", "c", "b", "d"):
        ledger.account(name).admitted += 1
    assert [(label, account.admitted) for label, account in ledger.items()] == [
        ("b", 2),
        ("a", 1),
        (OTHER_TENANT, 2),
    ]


def test_a_tenant_named_other_is_summed_with_the_overflow() -> None:
    ledger = TenantLedger(limit=1)
    ledger.account(OTHER_TENANT).rejected += 3
    ledger.account("late").rejected += 1
    assert [(label, account.rejected) for label, account in ledger.items()] == [
        (OTHER_TENANT, 4)
    ]


def test_limit_zero_counts_everyone_as_other() -> None:
    ledger = TenantLedger(limit=0)
    ledger.account("x").service_tokens += 5
    assert [(label, a.service_tokens) for label, a in ledger.items()] == [(OTHER_TENANT, 5)]
    with pytest.raises(ValueError, match="limit"):
        TenantLedger(limit=-1)
