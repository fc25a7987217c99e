"""Static vs dynamic scheduling policy (DESIGN.md §6; seed 001 Algorithm 2 lines 06-08).

- ``static``: the sorted item list is dealt over P persistent CTAs in snake order
  (:func:`flamia_pack.scheduler.worklist.static_assignment`).
- ``dynamic``: persistent CTAs take the next item of the sorted list from a global atomic counter
  (our Hopper stand-in for Blackwell Cluster Launch Control).

Rule (the paper's, empirical): causal -> dynamic; non-causal -> dynamic iff
``max_len >= 4 * mean_len``, else static.
"""
from __future__ import annotations

import numpy as np

from flamia_pack.errors import FlamiaError
from flamia_pack.scheduler.cost import lengths_from

__all__ = ["POLICIES", "SKEW_THRESHOLD", "choose_policy", "policy_for_call", "policy_name_for_call", "slower_choice_note"]

POLICIES = ("static", "dynamic")
SKEW_THRESHOLD = 4.0
"""Non-causal calls use the dynamic policy when max_len >= SKEW_THRESHOLD * mean_len."""


def choose_policy(seqlens, causal: bool, override: str | None = None) -> tuple[str, str]:
    """Pick ``"static"`` or ``"dynamic"`` for a row and say why.

    Args:
        seqlens: document lengths (1-D ints; list / numpy / torch).
        causal: causal attention.
        override: ``"static"``, ``"dynamic"``, or None / ``"auto"`` to apply the rule.

    Returns:
        ``(policy, reason)`` with a one-line human-readable reason.

    Raises:
        FlamiaError: unknown override; ``seqlens`` not 1-D integer lengths >= 0 (``cost.lengths_from``).
    """
    if override not in (None, "auto") and override not in POLICIES:
        raise FlamiaError(f"policy must be one of 'auto', 'static', 'dynamic', got {override!r}")
    lens = lengths_from(seqlens).astype(np.float64)
    if override in POLICIES:
        return override, f"{override} requested explicitly (rule not applied)"
    return _rule(causal, float(lens.max()) if lens.size else 0.0, float(lens.mean()) if lens.size else None)


def _ratio(mx, mean):
    """max_len / mean_len, the rule's skew (inf for a zero mean); works on symbolic ints too."""
    return mx / mean if mean > 0 else float("inf")


def _rule(causal: bool, mx: float, mean: float | None) -> tuple[str, str]:
    """The rule and its reason; ``mean`` None: no documents."""
    if causal:
        return "dynamic", "causal call: item costs grow along each document, so dynamic acquisition balances the tail"
    if mean is None:
        return "static", "no documents"
    ratio = _ratio(mx, mean)
    if ratio >= SKEW_THRESHOLD:
        return "dynamic", f"non-causal, skewed: max_len {mx:.0f} >= {SKEW_THRESHOLD:g} x mean_len {mean:.1f} (ratio {ratio:.2f})"
    return "static", f"non-causal, balanced: max_len {mx:.0f} < {SKEW_THRESHOLD:g} x mean_len {mean:.1f} (ratio {ratio:.2f})"


def policy_name_for_call(causal: bool, max_seqlen, total_tokens, n_docs) -> str:
    """:func:`policy_for_call`'s policy alone, without checks or a reason string: safe while
    ``torch.compile`` traces (the ints may be symbolic). Same float arithmetic as the rule."""
    if causal:
        return "dynamic"
    if n_docs == 0 or total_tokens == 0:
        return "static"
    return "dynamic" if _ratio(max_seqlen, total_tokens / n_docs) >= SKEW_THRESHOLD else "static"


def policy_for_call(causal: bool, max_seqlen: int, total_tokens: int, n_docs: int) -> tuple[str, str]:
    """:func:`choose_policy`'s rule from the host ints an attention call already has (no device sync).

    ``mean_len = total_tokens / n_docs``: exact when ``cu_seqlens[-1] == total_tokens`` (the packed
    row has no row-end padding), an over-estimate otherwise (padding counts as tokens), which can only
    move a borderline call from dynamic to static. ``max_seqlen`` is the call's bound on the longest
    document (varlen_attention's argument). Used by the kernels' ``schedule="policy"``.

    Args:
        causal: causal attention.
        max_seqlen: int >= 0, the longest document's length (or a bound on it).
        total_tokens: int >= 0, tokens of the packed row (T).
        n_docs: int >= 0, documents in the row (``cu_seqlens.numel() - 1``).

    Returns:
        ``(policy, reason)`` as :func:`choose_policy`.

    Raises:
        FlamiaError: a negative or non-integer argument.
    """
    for name, x in (("max_seqlen", max_seqlen), ("total_tokens", total_tokens), ("n_docs", n_docs)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0:
            raise FlamiaError(f"{name} must be an int >= 0, got {x!r}")
    return _rule(causal, float(max_seqlen), total_tokens / n_docs if n_docs and total_tokens else None)


def slower_choice_note(rule: str, chosen_ms: float, static_ms: float, dynamic_ms: float,
                       other_suffix: str = "") -> str | None:
    """A note when the rule's schedule is predicted slower than the other one, else None.

    The rule is kept (it needs no simulation, and the kernels' ``schedule="policy"`` applies it per
    call); the note only makes the disagreement visible, e.g. ``"rule: non-causal, balanced -> static;
    the simulator predicts dynamic 0.2% faster"``.

    Args:
        rule: the text before ``;`` (what the rule picked and why).
        chosen_ms, static_ms, dynamic_ms: predicted ms of the chosen schedule and of each one.
        other_suffix: appended to the faster schedule's name (e.g. ``" on every row"``).
    """
    other, best = ("static", static_ms) if static_ms < dynamic_ms else ("dynamic", dynamic_ms)
    if not best < chosen_ms * (1 - 1e-9):  # equal up to float rounding: no disagreement to show
        return None
    pct = 100.0 * (chosen_ms - best) / chosen_ms
    return f"{rule}; the simulator predicts {other}{other_suffix} {pct:.1f}% faster" if pct >= 0.1 else \
        f"{rule}; the simulator predicts {other}{other_suffix} {pct:.2g}% faster"
