"""``audit retime STREAM``: measure the candidate's speed again, on the audit's clock.

``audit replay`` checks a stream's tokens and its arithmetic, but its timing is the harness's,
measured in one process the candidate shares, on prompts the candidate may know in advance (the
built-in sets). A retime takes the stream's word only for what ran (model, candidate and its
arguments, control, N) and measures again:

  prompts   FRESH prompts the stream does not hold, as many as ``--prompts`` (default 4), each of
            the length of one of the stream's prompts, drawn from the stream's source: other
            random ids for ``random-512*``, snippets of the same split from line starts the seed
            picks for ``stdlib-*`` (any of the split's, not a list one could decode in advance),
            otherwise ids resampled from the stream's own prompt tokens (said so in the output).
            The seed is drawn for each retime (``secrets``) and shown only once every leg ran
            (``--seed`` repeats a retime's draw); every draw (a prompt, its warm-up, its spare)
            has its own generator from it, so what a worker is sent tells nothing of the rest.
  processes the candidate and the control each in a process of its own (``python -m
            harness.worker``), both started cold; the audit launches them by module name and
            imports no decoder or timing code itself. While one side is timed the other is
            stopped as a whole process tree (``audit.processes``: its worker's group, every
            process descended from it in any session, and for the candidate every orphan the
            audit adopted), so neither can load the machine against the other; a worker that ran
            processes outside its group gets a ``worker-processes`` warning, and whatever it
            leaves running is killed at the end.
  load      around every leg, how long the timed worker's threads waited for a CPU, and the
            CPU the machine spent on other work (``audit.processes.cpu_sample``): a prompt
            whose control waited WAIT_GAP more of its time than its candidate did, or ran beside
            OTHERS_GAP more cores of other work (``loaded_against_control``), is measured again on
            its spare; more than half of the judged prompts so loaded fail the retime
            (``load-against-control``): work out of the audit's reach slowed the control.
  stops     each worker counts the SIGCONTs it receives and the audit counts those it sends (one
            per resume of the side it stopped); a control worker that received more was stopped
            by another process, and the audit counts its own SIGCONTs during every leg: either
            fails the retime (``stopped-by-others``). A pause costs no CPU and no wait for one,
            so neither load measure sees it.
  gpu       on a GPU, the driver is asked every second while the legs run which processes hold
            a GPU context (``audit.processes.GpuWatch``, nvidia-smi); one that is neither the
            audit nor its descendant fails the retime (``gpu-shared``): its GPU work could slow
            the control and takes too little CPU to be seen. Where the driver cannot say (no
            nvidia-smi, or process ids not this system's), ``gpu-unmeasured`` warns.
  clock     ``time.perf_counter`` in the audit, from writing a request to reading its answer;
            per prompt an untimed warm-up of both on another prompt of the same length, then
            ``--legs`` legs of each in ABBA order. A prompt's ratio is ``core.schema.prompt_ratio``
            (control median over the candidate's first leg), as in the stream.
  again     a prompt whose legs spread past ``core.schema.LEG_SPREAD_LIMIT`` on either side (a
            burst of the machine's noise) is measured once more, on its spare: another fresh
            prompt of the same length, drawn with the others, which takes its place; the first
            measurement stays in retime.json under ``remeasured``. Only noise can be won this
            way: a spare is as fresh as the prompt it replaces, and its first leg is timed alike.
  second    a first look whose median ratio falls short (below) is followed by a second look
  look      at as many fresh prompts (and spares), drawn with the others, and the judgment is
            on all of them; retime.json says so under ``second_look``. Noise that sank one look
            rarely sinks both, while a decoder slower than its claim is as slow on the second
            look's fresh prompts as on the first's.
  tokens    every retimed leg is replayed through the audit's pristine serial path.

Finding ``ratio-not-reproduced`` (fail) when the retimed median ratio falls short of the
recorded one by more than max(the noise, MIN_TOLERANCE). The noise is the control's leg spread
(median over prompts), the larger of the retime's and the stream's, the stream's counted up to
STREAM_NOISE_CAP; a spread s lets a ratio move by a factor 1 + s, a shortfall of s / (1 + s).
Only the control's legs measure noise: the candidate's later legs never enter its ratio, so a
candidate could make them as uneven as it likes. Writes retime.json
beside the stream (or ``--out``), prints a table, exits 0 / 1 / 2 like ``audit replay``.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from core.continues import ContinueCounter
from core.provenance import check_control_code
from core.prompts import RANDOM_SETS, SNIPPET_CHARS, parse_corpus_spec, snippet_at, snippet_files
from core.schema import ROLES, abba_roles, loads

from audit import checks, sandbox
from audit.pipeline import (EXIT_FAIL, EXIT_PASS, check_out_path, choose_device,
                            load_replay_model, log, model_spec_from_header, pin_replay_environment, prompt_set_spec,
                            replay_device_json)
from audit.processes import GpuWatch, ProcessTree, cpu_sample, leg_cpu, parent_table, set_subreaper, tree_control
from audit.replay import replay_run
from audit.report import divergence_findings, finding_lines, fmt_ratio, write_document
from audit.stream import BadInput, PromptRun, Run, load_run, resolve_stream_path

SCHEMA = "qwen35-exact/retime/1"
# a retimed median this far below the recorded one is beyond doubt even on a quiet machine; a
# noisier retime (legs further apart) widens the margin to its own noise
MIN_TOLERANCE = 0.25
# a stream's own control spread is the file's word, editable like the rest of it: it widens the
# margin at most to a 50% shortfall (spread 100%), so a forger cannot hide a 4x claim behind
# noise it wrote, and a 2x claim only behind legs the audit already flags as unstable
STREAM_NOISE_CAP = 1.0
# a fresh corpus snippet is cut this long (twice a set's own) so that it is long enough once
# encoded for the prompt it mirrors, at almost any line start; line starts tried for one
FRESH_SNIPPET_CHARS = 2 * SNIPPET_CHARS
SNIPPET_TRIES = 64
# a fresh snippet may not begin with the first this many tokens of one of the stream's prompts
HELD_START_TOKENS = 8
WORKER_MODULE = "harness.worker"
# a prompt whose control waited for a CPU for this much more of its legs' time than its candidate
# did, or beside this many more cores of other work, ran its control on a machine loaded against it
# (a process the audit cannot stop, or chance). Waiting shows a full machine; the other work's
# cores show a machine with CPUs to spare, where a loading process still slows the control through
# what cores share (caches, memory, a hyperthread's sibling, a VM's host) without making it wait.
# Honest retimes under steady and fluctuating background load stayed below both (bench/NOTES.md).
WAIT_GAP = 0.1
OTHERS_GAP = 0.5
# a retime's secret seed: any integer of this many bits (what --seed takes back)
SEED_BITS = 63
# seconds a worker may take to exit after its stdin closes, before it is killed
WORKER_EXIT_S = 30


@dataclass(frozen=True)
class RetimeOptions:
    """Every ``audit retime`` option, named once."""

    stream: Path
    out: Path | None = None
    prompts: int = 4
    max_new_tokens: int | None = None
    legs: int = 2
    model: str | None = None
    device: str | None = None
    allow_device_mismatch: bool = False
    trust_plugin: bool = False  # run a plug-in decoder the stream names (its code, in the workers)
    sandbox: bool = True  # the candidate's worker in this machine's sandbox (audit.sandbox), where it has one
    seed: int | None = None  # the fresh prompts' draw (None: a secret one, drawn for this retime)


@dataclass
class FreshPrompt:
    id: str
    token_ids: list[int]
    warmup_ids: list[int]
    mirrors: str  # the stream prompt whose length it has
    spare: "FreshPrompt | None" = None  # measured in its place if its legs are unstable


class WorkerError(Exception):
    """A worker failed to start or to answer; the message names the side and what it said."""

    prompt_id: str | None = None  # the fresh prompt it failed on, once timing began


# --------------------------------------------------------------------------- fresh prompts


def draw_rng(seed: int, what: str) -> random.Random:
    """The generator of one draw (``what`` names it) from the retime's seed: each draw's own, so the
    ids a worker is sent (a warm-up's, a prompt's) say nothing of any other draw."""
    return random.Random(f"qwen35-exact/retime/{seed}/{what}")


def random_ids(rng: random.Random, pool, length: int) -> list[int]:
    """``length`` ids drawn from ``pool`` (a range or a list), with replacement."""
    return [pool[rng.randrange(len(pool))] for _ in range(length)]


def fresh_prompts(run: Run, model, k: int, seed: int) -> tuple[list[FreshPrompt], list[FreshPrompt], str]:
    """Two looks of ``k`` prompts the stream does not hold, each of the length of one of its
    prompts (picked by the seed), from the stream's own source, each with a spare of the same
    length; and a line saying how they were drawn."""
    mirrors = draw_rng(seed, "mirrors").sample(run.prompts, k)
    source = (run.header.get("prompts") or {}).get("source") or ""
    spec = prompt_set_spec(source) if source.startswith("builtin:") else None
    held = {tuple(p.token_ids) for p in run.prompts}
    vocab = range(model.vocab_size)
    corpus = parse_corpus_spec(spec) if spec else None
    if spec in RANDOM_SETS:
        def draw(rng, n):
            return random_ids(rng, vocab, n)
        how = f"random token ids (as {source} draws them)"
    elif corpus is not None and model.tokenizer is not None:
        files, tokenizer = snippet_files(corpus[0], FRESH_SNIPPET_CHARS), model.tokenizer.get()

        def draw(rng, n):
            return corpus_snippet(rng, files, tokenizer, n, held, corpus[0])
        how = (f"snippets of the {corpus[0]} split ({source}'s) from line starts the seed picks, "
               "cut to each mirrored prompt's length")
    else:
        pool = [t for p in run.prompts for t in p.token_ids]

        def draw(rng, n):
            return random_ids(rng, pool, n)
        how = (f"ids resampled from the stream's own prompt tokens ({source or 'no source'} is not a set the "
               "audit can draw from)")

    def fresh(fid: str, m: PromptRun) -> FreshPrompt:
        tokens = draw(draw_rng(seed, f"prompt/{fid}"), len(m.token_ids))
        if tuple(tokens) in held:
            raise BadInput(f"a fresh prompt drawn for {m.id!r} is one of the stream's own prompts; "
                           "the stream's prompts are too few or too short to draw others from")
        # the warm-up, as the harness does it: another prompt of the same length
        return FreshPrompt(fid, tokens, random_ids(draw_rng(seed, f"warmup/{fid}"), vocab, len(tokens)), m.id)

    looks = []
    for look in range(2):
        prompts = []
        for i, m in enumerate(mirrors):
            fid = f"fresh-{look * k + i}"
            fp = fresh(fid, m)
            fp.spare = fresh(f"{fid}-again", m)
            prompts.append(fp)
        looks.append(prompts)
    return looks[0], looks[1], how


def corpus_snippet(rng: random.Random, files: list, tokenizer, length: int, held: set, split: str) -> list[int]:
    """The first ``length`` tokens of a snippet from a file and line start ``rng`` picks, one long
    enough that starts unlike every one of the stream's prompts (not where one of the set's own
    snippets starts). Any line start of the split may come, so a decoder cannot decode every fresh
    prompt in advance as it could a fixed list of snippets."""
    starts = {h[:HELD_START_TOKENS] for h in held}
    for _ in range(SNIPPET_TRIES):
        f = files[rng.randrange(len(files))]
        ids = tokenizer.encode(snippet_at(f.text, rng.randrange(len(f.text)), FRESH_SNIPPET_CHARS))
        if len(ids) >= length and tuple(ids[:HELD_START_TOKENS]) not in starts:
            return list(ids[:length])
    raise BadInput(f"no {split} snippet of {length} tokens at {SNIPPET_TRIES} line starts: the stream's prompts are "
                   "longer than the split's snippets")


# --------------------------------------------------------------------------- workers


@dataclass(frozen=True)
class Side:
    """A decoder as the stream recorded it: how ``harness time`` was told to build it."""

    role: str
    spec: str  # a registered name, or package.module:attr (a plug-in)
    args: dict  # constructor arguments as recorded (header ``args``)
    raw_args: tuple[str, ...] = ()  # KEY=VALUE from the header's command line, when ``args`` is absent

    @property
    def plugin(self) -> bool:
        return ":" in self.spec

    def command(self, model_spec: str, device: str) -> list[str]:
        # isolated: no PYTHONPATH, no user site; a trusted plug-in keeps PYTHONPATH, where it is found
        return [sys.executable, "-s" if self.plugin else "-I", "-m", WORKER_MODULE, "--model", model_spec, "--device", device,
                "--decoder", self.spec, "--decoder-args", json.dumps(self.args),
                *(f"--decoder-arg={a}" for a in self.raw_args)]

    def describe(self) -> str:
        return " ".join([self.spec] + ([json.dumps(self.args)] if self.args else []) + list(self.raw_args))


def command_decoder_args(command) -> tuple[str, ...]:
    """``--decoder-arg`` values of a recorded ``harness time`` command line."""
    if not isinstance(command, list):
        return ()
    out = []
    for i, word in enumerate(command):
        if word == "--decoder-arg" and i + 1 < len(command) and isinstance(command[i + 1], str):
            out.append(command[i + 1])
        elif isinstance(word, str) and word.startswith("--decoder-arg="):
            out.append(word.partition("=")[2])
    return tuple(out)


def recorded_sides(header: dict, trust_plugins: bool) -> list[Side]:
    """The control and the candidate as recorded. The candidate's arguments come from the header's
    ``args``, else from its command line. A plug-in is code the stream names: it runs only with
    ``trust_plugins``."""
    sides = []
    for role in ROLES:
        entry = header[role]
        spec = entry.get("spec") if entry.get("spec") is not None else entry["name"]
        args = entry.get("args")
        if not isinstance(spec, str) or not spec:
            raise BadInput(f"header {role} spec must be a non-empty string, not {spec!r}")
        if args is not None and not isinstance(args, dict):
            raise BadInput(f"header {role} args must be an object, not {args!r}")
        raw = command_decoder_args(header.get("command")) if role == "candidate" and args is None else ()
        side = Side(role, spec, args or {}, raw)
        if side.plugin and not trust_plugins:
            raise BadInput(f"the {role} is the plug-in {spec!r}: retiming runs its code; pass --trust-plugin "
                           "if you trust it")
        sides.append(side)
    return sides


class Worker:
    """One side's process; ``decode`` is timed by the caller. ``audit_continues`` counts the
    audit's own SIGCONTs, shared by both sides."""

    def __init__(self, role: str, command: list[str], audit_continues: ContinueCounter, sandboxed: bool = False):
        self.role = role
        self.audit_continues = audit_continues
        self.resumes = 0  # SIGCONTs the audit sent the worker
        self.continued: int | None = None  # SIGCONTs the worker last said it received
        self.continues_judged = 0  # of the others' continues, those already put down to a request
        # a private pycache and temporary directory; for the candidate, the sandbox (audit.sandbox)
        self.launch = sandbox.launch(command, sandboxed)
        # a session of its own: stopped as its process group and, through /proc, as its whole tree
        self.proc = subprocess.Popen(self.launch.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1, env=self.launch.env, start_new_session=True)
        # orphans go with the candidate: the control is the audit's own decoder, which starts none
        self.tree = ProcessTree(self.proc.pid, adopts_orphans=role == "candidate")
        self.ready = None
        self.killed_at_close = 0

    def pause(self) -> None:
        self.tree.stop()

    def resume(self) -> None:
        self.tree.resume()
        self.resumes += 1

    def continues_by_others(self) -> int | None:
        """SIGCONTs the worker received from others since the last call (None if it does not say):
        each one ended a stop that the audit did not make."""
        if not checks.is_int(self.continued):
            return None
        new = max(0, self.continued - self.resumes - self.continues_judged)
        self.continues_judged += new
        return new

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise WorkerError(f"the {self.role}'s worker exited (code {code}); its stderr is above")
        try:
            msg = loads(line)  # the stream's strict rules: a worker runs code the audit does not trust
        except ValueError:
            raise WorkerError(f"the {self.role}'s worker wrote {line.strip()[:200]!r}, not a protocol line") from None
        if not isinstance(msg, dict) or "error" in msg:
            raise WorkerError(f"the {self.role}'s worker: {msg.get('error') if isinstance(msg, dict) else msg!r}")
        self.continued = msg.get("continued")
        return msg

    def wait_ready(self) -> dict:
        self.ready = self.read()
        if self.ready.get("ready") is not True:
            raise WorkerError(f"the {self.role}'s worker did not start with a ready line: {self.ready!r}")
        return self.ready

    def prepare_prompt(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """An instrument's untimed per-prompt preparation, as ``harness time`` gives it."""
        self.send(prompt_ids, max_new_tokens, key="prepare_prompt")
        if self.read().get("prepared") is not True:
            raise WorkerError(f"the {self.role}'s worker did not confirm its preparation")

    def send(self, prompt_ids: list[int], max_new_tokens: int, key: str = "prompt_ids") -> None:
        try:
            self.proc.stdin.write(json.dumps({key: prompt_ids, "max_new_tokens": max_new_tokens}) + "\n")
            self.proc.stdin.flush()
        except OSError:  # a closed pipe: the worker is gone
            raise WorkerError(f"the {self.role}'s worker exited (code {self.proc.wait()}); its stderr is above") from None

    def tokens(self) -> list[int]:
        tokens = self.read().get("tokens")
        if not isinstance(tokens, list) or not all(checks.is_int(t) for t in tokens):
            raise WorkerError(f"the {self.role}'s worker answered without a list of token ids")
        return tokens

    def close(self) -> None:
        self.resume()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=WORKER_EXIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.killed_at_close = self.tree.kill_members()
        self.launch.cleanup()


def request(workers: dict[str, Worker], role: str, prompt_ids: list[int],
            max_new_tokens: int) -> tuple[float, float, list[int], dict]:
    """(t_start, t_end, tokens, measures): the audit's clock around one request to ``role`` and
    its answer, the other side stopped meanwhile; ``measures`` what other work took meanwhile
    (``audit.processes.leg_cpu``), and how often another process stopped and continued the timed
    worker (since its last request) or the audit (``continued_by_others``, ``audit_continued``)."""
    other, timed = workers[checks.other_role(role)], workers[role]
    other.pause()
    try:
        before = cpu_sample(timed.tree)
        audit_before = timed.audit_continues.count
        t0 = time.perf_counter()
        timed.send(prompt_ids, max_new_tokens)
        tokens = timed.tokens()
        t1 = time.perf_counter()
        audit_continued = timed.audit_continues.count - audit_before
        after = cpu_sample(timed.tree)
    finally:
        other.resume()
    return t0, t1, tokens, {**leg_cpu(before, after), "continued_by_others": timed.continues_by_others(),
                            "audit_continued": audit_continued}


@dataclass
class Measured:
    """What a retime has timed so far; kept when a worker fails part way."""

    ran: list[tuple[FreshPrompt, PromptRun]] = field(default_factory=list)  # the prompts that count
    remeasured: list[dict] = field(default_factory=list)  # replaced by their spares, counting nowhere
    second_look: dict | None = None  # why a second look was taken, once it was

    @property
    def timed(self) -> list[PromptRun]:
        return [p for _, p in self.ran]


def time_looks(workers: dict[str, Worker], looks: tuple[list[FreshPrompt], list[FreshPrompt]],
               stream: list[PromptRun], recorded_median: float | None, max_new_tokens: int, legs: int,
               warmup_tokens: int, out: Measured, instrument: bool = False) -> None:
    """The first look; then, if its median ratio falls short of the recorded one (``judge``), the
    second look, recorded in ``out.second_look``."""
    first, second = looks
    time_fresh(workers, first, max_new_tokens, legs, warmup_tokens, out, instrument)
    short = judge(stream, recorded_median, out.timed)
    if not (short and second):
        return
    f = short[0]
    out.second_look = {"first_median_ratio": f["retimed"], "first_prompts": len(out.ran), "prompts": len(second)}
    log(f"the first {len(out.ran)} fresh prompts' median ratio {fmt_ratio(f['retimed'])} is "
        f"{1 - f['retimed'] / f['recorded']:.0%} below the recorded {fmt_ratio(f['recorded'])} (allowed "
        f"{f['tolerance']:.0%}): a second look, at {len(second)} more, before judging")
    time_fresh(workers, second, max_new_tokens, legs, warmup_tokens, out, instrument)


def time_fresh(workers: dict[str, Worker], prompts: list[FreshPrompt], max_new_tokens: int, legs: int,
               warmup_tokens: int, out: Measured, instrument: bool = False) -> None:
    """Per prompt: its timing (``time_prompt``), or, if either side's legs spread past the limit,
    its spare's, the first kept in ``out.remeasured``. Each prompt joins ``out.ran`` with the
    fresh prompt it ran, once all its legs ran."""
    origin = time.perf_counter()
    done = len(out.ran)
    for n, fp in enumerate(prompts, start=done + 1):
        p = time_prompt(workers, fp, max_new_tokens, legs, warmup_tokens, instrument, origin)
        ratio = checks.prompt_medians(p)["ratio"]
        log(f"retime [{n}/{done + len(prompts)}] {fp.id} ({len(fp.token_ids)} tokens, like {fp.mirrors}): "
            f"ratio {fmt_ratio(ratio)}")
        unstable, loaded = checks.is_unstable(p), loaded_against_control(p)
        if (unstable or loaded) and fp.spare is not None:
            spread = checks.prompt_spreads(p)
            reason = ("legs unstable (" + ", ".join(f"{role} {s:.0%}" for role, s in spread.items() if s is not None)
                      + ")") if unstable else describe_load(p)
            out.remeasured.append({"id": fp.id, "replaced_by": fp.spare.id, "mirrors": fp.mirrors, "ratio": ratio,
                                   "reason": reason, "leg_spread": spread, "waited": waited(p),
                                   "others_load": others_load(p),
                                   "walls": leg_walls(p)})
            log(f"retime [{n}/{done + len(prompts)}] {fp.id}: {reason}, measured again on its spare {fp.spare.id}")
            fp = fp.spare
            p = time_prompt(workers, fp, max_new_tokens, legs, warmup_tokens, instrument, origin)
            log(f"retime [{n}/{done + len(prompts)}] {fp.id}: ratio {fmt_ratio(checks.prompt_medians(p)['ratio'])}")
        out.ran.append((fp, p))


def time_prompt(workers: dict[str, Worker], fp: FreshPrompt, max_new_tokens: int, legs: int, warmup_tokens: int,
                instrument: bool, origin: float) -> PromptRun:
    """An untimed warm-up of both sides on the prompt's warm-up ids (and, for an instrument, its
    untimed preparation on the prompt, as ``harness time`` gives it), then ABBA legs."""
    try:
        for role in ROLES:
            if warmup_tokens:
                request(workers, role, fp.warmup_ids, warmup_tokens)
        if instrument:
            workers["candidate"].prepare_prompt(fp.token_ids, max_new_tokens)
        p = PromptRun(fp.id, 0, fp.token_ids, warmup_ids=fp.warmup_ids)
        seen = {role: 0 for role in ROLES}
        for order, role in enumerate(abba_roles(legs)):
            t0, t1, tokens, measures = request(workers, role, fp.token_ids, max_new_tokens)
            p.legs.append({"type": "leg", "prompt_id": fp.id, "role": role, "leg": seen[role], "order": order,
                           "t_start": t0 - origin, "t_end": t1 - origin, "wall_s": t1 - t0, "tokens": tokens,
                           **measures})
            seen[role] += 1
    except WorkerError as exc:
        exc.prompt_id = fp.id
        raise
    return p


def start_workers(sides: list[Side], model_spec: str, device: str,
                  audit_continues: ContinueCounter, sandboxed: bool = True) -> dict[str, Worker]:
    """Both sides cold, in processes of their own; the candidate with its recorded arguments. The
    audit's children from before are no one's orphans."""
    older = {pid for pid, (ppid, _) in parent_table().items() if ppid == os.getpid()} if tree_control() else set()
    workers = {}
    try:
        for side in sides:
            log(f"starting the {side.role}'s worker: {side.describe()}")
            workers[side.role] = Worker(side.role, side.command(model_spec, device), audit_continues,
                                        sandboxed=sandboxed and side.role == "candidate")
        for w in workers.values():
            w.tree.not_orphans = older | {x.proc.pid for x in workers.values()}
        for w in workers.values():
            w.wait_ready()
    except BaseException:
        for w in workers.values():
            w.close()
        raise
    return workers


# --------------------------------------------------------------------------- judging


def leg_shares(p: PromptRun, key: str) -> dict[str, float | None]:
    """Per side, a per-leg measure (``others_cpu_s``, ``waited_s``) summed over its legs, over their
    wall time; None where it was not measured."""
    out = {}
    for role in ROLES:
        legs = p.role_legs(role)
        values, wall = [r.get(key) for r in legs], sum(r["wall_s"] for r in legs)
        out[role] = None if not legs or None in values or wall <= 0 else sum(values) / wall
    return out


def others_load(p: PromptRun) -> dict[str, float | None]:
    """Per side, the CPU that other work took while its legs were timed, in cores."""
    return leg_shares(p, "others_cpu_s")


def waited(p: PromptRun) -> dict[str, float | None]:
    """Per side, the share of its legs' time its threads spent waiting for a CPU."""
    return leg_shares(p, "waited_s")


def gap(share: dict[str, float | None]) -> float | None:
    """The control's value less the candidate's; None where either was not measured."""
    control, candidate = share["control"], share["candidate"]
    return None if control is None or candidate is None else control - candidate


def loaded_against_control(p: PromptRun) -> bool:
    """The control waited for a CPU for WAIT_GAP more of its legs' time than the candidate did, or
    ran beside OTHERS_GAP more cores of other work: work that is not its own took the machine, or
    what its cores share, from the control alone, and inflated the ratio."""
    waited_gap, others_gap = gap(waited(p)), gap(others_load(p))
    return ((waited_gap is not None and waited_gap > WAIT_GAP)
            or (others_gap is not None and others_gap > OTHERS_GAP))


def describe_load(p: PromptRun) -> str:
    share, load = waited(p), others_load(p)
    text = (f"other work took {load['control']:.2f} cores while the control was timed, "
            f"{load['candidate']:.2f} while the candidate was")
    if share["control"] is not None and share["candidate"] is not None:
        text += (f"; the control waited for a CPU {share['control']:.0%} of its legs' time, "
                 f"the candidate {share['candidate']:.0%}")
    return text


def load_findings(timed: list[PromptRun]) -> list[dict]:
    """``load-against-control`` (fail) when more than half of the judged prompts ran their control on
    a machine loaded against it (``loaded_against_control``), even after their spares: work that is
    not the control's slowed it, which inflates the ratio; ``machine-load`` (warn) for a minority."""
    loaded = [p for p in timed if loaded_against_control(p)]
    if not loaded:
        return []
    if 2 * len(loaded) > len(timed):
        return [checks.finding("load-against-control", "fail", None,
                               f"{len(loaded)} of {len(timed)} prompts: {describe_load(loaded[0])} "
                               f"(first of them, {loaded[0].id}): the control was slowed by work that is not its own",
                               prompts=[p.id for p in loaded])]
    return [checks.finding("machine-load", "warn", p.id, describe_load(p) + ": this prompt's ratio "
                           "is inflated by work that is not the control's") for p in loaded]


def process_findings(workers: dict[str, Worker]) -> list[dict]:
    """A warning for each side whose worker ran processes outside its process group, or left any
    running when it exited: stopped with it all the same, and killed at the end."""
    out = []
    for w in workers.values():
        outside, killed = sorted(w.tree.outside_group), w.killed_at_close
        if outside or killed:
            out.append(checks.finding(
                "worker-processes", "warn", None,
                f"the {w.role}'s worker ran {len(outside)} process(es) outside its process group, stopped with it "
                f"whenever the other side was timed; {killed} still ran when it exited and were killed",
                role=w.role, outside_group=outside, killed_at_close=killed))
    return out


def stop_findings(timed: list[PromptRun]) -> list[dict]:
    """``stopped-by-others`` (fail) when another process stopped the control's worker (it received
    more SIGCONTs than the audit sent it; counted from one request to the next) or the audit itself
    during a leg: the pause is in the control's time, or, for the audit, in whichever side's it
    fell. The candidate's own stops only slow the candidate."""
    control, audit = [], []
    for p in timed:
        for r in p.legs:
            if r["role"] == "control" and (r.get("continued_by_others") or 0) > 0:
                control.append(f"{p.id} leg {r['leg']}")
            if (r.get("audit_continued") or 0) > 0:
                audit.append(f"{p.id} {r['role']} leg {r['leg']}")
    out = []
    if control:
        out.append(checks.finding("stopped-by-others", "fail", None,
                                  f"another process stopped the control's worker (SIGSTOP, then SIGCONT) before or "
                                  f"during {len(control)} of its legs ({', '.join(control[:4])}"
                                  f"{', ...' if len(control) > 4 else ''}): its time holds pauses that are not its own",
                                  side="control", legs=control))
    if audit:
        out.append(checks.finding("stopped-by-others", "fail", None,
                                  f"the audit itself was stopped and continued during {len(audit)} leg(s) "
                                  f"({', '.join(audit[:4])}{', ...' if len(audit) > 4 else ''}; a job stopped "
                                  "from a shell, or another process): those legs' times are not the decoders'",
                                  side="audit", legs=audit))
    return out


def watches_gpu(device: str) -> bool:
    """A retime on a GPU asks which processes hold a context there (``audit.processes.GpuWatch``)."""
    return str(device).startswith("cuda")


def gpu_findings(gpu: GpuWatch | None) -> list[dict]:
    """``gpu-shared`` (fail) when a process out of the audit's reach held a GPU context while the
    legs ran: its GPU work slows whichever side it likes and takes too little CPU to be seen;
    ``gpu-unmeasured`` (warn) when the driver could not say."""
    if gpu is None:
        return []
    if gpu.foreign:
        named = ", ".join(f"{pid} ({name or '?'})" for pid, name in sorted(gpu.foreign.items()))
        return [checks.finding("gpu-shared", "fail", None,
                               f"{len(gpu.foreign)} process(es) out of the audit's reach held a GPU context while "
                               f"the legs ran: {named}; their GPU work can slow the control unseen: retime on a "
                               "GPU no other process uses", pids=sorted(gpu.foreign))]
    if gpu.unmeasured:
        return [checks.finding("gpu-unmeasured", "warn", None,
                               f"which processes use the GPU could not be told ({gpu.unmeasured}): GPU work of a "
                               "process out of the audit's reach would go unseen")]
    return []


def gpu_document(gpu: GpuWatch | None) -> dict | None:
    if gpu is None:
        return None
    return {"samples": gpu.samples, "foreign": [{"pid": pid, "name": name} for pid, name in sorted(gpu.foreign.items())],
            "unmeasured": gpu.unmeasured}


def control_noise(prompts: list[PromptRun]) -> float:
    """The median over prompts of the control's leg spread (0 where it has one leg)."""
    spreads = [checks.prompt_spreads(p)["control"] or 0.0 for p in prompts]
    return statistics.median(spreads) if spreads else 0.0


def noise_of(stream: list[PromptRun], retimed: list[PromptRun]) -> dict:
    ours, theirs = control_noise(retimed), control_noise(stream)
    return {"retime": ours, "stream": theirs, "used": max(ours, min(theirs, STREAM_NOISE_CAP))}


def tolerance(noise: float) -> float:
    """A leg spread s lets a ratio move by a factor 1 + s, a shortfall of s / (1 + s)."""
    return max(noise / (1 + noise), MIN_TOLERANCE)


def retimed_median(timed: list[PromptRun]) -> float | None:
    return checks.median_ratio([checks.prompt_medians(p)["ratio"] for p in timed])


def judge(stream: list[PromptRun], recorded_median: float | None, timed: list[PromptRun]) -> list[dict]:
    """``ratio-not-reproduced`` if the retimed prompts' median falls short (``check_reproduced``)."""
    return check_reproduced(recorded_median, retimed_median(timed), noise_of(stream, timed)["used"])


def check_reproduced(recorded: float | None, retimed: float | None, noise: float) -> list[dict]:
    if recorded is None or retimed is None:
        return []
    tol = tolerance(noise)
    if retimed >= recorded * (1 - tol):
        return []
    return [checks.finding("ratio-not-reproduced", "fail", None,
                           f"retimed median ratio {retimed:.3f} is {1 - retimed / recorded:.0%} below the recorded "
                           f"{recorded:.3f} (allowed {tol:.0%}: max(control noise {noise:.0%} as a shortfall, "
                           f"{MIN_TOLERANCE:.0%})): the stream's speed is not the candidate's",
                           recorded=recorded, retimed=retimed, noise=noise, tolerance=tol)]


def build_document(run: Run, sha: str, seed: int, how: str, fresh: list[FreshPrompt], timed: list[PromptRun],
                   findings: list[dict], recorded: dict, max_new_tokens: int, legs: int, seconds: float,
                   exact: dict[str, bool], remeasured: list[dict], second_look: dict | None = None,
                   gpu_processes: dict | None = None) -> dict:
    per_recorded, recorded_median = recorded
    ratios = {p.id: checks.prompt_medians(p)["ratio"] for p in timed}
    noise = noise_of(run.prompts, timed)
    failed = any(f["severity"] == "fail" for f in findings)
    return {
        "schema": SCHEMA,
        "kind": "retime",
        "stream": str(run.path),
        "stream_sha256": sha,
        "seed": seed,
        "fresh_prompts": how,
        "candidate": {k: run.header["candidate"].get(k) for k in ("name", "spec", "args", "instrument")},
        "control": run.header["control"].get("name"),
        "model": run.header["model"].get("name"),
        "max_new_tokens": max_new_tokens,
        "legs": legs,
        "verdict": "fail" if failed else "pass",
        "recorded_median_ratio": recorded_median,
        "retimed_median_ratio": retimed_median(timed),
        # the control's leg spread, median over prompts: the retime's, the stream's, the one used
        "noise": noise,
        "tolerance": tolerance(noise["used"]),
        "seconds": seconds,
        "recorded": [{"id": p.id, "ratio": per_recorded[p.id]["ratio"]} for p in run.prompts],
        "prompts": [{"id": fp.id, "mirrors": fp.mirrors, "tokens": len(fp.token_ids),
                     "recorded_ratio": per_recorded[fp.mirrors]["ratio"], "ratio": ratios[p.id],
                     "exact": exact[p.id], "leg_spread": checks.prompt_spreads(p), "waited": waited(p),
                     "others_load": others_load(p),
                     "walls": leg_walls(p), "token_ids": fp.token_ids}
                    for fp, p in zip(fresh, timed)],
        # prompts whose legs were unstable, each replaced by its spare (their ratios count nowhere)
        "remeasured": list(remeasured),
        # None, or the first look's median that fell short and sent for a second look (all judged)
        "second_look": second_look,
        # on a GPU: how often the driver was asked which processes hold a context, and those out of
        # the audit's reach it named (None on a CPU)
        "gpu_processes": gpu_processes,
        "findings": findings,
    }


def leg_walls(p: PromptRun) -> dict[str, list[float]]:
    return {role: [r["wall_s"] for r in p.role_legs(role)] for role in ROLES}


def widest_spread(spreads: dict[str, float | None]) -> float | None:
    return max((s for s in spreads.values() if s is not None), default=None)


def render_table(doc: dict) -> str:
    rows = [("fresh prompt", "like", "P", "recorded", "retimed", "spread", "exact")]
    for e in doc["prompts"]:
        spread = widest_spread(e["leg_spread"])
        rows.append((e["id"], e["mirrors"], str(e["tokens"]), fmt_ratio(e["recorded_ratio"]), fmt_ratio(e["ratio"]),
                     "-" if spread is None else f"{spread:.0%}", "yes" if e["exact"] else "NO"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in rows]
    lines.insert(1, "-" * max(len(x) for x in lines))
    lines.append(f"fresh prompts: {doc['fresh_prompts']}; seed {doc['seed']} (--seed {doc['seed']} draws them again)")
    for e in doc["remeasured"]:
        lines.append(f"measured again: {e['id']} ({e['reason']}; ratio {fmt_ratio(e['ratio'])}) "
                     f"replaced by {e['replaced_by']}")
    look = doc.get("second_look")
    if look:
        lines.append(f"second look: the first {look['first_prompts']} fresh prompts' median "
                     f"{fmt_ratio(look['first_median_ratio'])} fell short; {look['prompts']} more were measured and "
                     f"all {len(doc['prompts'])} judged together")
    gpu = doc.get("gpu_processes")
    if gpu:
        lines.append(f"GPU processes: asked {gpu['samples']} times, " + (
            f"not told: {gpu['unmeasured']}" if gpu["unmeasured"] and not gpu["foreign"] else
            f"{len(gpu['foreign'])} out of the audit's reach"))
    lines.append(f"candidate sandbox: {sandbox_line(doc.get('sandbox'))}; control code: "
                 f"{control_code_line(doc.get('control_code'))}")
    lines += finding_lines(doc["findings"])
    lines.append("")
    lines.append(f"median ratio: recorded {fmt_ratio(doc['recorded_median_ratio'])} (the stream's "
                 f"{len(doc['recorded'])} prompts), retimed {fmt_ratio(doc['retimed_median_ratio'])} "
                 f"({len(doc['prompts'])} fresh prompts, N={doc['max_new_tokens']}, {doc['legs']} legs per side); "
                 f"control noise {doc['noise']['used']:.0%} (retime {doc['noise']['retime']:.0%}, stream "
                 f"{doc['noise']['stream']:.0%}), allowed shortfall {doc['tolerance']:.0%}")
    lines.append(f"retime took {doc['seconds']:.1f} s  verdict: {doc['verdict'].upper()}  candidate: "
                 f"{doc['candidate']['name']}" + ("  (instrument: never scored)" if doc["candidate"].get("instrument") else ""))
    return "\n".join(lines)


# --------------------------------------------------------------------------- provenance, sandbox


def control_code(sides: list[Side]):
    """The control's import closure checked against git HEAD / RECORD (``core.provenance``); None
    where the check could not run. A plug-in control's own module joins the closure."""
    control = next(s for s in sides if s.role == "control")
    modules = ("harness.worker", "decoders", "decoders.serial", "core.models", "core.determinism")
    try:
        return check_control_code(modules + ((control.spec.partition(":")[0],) if control.plugin else ()))
    except (OSError, subprocess.SubprocessError) as exc:
        log(f"the control's code could not be checked: {exc}")
        return None


def control_code_findings(report) -> list[dict]:
    if report is None:
        return [checks.finding("control-code-unchecked", "warn", None, "the control's code could not be checked "
                               "against git HEAD or RECORD: a changed file in its import closure would go unseen")]
    return report.findings()


def sandbox_findings(plan: "sandbox.Sandbox | None") -> list[dict]:
    """``candidate-not-sandboxed`` (warn) where the candidate's worker ran without a sandbox."""
    if plan is not None and plan.warning is None:
        return []
    why = plan.warning if plan is not None else f"{sandbox.NOT_SANDBOXED}: --no-sandbox"
    return [checks.finding(sandbox.NOT_SANDBOXED, "warn", None, why)]


def sandbox_line(sb: dict | None) -> str:
    return "none (--no-sandbox)" if sb is None else sb["tool"] or "none"


def control_code_line(cc: dict | None) -> str:
    if cc is None:
        return "not checked"
    return (f"{cc['checked']} files against {cc['reference']}, "
            + (f"{len(cc['modified'])} modified" if cc["modified"] else "unchanged") + f" ({cc['seconds']:.1f} s)")


# --------------------------------------------------------------------------- the command


def retime(opts: RetimeOptions) -> int:
    """The whole retime; returns the exit code. Writes retime.json once, at the end."""
    started = time.perf_counter()
    pin_replay_environment()
    path = resolve_stream_path(opts.stream)
    out_path = check_out_path(opts.out or path.parent / "retime.json", path)
    run = load_run(path)
    sides = recorded_sides(run.header, opts.trust_plugin)
    # an instrument is never scored; its ratio can still be reproduced, with the same untimed
    # per-prompt preparation the harness gave it
    instrument = run.header["candidate"].get("instrument") is True
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    # drawn here and shown only once every leg ran: a decoder could read the stream file, a seed
    # derived from it, and whatever the audit has printed to a file, but not this process's memory
    seed = opts.seed if opts.seed is not None else secrets.randbits(SEED_BITS)
    dev = choose_device(opts.device, run.header["device"])
    findings = checks.check_devices(run.header, [replay_device_json(dev)], opts.allow_device_mismatch)
    model_spec = opts.model or model_spec_from_header(run.header)
    model = load_replay_model(run, opts.model, dev)
    mismatch = checks.check_model_identity(run.header["model"], model.identity)
    if mismatch:
        raise BadInput(f"{mismatch[0]['message']}; retime with the stream's own model (--model)")
    n = opts.max_new_tokens or run.max_new_tokens
    k = min(opts.prompts, len(run.prompts))
    first_look, second_look, how = fresh_prompts(run, model, k, seed)
    recorded = checks.recompute_ratios(run.prompts)
    warmup = run.header.get("warmup_tokens")
    warmup = min(warmup, n) if checks.is_int(warmup) and warmup >= 0 else min(8, n)
    log(f"retiming {run.header['candidate']['name']} vs {run.header['control']['name']} on {k} fresh prompts "
        f"x {opts.legs} legs, N={n}, {dev}: {how}")
    if not tree_control():
        log("no /proc here: a side is stopped as its worker's process group only, not as its whole process tree")
    measured = Measured()
    provenance = control_code(sides)
    was_reaper = set_subreaper(True)
    gpu = GpuWatch().start() if watches_gpu(dev) else None  # before the workers: no orphan of theirs
    audit_continues = ContinueCounter().install()
    try:
        findings += control_code_findings(provenance)
        workers = start_workers(sides, model_spec, dev, audit_continues, opts.sandbox)
        findings += sandbox_findings(workers["candidate"].launch.sandbox)
        try:
            time_looks(workers, (first_look, second_look), run.prompts, recorded[1], n, opts.legs, warmup, measured,
                       instrument=instrument)
        except WorkerError as exc:  # the decoder failed on a fresh prompt: a finding, not bad input
            findings.append(checks.finding("retime-error", "fail", exc.prompt_id, str(exc)))
        finally:
            for w in workers.values():
                w.close()
    finally:
        audit_continues.restore()
        if gpu is not None:
            gpu.stop()
        if was_reaper is False:
            set_subreaper(False)
    findings += process_findings(workers)
    findings += gpu_findings(gpu)
    findings += stop_findings(measured.timed)
    fresh, timed = [fp for fp, _ in measured.ran], measured.timed

    fresh_run = Run(path, {**run.header, "max_new_tokens": n}, timed, None, {})
    log(f"replaying the {sum(len(p.legs) for p in timed)} retimed legs through the pristine serial path ...")
    replayed, _, _ = replay_run(model, fresh_run, log)
    findings += divergence_findings(fresh_run, replayed)
    for p in timed:
        findings += checks.check_control_consistency(p)
        findings += checks.check_leg_spread(p)
    findings += load_findings(timed)
    findings += judge(run.prompts, recorded[1], timed)
    exact = {p.id: not replayed[p.id].divergences for p in timed}
    doc = build_document(run, sha, seed, how, fresh, timed, findings, recorded, n, opts.legs,
                         time.perf_counter() - started, exact, measured.remeasured, measured.second_look,
                         gpu_document(gpu))
    doc["control_code"] = provenance.summary() if provenance is not None else None
    doc["sandbox"] = workers["candidate"].launch.sandbox.describe() if workers["candidate"].launch.sandbox else None
    write_document(out_path, doc, render_table(doc))
    return EXIT_PASS if doc["verdict"] == "pass" else EXIT_FAIL
