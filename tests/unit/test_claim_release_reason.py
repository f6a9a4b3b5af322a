"""The watchdog's rule for releasing a prepared DRA claim: only on positive evidence that nothing can
use it (its ResourceClaim gone or recreated, or reserved for no live pod)."""

from __future__ import annotations

from libs.dra import ClaimView
from libs.ledger.state import PreparedClaim
from services.watchdog.claims import CLAIM_GONE, NOT_RESERVED, release_reason

PREPARED = PreparedClaim(uid="c1", namespace="default", name="gpu", reserved_pods=("p1",))


def _claim(uid: str = "c1", pods: tuple[str, ...] = ("p1",)) -> ClaimView:
    return ClaimView(uid=uid, namespace="default", name="gpu", allocated=bool(pods), devices=(),
                     reserved_pods=pods, reserved_names=tuple(f"pod-{p}" for p in pods))


def test_a_claim_reserved_for_a_live_pod_is_kept() -> None:
    assert release_reason(PREPARED, _claim(), {"p1"}) is None


def test_a_claim_shared_with_another_live_pod_is_kept() -> None:
    assert release_reason(PREPARED, _claim(pods=("p1", "p2")), {"p2"}) is None


def test_a_gone_claim_is_released() -> None:
    assert release_reason(PREPARED, None, set()) == CLAIM_GONE


def test_a_recreated_claim_is_released_even_when_its_namesake_is_in_use() -> None:
    assert release_reason(PREPARED, _claim(uid="c2"), {"p1"}) == f"{CLAIM_GONE} (recreated as c2)"


def test_a_claim_reserved_for_no_live_pod_is_released() -> None:
    assert release_reason(PREPARED, _claim(), set()) == NOT_RESERVED
    assert release_reason(PREPARED, _claim(pods=()), set()) == NOT_RESERVED
