"""``spec``: exact speculative decoding with the MTP head on the exact runtime.

Each round: the policy picks a depth d. d = 0 is a plain exact step; a probe (the policy's test
of the head after a run of plain steps) is a plain step beside which the head drafts one token,
counted as accepted when the step emits it: no window, so a head that cannot pay costs only the
draft. Otherwise the drafter
catches its head up on the rows since the last round and chains d drafts; the runtime verifies
[y, d_1..d_d] in one bit-exact window; the longest agreeing prefix plus the model's own next
token is kept; the runtime rolls back to the state captured at the last kept row. Every emitted
token is the argmax of logits bit-identical to the serial control's, whatever the drafts were.

Under a sampler (``decode(..., sampler=...)``) every emitted token is instead the sampler's pick
from those logits at the token's absolute position, row by row (decoders/sampled.py), and a draft
is kept iff it equals the pick at its row. The head drafts with the same noise (coupled). A
window's rows are picked in order and the picking stops at the first rejected draft: a pick costs
the GPU 0.2-0.9 ms on a 248k vocabulary, far more than the host wait each row's read adds, and
the rows past a rejection are never needed. Greedy decoding runs the greedy code, unchanged.

Policy (depth) and mechanism (runtime, drafter) are separate objects; decoder arguments:
  max_depth      largest draft depth (window = depth + 1 rows), 0..15; default 6, or ``depth`` where
                 that is deeper
  depth          fix the depth instead of adapting (benchmarks), 0..15; at most ``max_depth`` where
                 that is given
  stop           how a drafting round's depth is set: ``depth`` (default), the policy's depth for
                 the round, chosen before drafting; ``confidence``, drafts chained while the head's
                 calibrated confidence in them says one more is worth its price (decoders/policy.py),
                 each draft's confidence read as it is made (a wait for the device per draft)
  shortlist      JSON file of draft token ids (decoders/shortlist.py builds one); default: the
                 checkpoint's draft_shortlist.json when there is one, else the full vocabulary
  explore_every  the most rounds at depth 0 between probes while probes are cheap (the first run
                 is 8 and doubles after each probe; a probe priced above 1% of the plain rounds
                 before it waits longer), default 64
  head           a directory written by `heads train` (mtp.safetensors, draft_shortlist.json):
                 draft with that head, and its shortlist unless ``shortlist`` is given; the
                 backbone and the model's own head are untouched
  online_costs   price depths by round times measured during the decode (policy.RoundTimes),
                 the start-up costs as their prior; false: by the start-up costs alone. Default true
  coupled        under a sampler, draft with the target's noise (default true); false: the head's
                 plain argmax
  lazy_rows      under a sampler, true: pick a window's rows one by one up to the first rejection;
                 false: pick every row in one call (core.sampling.pick_rows_from_keys, the same
                 tokens), then read them all at once. Default auto: false where the runtime replays
                 CUDA graphs (one call costs 1.4 lone picks on the H200 for a window of 5), true
                 where it runs eagerly (on the CPU one call is slower than row by row)
  capacity       positions the runtime and the head's cache are first built for, default 4096; at
                 least what the start-up cost measurement uses (``calibration_positions``, 80); a
                 longer request rebuilds them larger

A decode's policy starts from the head's depth-1 acceptance as the last decode under the same
sampler setting left it (the built-in prior, 0.3, before any): a head that predicts nothing pays
for its two opening windows once per decoder, not once per request (then only for priced probes),
and a good head drafts deep from the first round.

Round times are host wall time from one read of emitted tokens to the next (the syncs the loop
makes anyway; no extra device sync). A drafting round right after plain steps is not timed: its
catch-up covers every row since the last draft, a cost of resuming drafting, not of a round. A
probe round (its draft and the step beside it) is timed whole, as the probe's price. Plain steps
run in batches of up to PLAIN_RUN between the policy's choices (never past a due probe), timed
together.
"""
from __future__ import annotations

import gc
import hashlib
import time
from pathlib import Path

import torch

from core.errors import UserError
from core.sampling import GREEDY, Sampler, pick_rows_from_keys
from decoders.base import DecodeResult, DecodeStats, stop_index
from decoders.drafter import (HEAD_FILE, LONG_CHUNKS, PREFILL_ROWS, MTPDrafter, catch_up_sizes, load_head,
                              load_shortlist, shortlist_source)
from decoders.policy import Calibration, Costs, DepthPolicy
from decoders.runtime.runtime import ExactRuntime
from decoders.runtime.sizing import DEFAULT_CAPACITY, capacity_for
from decoders.sampled import TargetPicks, settings
from decoders.stepping import TokenReader, steps_read_ahead
from decoders.trace import Trace, TraceRow
from decoders.trace import load as load_trace


