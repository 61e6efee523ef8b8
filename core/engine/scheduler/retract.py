"""Retraction (preemption by recompute): whom to give back to the queue when decode runs dry."""

from __future__ import annotations


def pick_victims(running):
    """Candidates in retraction order: the least work lost first (fewest generated tokens;
    among those, the longest prompt, whose slots free the most)."""
    return sorted(running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))
