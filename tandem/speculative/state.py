"""What the speculative branch records: per request (SpecState, as Req.spec) and engine-wide (SpecStats).

Plain records, so that the request and the stats can hold them without importing the branch's rules
(tandem/speculative/speculation.py and tandem/scheduler/speculative.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .ngram import NgramIndex

PROBE_EVERY = 16          # a request whose drafts do not pay drafts one token again after this many steps,
                          # doubling after each probe that accepted nothing (speculation.py: MAX_PROBE_GAP)


@dataclass
class SpecState:
    """One request's speculative state (Req.spec)."""
    # EMAs of accepted drafts and of draft trials per verified run (their ratio estimates a draft's acceptance;
    # the prior 0.6), and decode steps since it last drafted.
    acc: float = 0.6
    trials: float = 1.0
    skipped: int = 0
    probe_gap: int = PROBE_EVERY           # steps without drafts before a probe draft (doubles while probes fail)
    probing: bool = False                  # its current draft is a probe
    # The overlap loop's assumption (scheduler/speculative.py): one entry per output token its launched but
    # unprocessed steps sample (len == num_launched - len(output_ids)), the token assumed there (a draft, or the
    # n-gram's continuation after the last draft), -1 where nothing is assumed. fill_ids() + guess is the text a
    # step picked now continues, if every in-flight run is accepted whole.
    guess: list[int] = field(default_factory=list)
    ngram: NgramIndex | None = None        # its n-gram index (speculative/ngram.py), built at its first proposal
    hold: float = 1.0                      # EMA of its drafting runs that held what a pick ahead assumes
    stale: bool = False                    # its FutureMap row holds a dropped step's token: the next head row
                                           # takes its last token from the host


@dataclass
class SpecStats:
    """Engine-wide counts of the speculative branch (Scheduler.stats reports them)."""
    draft_tokens: int = 0                  # drafts verified
    accepted_tokens: int = 0               # of those, accepted
    accepted_hist: dict[int, int] = field(default_factory=dict)    # verified runs by their accepted drafts
    ahead_drafts: int = 0                  # drafting picks made while the request's previous step was in flight
    ahead_dropped: int = 0                 # picks ahead whose assumption failed (their rows dropped)
    syncs: int = 0                         # picks that first waited for host truth (not assumable)

    def as_stats(self) -> dict:
        return {
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_ahead_drafts": self.ahead_drafts,
            "spec_ahead_dropped": self.ahead_dropped,
            "spec_syncs": self.syncs,
            # verified runs that accepted a drafts, one flat key per a (replicas' stats are summed key by key)
            **{f"spec_accepted_len_{a}": n for a, n in sorted(self.accepted_hist.items())},
        }