class PhaseTimer:
    """Time per decode phase: CUDA events on the GPU (read once at the end), host clock on CPU.
    ``with timer.phase("verify"): ...`` times one phase; phases do not nest. Phases: ``step``
    (plain steps, probes' steps included), ``draft``, ``verify`` (the windows), ``rollback``,
    ``other`` (the prefill)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = []  # (phase, start event, end event)
        self.totals: dict[str, float] = {}
        self._name = ""
        self._start = None

    def phase(self, name: str) -> "PhaseTimer":
        self._name = name
        return self

    def __enter__(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.marks.append((self._name, self._start, end))
        else:
            self.totals[self._name] = self.totals.get(self._name, 0.0) + time.perf_counter() - self._start

    def add(self, name: str, seconds: float) -> None:
        """Seconds of a phase timed elsewhere (a plain step, by the host clock between two syncs)."""
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    def result(self) -> dict[str, float]:
        if self.marks:
            # the last phase (the final rollback) may still be queued on a busy GPU; the events were
            # recorded on one stream, so once the last has run every earlier one has
            self.marks[-1][2].synchronize()
        for name, a, b in self.marks:
            self.totals[name] = self.totals.get(name, 0.0) + a.elapsed_time(b) / 1e3
        self.marks.clear()
        return dict(self.totals)


def accepted_prefix(pred: list[int], drafted: list[int]) -> int:
    """How many leading drafts the verify window accepts: drafted[i] is kept while it equals the
    model's own token pred[i] at that row (pred has one row more than drafted)."""
    j = 0
    while j < len(drafted) and pred[j] == drafted[j]:
        j += 1
    return j


STOPS = ("depth", "confidence")  # how a drafting round's depth is set (the ``stop`` argument)
DEFAULT_MAX_DEPTH = 6
MAX_DEPTH = 15  # the deepest draft the arguments allow (a window of 16 rows)

# measure_costs' prompt length and timed rounds (calibration_positions sizes the state for them)
COST_PROMPT, COST_REPS = 16, 7

# the most plain steps decoded between two of the policy's choices: at most this many rounds pass
# before a change of the plain step's measured time can turn drafting on
PLAIN_RUN = 16


class Pending:
    """Between rounds, the head rows not yet computed with true inputs: positions [first, length)
    of the runtime's kept rows (``StaticState.row_hidden``, ``row_next``), i.e. each position's
    final hidden state and the token after it. A kept window's rows are written by its program; a
    plain step's hidden row waits in the runtime's ring and its token in ``steps`` (read on the
    host anyway), both moved in by ``take``: a plain step adds no copy to the loop. ``y`` [1,1] is
    the token after the last committed position: the last emitted token, the next backbone input.
    It is a view the loop sets after each round (the step's own argmax or pick buffer after a
    plain step: no slicing on the host per step), valid until the next forward, which reads it
    first."""

    def __init__(self, runtime: ExactRuntime):
        self.runtime = runtime
        end = runtime.length
        self.first = end - 1  # the prompt's last position: its rows come with the prefill
        self.y = runtime.state.row_next[:, end - 1:end]
        # the tokens after the last len(steps) positions, each a plain step's (row_next's, once taken)
        self.steps: list[int] = []
        # (hidden [1,P,H], prompt ids): the head's prompt rows, made by the decode's first draft
        self.prompt: tuple[torch.Tensor, list[int]] | None = None

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending rows ([1,m,H], [1,m]), handed to the head: none are left after."""
        rt, a, b = self.runtime, self.first, self.runtime.length
        st = rt.state
        rt.flush_rows()
        if self.steps:
            st.row_next[0, b - len(self.steps):b].copy_(torch.tensor(self.steps))
            self.steps = []
        self.first = b
        return st.row_hidden[:, a:b], st.row_next[:, a:b]


class SpecDecoder:
    name = "spec"
    sampling = True

    def __init__(self, max_depth: int | None = None, depth: int | None = None, shortlist: str | None = None,
                 explore_every: int = 64, capacity: int = DEFAULT_CAPACITY, head: str | None = None,
                 online_costs: bool = True, coupled: bool = True, lazy_rows: bool | str | None = "auto",
                 stop: str = "depth"):
        self.fixed = None if depth is None else int(depth)
        if self.fixed is not None and not 0 <= self.fixed <= MAX_DEPTH:
            raise ValueError(f"depth must be within 0..{MAX_DEPTH} (0: plain steps only), not {self.fixed}")
        if max_depth is None:  # not given: the default, or the fixed depth where that is deeper
            self.max_depth = max(DEFAULT_MAX_DEPTH, self.fixed or 0)
        else:
            self.max_depth = int(max_depth)
            if not 0 <= self.max_depth <= MAX_DEPTH:
                raise ValueError(f"max_depth must be within 0..{MAX_DEPTH}, not {self.max_depth}")
            if self.fixed is not None and self.fixed > self.max_depth:
                raise ValueError(f"depth {self.fixed} exceeds max_depth {self.max_depth}: give a depth within "
                                 f"0..{self.max_depth}, or leave max_depth out (depth then sets it)")
        if stop not in STOPS:
            raise ValueError(f"stop must be one of {', '.join(STOPS)}, not {stop!r}")
        if stop == "confidence" and self.fixed is not None:
            raise ValueError("stop=confidence sets each round's depth; it cannot be combined with depth=")
        self.stop = stop
        self.shortlist_path = shortlist
        self.head_dir = head
        self.head = None
        self.explore_every = int(explore_every)
        if self.explore_every < 1:
            raise ValueError("explore_every must be >= 1")
        if isinstance(capacity, bool) or int(capacity) < 1:
            raise ValueError(f"capacity must be >= 1 (positions the runtime is sized for), not {capacity}")
        self.capacity = int(capacity)
        if not isinstance(online_costs, bool):
            raise ValueError("online_costs must be true or false")
        self.online_costs = online_costs
        if not isinstance(coupled, bool):
            raise ValueError("coupled must be true or false")
        if not isinstance(lazy_rows, bool) and lazy_rows not in ("auto", None):
            raise ValueError("lazy_rows must be true, false or auto")
        # auto (or none) is settled by the runtime prepare() builds: whether it replays CUDA graphs
        self.coupled, self.lazy_rows_arg = coupled, lazy_rows
        self.lazy_rows = lazy_rows if isinstance(lazy_rows, bool) else True
        # per sampler setting, the head's depth-1 acceptance as the last decode that drafted left
        # it: the next decode's prior (a property of the head, not of any request's tokens)
        self.carried_accept: dict[tuple, float] = {}
        # sampler settings -> (pick, coupled draft, {w: a window's rows in one call}) seconds
        self._sampled_costs: dict[tuple, tuple[float, float, dict]] = {}
        self.model = self.runtime = self.drafter = self.costs = None
        self.picks: TargetPicks | None = None  # the sampled path's picks, made with the runtime
        self.cost_reps: dict | None = None  # every timed rep of measure_costs, in seconds

    # ------------------------------------------------------------------ setup

    def prepare(self, model) -> None:
        model.require_mtp(self.name)
        self.model = model
        if self.head_dir is not None:
            self.head = load_head(model, self.head_dir)
        # a smaller capacity would not hold measure_costs' prompt, steps, windows and catch-ups
        self._build(max(self.capacity, self.calibration_positions()))
        if not isinstance(self.lazy_rows_arg, bool):
            self.lazy_rows = not self.runtime.use_graphs
        self.cost_reps = self.measure_costs()
        self.costs = Costs.from_reps(self.cost_reps)
        self.carried_accept = {}

    @property
    def margin(self) -> int:
        """Positions a decode needs beyond its prompt and new tokens: the last round's window."""
        return self.max_depth + 2

    def calibration_positions(self, reps: int = COST_REPS) -> int:
        """Positions ``measure_costs`` uses, the least ``prepare`` builds for. The runtime's: its
        prompt, one committed step per rep and the widest window after them. The drafter's: the
        prompt's head rows (padded to PREFILL_ROWS on the CPU) and every graphed catch-up size
        after them: any capacity measures what the default one does."""
        runtime = COST_PROMPT + reps + self.max_depth + 1
        drafter = COST_PROMPT + max(catch_up_sizes(self.max_depth + 1, max(LONG_CHUNKS)))
        return max(runtime, drafter, PREFILL_ROWS)

    def _build(self, capacity: int) -> None:
        old = self.runtime
        cal = old.cal if old is not None else None
        spread = old.eager_rows_on_lanes if old is not None else None
        # the old buffers and graphs go before the new ones are allocated: growing never holds both
        self.runtime = self.drafter = self.picks = old = None
        gc.collect()  # graphs and closures may hold the old buffers in reference cycles
        self.runtime = ExactRuntime(self.model, capacity=capacity, windows=tuple(range(1, self.max_depth + 2)),
                                    cal=cal, keep_rows=True)
        if spread is not None:  # what measure_costs chose holds for the larger runtime too
            self.runtime.spread_eager_rows(spread)
        path = self.shortlist_source()
        ids = load_shortlist(path, self.model.vocab_size) if path else None
        # a round catches up on its accepted rows + 1 (at most max_depth + 1); longer catch-ups,
        # after plain steps, run in chunks of graphed sizes
        self.drafter = MTPDrafter(self.model, capacity, shortlist=ids, head=self.head, max_rows=self.max_depth + 1,
                                  coupled=self.coupled, confidence=self.stop == "confidence")
        self.picks = TargetPicks(self.model.device, self.runtime.use_graphs)
        self.reader = TokenReader(self.runtime.device)

    def reserve(self, positions: int) -> None:
        """Room for every decode of ``len(prompt) + max_new_tokens <= positions`` (the protocol's),
        the runtime's and the drafter's alike."""
        self.ensure_capacity(positions + self.margin)

    def ensure_capacity(self, needed: int) -> None:
        """Static buffers are sized up front; a longer request gets larger ones (rounded up to
        ``sizing.STEP`` positions), never a silent overflow."""
        if needed > self.runtime.capacity:
            self._build(capacity_for(needed))

    def shortlist_source(self) -> str | None:
        """The ``shortlist`` argument, else the trained head's, else the checkpoint's, else none."""
        return shortlist_source(self.model, self.shortlist_path, self.head_dir)

    @torch.inference_mode()
    def measure_costs(self, reps: int = COST_REPS) -> dict:
        """Seconds of a plain step, a chained head step, each verify window and the head's rows for
        a 16-token prompt (one block of PREFILL_ROWS rows where they are padded), on this device,
        now, every rep kept: ``{"step": [..], "draft": [..], "verify": {w: [..]},
        "head_prefill": [..]}`` (``Costs.from_reps`` reduces them). Timed in interleaved rounds
        (each round times every op once): a busy spell on a shared CPU then slows one round of every
        op, not every rep of one op, so the ratios between ops that the policy trades on stay right
        in the fastest round."""
        rt, dr, dev = self.runtime, self.drafter, self.model.device
        prompt = list(range(3, 3 + COST_PROMPT))
        logits, hidden = rt.prefill(prompt)
        dr.prefill(hidden, prompt)
        tok = logits.argmax(-1).view(1, 1)
        dr.draft(hidden[:, -1:], tok, 1)  # the last prompt row: leaves a chained step's inputs live
        blocks = {w: tok.expand(1, w).contiguous() for w in range(1, self.max_depth + 2)}
        # steps commit (one position each, well within capacity); windows are never accepted
        # head_prefill rewrites the prompt's head rows (the chained step's inputs stay live)
        ops = {"step": lambda: rt.step(tok), "draft": lambda: dr.chained_step(dr.filled),
               "head_prefill": lambda: dr.prefill(hidden, prompt),
               **{w: (lambda b=b: rt.verify(b)) for w, b in blocks.items()}}
        times: dict = {name: [] for name in ops}
        # with lanes, windows are also timed with their eager attention rows in order: a fork
        # costs the host calls that a launch-bound model pays in full; the faster setting is kept
        in_order = {w: [] for w in blocks if w > 1} if rt.lanes.width > 1 else {}

        def timed(fn, into: list) -> None:
            sync(dev)
            t0 = time.perf_counter()
            fn()
            sync(dev)
            into.append(time.perf_counter() - t0)

        for _ in range(reps):
            for name, fn in ops.items():
                timed(fn, times[name])
            if in_order:
                rt.spread_eager_rows(False)
                for w, into in in_order.items():
                    timed(ops[w], into)
                rt.spread_eager_rows(True)
        if in_order and sum(map(min, in_order.values())) < sum(min(times[w]) for w in in_order):
            rt.spread_eager_rows(False)
            times.update(in_order)
        # every catch-up row count once: a CPU's first GEMM of a shape sets up its kernels (~1.6 ms
        # on tiny), which a decode's first catch-up of that size would otherwise pay
        for m in catch_up_sizes(self.max_depth + 1, dr.capacity - len(prompt)):
            dr.prefill(hidden, prompt)
            dr.draft(hidden[:, -1:].expand(1, m, -1), tok.expand(1, m), 1)
        rt.reset()
        return {"step": times["step"], "draft": times["draft"], "verify": {w: times[w] for w in blocks},
                "head_prefill": times["head_prefill"]}

    def config(self) -> dict:
        cfg = {"max_depth": self.max_depth, "depth": self.fixed, "head": self.head_dir,
               "head_sha256": file_sha256(Path(self.head_dir) / HEAD_FILE) if self.head_dir else None,
               "shortlist": self.shortlist_source(),
               "shortlist_size": None if self.drafter is None or self.drafter.shortlist is None
               else int(self.drafter.shortlist.numel()),
               "explore_every": self.explore_every, "online_costs": self.online_costs, "stop": self.stop,
               "coupled": self.coupled, "lazy_rows": self.lazy_rows}
        if self.runtime is not None:
            rt, dr = self.runtime, self.drafter
            cfg["sizing"] = {"capacity": rt.capacity, "static_bytes": rt.nbytes(),
                             "drafter_capacity": dr.capacity, "drafter_bytes": dr.nbytes()}
            cfg["graphs"] = self.runtime.use_graphs
            cfg["prefill"] = self.runtime.prefill_how
            cfg["lanes"] = self.runtime.lanes.width
            cfg["eager_rows_on_lanes"] = self.runtime.eager_rows_on_lanes
            cfg["gate_up_rows"] = self.runtime.gate_up_rows
            cfg["calibration"] = self.runtime.cal.to_json()
        if self.costs is not None:
            cfg["costs_s"] = {"step": self.costs.step, "draft": self.costs.draft,
                              "verify": {str(k): v for k, v in self.costs.verify.items()},
                              "head_prefill": self.costs.head_prefill}
        if self.cost_reps is not None:
            cfg["cost_reps_s"] = {"step": list(self.cost_reps["step"]), "draft": list(self.cost_reps["draft"]),
                                  "verify": {str(k): list(v) for k, v in self.cost_reps["verify"].items()},
                                  "head_prefill": list(self.cost_reps["head_prefill"])}
        return cfg

    def new_policy(self, prompt_len: int = 1, sampler: Sampler | None = None) -> DepthPolicy:
        """A decode's policy; its first draft also makes the head's rows for ``prompt_len`` tokens
        (``head_prefill`` was measured for one block of PREFILL_ROWS rows). Under a bound sampler
        its start-up costs are ``sampled_costs``. Its prior acceptance is what the last decode under
        the same sampler setting that drafted learnt (``carried_accept``), else the policy's own."""
        sampler = sampler or GREEDY
        blocks = max(1, -(-(prompt_len - 1) // PREFILL_ROWS))
        costs = self.costs if sampler.greedy else self.sampled_costs(sampler)
        prior = self.carried_accept.get(settings(sampler), DepthPolicy.prior)
        return DepthPolicy(costs, self.max_depth, prior=prior, explore_every=self.explore_every, fixed=self.fixed,
                           online=self.online_costs, first_draft=blocks * costs.head_prefill,
                           catch_up_calls=lambda rows: len(self.drafter.catch_up_chunks(rows)),
                           calibration=Calibration() if self.stop == "confidence" else None)

    def sampled_costs(self, sampler: Sampler) -> Costs:
        """The start-up costs under ``sampler`` (bound to the picks and the drafter): a plain step
        plus one pick and its read, a window of w rows plus w of them (lazy rows, as if no draft
        were rejected: the prior errs towards plain steps, and the decode's own round times
        correct it) or its rows' one call (``lazy_rows=false``), a draft step coupled. The picks
        and the coupled draft are timed once per sampler setting, at the first decode with it (the
        harness's untimed warm-up)."""
        key = settings(sampler)
        if key not in self._sampled_costs:
            self._sampled_costs[key] = self._time_sampling() if self.fixed is None else (0.0, 0.0, {})
        pick, draft, windows = self._sampled_costs[key]
        c = self.costs
        verify = {w: v + windows.get(w, w * pick) for w, v in c.verify.items()}
        return Costs(step=c.step + pick, draft=c.draft + draft, verify=verify, head_prefill=c.head_prefill)

    def _time_sampling(self, reps: int = 5) -> tuple[float, float, dict]:
        """Seconds of one pick and its read, what a coupled draft step adds to a plain one, and
        with ``lazy_rows=false`` a window's rows picked in one call and read, per width (fastest
        of ``reps``). Reads the programs' last logits, writes only the drafter's rows past those
        in use: the decode that follows makes its own."""
        rt, dr, dev = self.runtime, self.drafter, self.model.device
        prog = rt.program(1, capture=False)
        if rt.use_graphs:
            def pick():
                return int(self.picks.row(prog, 0))
        else:  # eager: the pick's own ops, on a row of the right size
            row = torch.zeros(self.model.vocab_size, device=dev)

            def pick():
                return int(self.picks.sampler.pick_tensor(row, 0))

        def fastest(fn) -> float:
            best = float("inf")
            for _ in range(reps):
                sync(dev)
                t0 = time.perf_counter()
                fn()
                sync(dev)
                best = min(best, time.perf_counter() - t0)
            return best

        seconds = fastest(pick)
        windows = {}
        if not self.lazy_rows:
            for w in self.costs.verify:
                if rt.use_graphs:
                    window = rt.program(w, capture=True)
                    windows[w] = fastest(lambda: self.picks.rows(window).tolist())
                else:
                    rows = torch.zeros(w, self.model.vocab_size, device=dev)
                    keys = torch.zeros(w, dtype=torch.long, device=dev)
                    windows[w] = fastest(lambda: pick_rows_from_keys(rows, self.picks.sampler, keys, keys).tolist())
        self.picks.picked = 0
        draft = 0.0
        if dr.coupled and dr.filled + 1 <= dr.capacity:
            draft = max(0.0, fastest(lambda: dr.chained_step(dr.filled)) - self.costs.draft)
        return seconds, draft, windows

    # ------------------------------------------------------------------ decoding

    def propose(self, drafts: list[torch.Tensor], emitted: int) -> list[torch.Tensor]:
        """The drafts a round verifies, given the head's drafts and the tokens emitted so far
        (the instrument overrides this; ``spec`` verifies the head's own drafts)."""
        return drafts

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], max_new_tokens: int, *, on_tokens=None,
               sampler: Sampler | None = None) -> DecodeResult:
        self.ensure_capacity(len(prompt_ids) + max_new_tokens + self.margin)
        sampler = sampler or GREEDY
        eos = set(self.model.eos_token_ids)
        self.drafter.couple(sampler if self.coupled else None)
        if not sampler.greedy:
            self.picks.bind(sampler, self.runtime.programs.values(), windows=not self.lazy_rows)
        policy = self.new_policy(len(prompt_ids), sampler)
        timer = PhaseTimer(self.model.device)
        stats = DecodeStats(extra={"depth_trace": [], "probes": 0, "probe_hits": 0})
        # greedy runs the greedy functions; a sampler, their sampled twins (same rounds, own picks)
        if sampler.greedy:
            prefill, plain_steps, spec_round = self._prefill, self._plain_steps, self._spec_round
        else:
            prefill, plain_steps, spec_round = self._prefill_sampled, self._plain_steps_sampled, self._spec_round_sampled
        with timer.phase("other"):
            pending = prefill(prompt_ids, sampler)
            tokens = [int(pending.y.item())]
        stats.forwards += 1
        if on_tokens is not None:
            on_tokens(tokens[:])
        last, drafting = time.perf_counter(), True  # the first catch-up is one row, as in a drafting run
        streamed: list[float] = []  # the callback's seconds inside this round's plain steps

        def emit(tok: int) -> None:  # a plain step's token goes out as soon as it is read
            t0 = time.perf_counter()
            on_tokens([tok])
            streamed.append(time.perf_counter() - t0)

        while tokens[-1] not in eos and len(tokens) < max_new_tokens:
            depth = min(policy.choose(), max_new_tokens - len(tokens))
            first_draft = bool(depth) and pending.prompt is not None
            if first_draft:
                self._prefill_head(pending, timer)
                last = time.perf_counter()  # a cost of drafting at all, not of this round
            draft = self._probe(pending, len(tokens), timer) if policy.probing else None
            step_from = last
            if draft is not None:  # a probe is a plain step with a draft beside it, timed as a probe
                depth, step_from = 0, time.perf_counter()
            if depth == 0:
                rounds = 1 if draft is not None else policy.plain_rounds(min(PLAIN_RUN, max_new_tokens - len(tokens)))
                new, ran = plain_steps(pending, rounds, eos, None if on_tokens is None else emit)
                stats.extra["depth_trace"] += [0] * len(new)
            else:
                if policy.calibration is not None:  # the round sets its own depth, up to max_depth
                    depth = min(self.max_depth, max_new_tokens - len(tokens))
                new, depth, confidences = spec_round(pending, policy, depth, len(tokens), timer)
                stats.extra["depth_trace"].append(depth)
                policy.update(depth, len(new) - 1, confidences)
                stats.record_round(depth, len(new) - 1)
            # the round's tokens were just read: a sync point; the callback's time belongs to no round
            now = time.perf_counter() - sum(streamed)
            if draft is not None:
                if not first_draft:  # on a GPU that round also waits for the head's prompt rows
                    policy.observe_probe(now - last)
            elif depth == 0 or drafting:
                policy.observe(depth, now - last, len(new) if depth == 0 else 1)
            if depth == 0:  # plain steps' time, by the host clock (a probe's draft is in its phase)
                timer.add("step", now - step_from)
            if draft is not None:
                hit = int(draft.item()) == new[0]
                policy.update(1, int(hit), self.probe_confidence(policy, len(tokens)))
                stats.extra["probes"] += 1
                stats.extra["probe_hits"] += int(hit)
            last, drafting = now, depth > 0
            stats.forwards += ran if depth == 0 else 1  # plain steps: with the one queued past an EOS
            new = new[:stop_index(new, eos, max_new_tokens - len(tokens))]  # plain runs stop there already
            tokens += new
            if on_tokens is not None:
                if depth != 0:
                    on_tokens(new)
                last = time.perf_counter()
                streamed.clear()
        stats.extra["time_split"] = timer.result()
        stats.extra["policy"] = policy.state()
        if policy.learnt() is not None:
            self.carried_accept[settings(sampler)] = policy.learnt()
        if not sampler.greedy:
            stats.extra["rows_picked"] = self.picks.picked  # window rows and steps the sampler picked
        return DecodeResult(tokens, stats)

    def _prefill(self, prompt_ids: list[int], sampler: Sampler = GREEDY) -> Pending:
        _, hidden = self.runtime.prefill(prompt_ids)
        pending = Pending(self.runtime)
        pending.prompt = (hidden, prompt_ids)
        return pending

    def _prefill_sampled(self, prompt_ids: list[int], sampler: Sampler) -> Pending:
        """The prefill; its token is the sampler's pick (the picks bound to ``sampler``) at
        len(prompt_ids), written where the greedy prefill leaves its argmax (the head's pending
        row, and ``Pending.y``)."""
        logits, hidden = self.runtime.prefill(prompt_ids)
        p = len(prompt_ids)
        self.runtime.state.row_next[:, p - 1:p].copy_(self.picks.first(logits, p))
        pending = Pending(self.runtime)
        pending.prompt = (hidden, prompt_ids)
        return pending

    def _prefill_head(self, pending: Pending, timer: PhaseTimer) -> None:
        """The head's prompt rows, made at the decode's first draft: a decode that never drafts
        (a head that cannot pay) costs what fast-serial's does."""
        with timer.phase("draft"):
            self.drafter.prefill(*pending.prompt)
        pending.prompt = None

    def _plain_steps(self, pending: Pending, rounds: int, eos: set[int], emit=None) -> tuple[list[int], int]:
        """Up to ``rounds`` exact steps, stopping after an EOS; their rows join the head's pending
        rows (``Pending.steps``, the runtime's ring). Returns the emitted tokens, each also given to
        ``emit`` as it is read, and the steps run (one more than the tokens after an EOS: each step
        is queued before the host reads the token before it, decoders/stepping.py). Timed by the
        decode loop's host clock, not by events: at a step's cost on a fast GPU, two event records
        a step would show."""
        rt = self.runtime
        out, pending.y, ran = steps_read_ahead(lambda y: rt.step(y).ws["argmax"], pending.y, rounds, eos,
                                               self.reader, emit)
        pending.steps += out
        return out, ran

    def _plain_steps_sampled(self, pending: Pending, rounds: int, eos: set[int], emit=None) -> tuple[list[int], int]:
        """As ``_plain_steps``, each token the sampler's pick at the position after the step's."""
        rt, picks = self.runtime, self.picks
        out, pending.y, ran = steps_read_ahead(lambda y: picks.row(rt.step(y), 0).view(1, 1), pending.y, rounds, eos,
                                               self.reader, emit)
        pending.steps += out
        return out, ran

    def _probe(self, pending: Pending, emitted: int, timer: PhaseTimer) -> torch.Tensor:
        """Catch the head up on the pending rows and draft the token after ``pending.y`` [1,1];
        the rows are then the head's, and the next step's row starts a new pending run."""
        with timer.phase("draft"):
            draft = self.propose(self.drafter.draft(*pending.take(), 1), emitted)[0]
        return draft

    def _draft(self, pending: Pending, policy: DepthPolicy, depth: int,
               emitted: int) -> tuple[list[torch.Tensor], list[float] | None]:
        """A drafting round's drafts (``propose``'s) and, with confidence stopping, the
        confidences the policy saw: ``depth`` drafts, or with confidence stopping as many as
        ``policy.draft_more`` asks for, ``depth`` at most."""
        dr = self.drafter
        if policy.calibration is None:
            return self.propose(dr.draft(*pending.take(), depth), emitted), None
        seen: list[float] = []

        def more(confidences: list[float]) -> bool:  # one call per draft: only the newest is new
            seen.append(self.confidence(confidences[-1], emitted, len(confidences)))
            return len(seen) < depth and policy.draft_more(seen)

        drafts, _ = dr.draft_until(*pending.take(), more)
        return self.propose(drafts, emitted), seen

    def confidence(self, confidence: float, emitted: int, k: int) -> float:
        """The confidence the policy sees for a round's k-th draft (the instrument overrides this)."""
        return confidence

    def probe_confidence(self, policy: DepthPolicy, emitted: int) -> list[float] | None:
        """With confidence stopping, the probe's draft's confidence (read after its step)."""
        if policy.calibration is None:
            return None
        return [self.confidence(float(self.drafter.in_conf), emitted, 1)]

    def _spec_round(self, pending: Pending, policy: DepthPolicy, depth: int, emitted: int,
                    timer: PhaseTimer) -> tuple[list[int], int, list[float] | None]:
        """Draft (``_draft``), verify [y, drafts] in one window, keep the accepted prefix and the
        model's own next token, roll back past it. Returns the kept tokens (accepted + 1), the
        depth drafted and the drafts' confidences (None without confidence stopping)."""
        rt = self.runtime
        with timer.phase("draft"):
            drafts, confidences = self._draft(pending, policy, depth, emitted)
        depth = len(drafts)
        with timer.phase("verify"):
            block = torch.cat([pending.y] + drafts, dim=1)
            prog = rt.verify(block)
            argmax = prog.ws["argmax"].view(1, -1)
            # the model's tokens and the drafts in one read: the round's only wait for the device
            both = torch.cat([argmax, block[:, 1:]], dim=1).view(-1).tolist()
        pred, drafted = both[:depth + 1], both[depth + 1:]
        j = accepted_prefix(pred, drafted)
        with timer.phase("rollback"):
            rt.accept(j + 1)
        pending.y = argmax[:, j:j + 1]
        # the kept rows 0..j are pending now: the window left them in the runtime's kept rows, so
        # the next round's inputs stay on the device with no copy
        return pred[:j + 1], depth, confidences

    def _spec_round_sampled(self, pending: Pending, policy: DepthPolicy, depth: int, emitted: int,
                            timer: PhaseTimer) -> tuple[list[int], int, list[float] | None]:
        """As ``_spec_round``, the model's token at each row being the sampler's pick at that
        row's position, and the window's kept rows' next tokens (the head's pending rows) those
        picks rather than the rows' argmaxes."""
        rt = self.runtime
        with timer.phase("draft"):
            drafts, confidences = self._draft(pending, policy, depth, emitted)
        depth = len(drafts)
        with timer.phase("verify"):
            block = torch.cat([pending.y] + drafts, dim=1)
            start = rt.length
            prog = rt.verify(block)
            pred, j = self._pick_window(prog, block, depth)
        with timer.phase("rollback"):
            rt.accept(j + 1)
        row_next = rt.state.row_next
        row_next[:, start:start + j + 1].copy_(self.picks.out(prog)[:j + 1])
        pending.y = row_next[:, start + j:start + j + 1]
        return pred[:j + 1], depth, confidences

    def _pick_window(self, prog, block: torch.Tensor, depth: int) -> tuple[list[int], int]:
        """The picks of the window's rows (as many as are known) and the accepted count j. Lazy:
        row 0 with the drafts in one read, then one row per read while the drafts agree; else
        every row in one call and one read."""
        picks = self.picks
        if not self.lazy_rows:
            rows = picks.rows(prog)[:depth + 1].view(1, -1)
            both = torch.cat([rows, block[:, 1:]], dim=1).view(-1).tolist()
            pred, drafted = both[:depth + 1], both[depth + 1:]
            return pred, accepted_prefix(pred, drafted)
        both = torch.cat([picks.row(prog, 0).view(1, 1), block[:, 1:]], dim=1).view(-1).tolist()
        pred, drafted = both[:1], both[1:]
        j = 0
        while j < depth and pred[j] == drafted[j]:
            j += 1
            pred.append(int(picks.row(prog, j).item()))
        return pred, j


def file_sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class InstrumentedSpecDecoder(SpecDecoder):
    """``spec-instrument``, for benchmarks only: acceptance set by hand on any model.

    It runs the real draft computation, then replaces each draft with the control's token at that
    position or with a token that is certainly wrong, so speed at a chosen acceptance can be
    measured on any model (random weights included) with every cost real. Which drafts are right:
      alpha  each one independently with probability alpha (default 0.85)
      trace  a file ``python -m decoders.trace`` wrote from a real model and head: the k-th draft
             of a round starting at stream position t is right exactly where the traced head's
             was (``Trace.accepts``; a prompt the trace lacks, or a longer run, cycles through its
             rows), so a real head's acceptance pattern drives the costs of the model timed;
             with ``stop=confidence`` the policy sees the traced head's confidences too, where
             the trace recorded them
    The control's stream comes from ``prepare_prompt``, which the harness calls untimed before a
    prompt's legs (with the legs' ``sampler``: under sampling it is the sampled control's stream,
    and the right drafts are its tokens); runs are marked as an instrument and the audit checks
    their exactness but refuses to score them.
    """

    name = "spec-instrument"
    instrument = True

    def __init__(self, alpha: float | None = None, seed: int = 0, trace: str | None = None, **kwargs):
        super().__init__(**kwargs)
        if trace is not None and alpha is not None:
            raise ValueError("give alpha or trace, not both")
        if trace is None:
            alpha = 0.85 if alpha is None else float(alpha)
            if not 0.0 <= alpha <= 1.0:
                raise ValueError("alpha must be within 0..1")
        self.alpha, self.seed = alpha, int(seed)
        self.trace_path = trace
        self.trace: Trace | None = None if trace is None else load_trace(trace)
        deepest = self.max_depth if self.fixed is None else self.fixed
        if self.trace is not None and deepest > self.trace.max_depth:
            raise UserError(f"{trace}: traced to depth {self.trace.max_depth}, below the depth asked for ({deepest})")
        # (prompt ids, sampler) -> the control's tokens
        self.reference: dict[tuple[tuple[int, ...], Sampler], list[int]] = {}
        self._ref: list[int] = []  # the control's tokens for the prompt being decoded
        self._row: TraceRow | None = None  # the trace row that prompt replays
        self._rng = torch.Generator()  # the substitutions' draws, reseeded per decode

    def config(self) -> dict:
        cfg = {**super().config(), "instrument": True, "alpha": self.alpha, "seed": self.seed}
        if self.trace is not None:
            model = self.trace.meta.get("model") or {}
            cfg.update({"trace": self.trace_path, "trace_sha256": file_sha256(Path(self.trace_path)),
                        "trace_model": model.get("name"), "trace_depth": self.trace.max_depth,
                        "trace_max_new_tokens": self.trace.max_new_tokens})
        return cfg

    @property
    def margin(self) -> int:
        """Beyond a decode's own window: ``prepare_prompt`` runs the control max_depth + 1 tokens on."""
        return 2 * self.max_depth + 3

    @torch.inference_mode()
    def prepare_prompt(self, prompt_ids: list[int], max_new_tokens: int, *, sampler: Sampler | None = None) -> None:
        """Compute the control's tokens for this prompt under ``sampler`` (None: greedy) on the
        exact runtime, one step per token as fast-serial decodes, untimed."""
        sampler = sampler or GREEDY
        n = max_new_tokens + self.max_depth + 1
        self.ensure_capacity(len(prompt_ids) + max_new_tokens + self.margin)
        rt = self.runtime
        logits, _ = rt.prefill(prompt_ids)
        if sampler.greedy:
            tok = logits.argmax(-1).view(1, 1)
        else:
            self.picks.bind(sampler, self.runtime.programs.values(), windows=not self.lazy_rows)
            tok = self.picks.first(logits, len(prompt_ids))
        ref = [int(tok.item())]
        while len(ref) < n:
            prog = rt.step(tok)
            tok = (prog.ws["argmax"] if sampler.greedy else self.picks.row(prog, 0)).view(1, 1)
            ref.append(int(tok.item()))
        self.reference[(tuple(prompt_ids), sampler)] = ref

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], max_new_tokens: int, *, on_tokens=None,
               sampler: Sampler | None = None) -> DecodeResult:
        sampler = sampler or GREEDY
        key = (tuple(prompt_ids), sampler)
        if key not in self.reference or len(self.reference[key]) < max_new_tokens + self.max_depth + 1:
            self.prepare_prompt(prompt_ids, max_new_tokens, sampler=sampler)
        self._ref = self.reference[key]
        self._row = self.trace.row_for(prompt_ids) if self.trace is not None else None
        self._rng = torch.Generator().manual_seed(self.seed)  # the same substitutions on every leg
        return super().decode(prompt_ids, max_new_tokens, on_tokens=on_tokens, sampler=sampler)

    def right(self, emitted: int, k: int) -> bool:
        """Whether the round's k-th draft (1-based) is to be the control's token; the round
        starts at stream position emitted - 1."""
        if self.trace is not None:
            return Trace.accepts(self._row, emitted - 1, k)
        return float(torch.rand((), generator=self._rng)) < self.alpha

    def confidence(self, confidence: float, emitted: int, k: int) -> float:
        """With a trace that recorded them, the traced head's confidence in the round's k-th draft
        (``Trace.confidence``), so ``stop=confidence`` decides as with that head; else the head's
        own."""
        if self._row is None or self._row.conf is None:
            return confidence
        return Trace.confidence(self._row, emitted - 1, k)

    def propose(self, drafts: list[torch.Tensor], emitted: int) -> list[torch.Tensor]:
        """The head's drafts were computed (every cost stays real); replace each by the control's
        token at its position where ``right`` says so, else by a token that is certainly wrong."""
        ref, vocab, out = self._ref, self.model.vocab_size, []
        for i, d in enumerate(drafts):
            pos = emitted + i
            want = ref[pos] if pos < len(ref) else None
            if want is not None and self.right(emitted, i + 1):
                out.append(torch.full_like(d, want))
            else:
                base = want if want is not None else int(d.item())
                out.append(torch.full_like(d, (base + 1 + int(torch.randint(vocab - 1, (), generator=self._rng))) % vocab))
        return out
