"""Known-bad decoders the audit must catch (test-only; plug in with ``--decoder bad_decoders:Name``).

  Unverified   emits MTP drafts without verifying them: fast, wrong    -> exactness finding
  SkipLayers   skips backbone layers to go fast: wrong logits          -> exactness finding
  PromptCache  serial the first time, then tokens cached on the request -> warm-leg finding

Sampling cheats (``sampling = True``; greedy, each decodes exactly), each wrong at the first token
its shortcut changes (tests/test_sampled.py finds that token and its position):

  OtherSeed          samples with the seed after the one asked for
  ShiftedPositions   samples each token with the noise of the position after its own
  DropsFilter        samples at the temperature but ignores top-k, top-p and min-p
  DraftDistribution  spec that keeps every coupled draft unchecked (the draft's distribution)

Attacks on the timing from inside the harness's process (tests/test_timing_integrity.py):

  WarmupCache         every decode computes ``horizon`` tokens and caches them on the prompt, so a
                      warm-up on the timed prompt would make every timed leg a lookup
  PreparePromptCache  computes the answer in ``prepare_prompt`` (untimed) without being an instrument
  UnmarkedInstrument  spec-instrument's oracle without the instrument mark
  SlowsControl        prepare() makes the control's decode sleep
  ShortensOwnLegs     prepare() replaces the harness's timed_decode to cut its own legs to a quarter
  Unpinned            prepare() turns deterministic algorithms off and TF32 on
  Float64Default      prepare() makes float64 the default dtype
  PatchesClock        prepare() replaces time.perf_counter with a slower one
  RewritesLegs        prepare() makes the stream's writer cut its legs to a quarter as they are written

The same, from the end of the candidate's first timed leg (``TampersInLeg``), left in place for
the control's legs that follow; each pauses while the candidate itself decodes:

  TracesControl       a sys.settrace hook that burns time on every call of the control's decode
  ProfilesControl     the same through sys.setprofile
  TracesNewThreads    threading.settrace/setprofile hooks for the threads started later
  SpinningThread      a thread that spins holding the GIL (threading.Thread, or ``raw``: _thread)
  TunesGc             gc: thresholds that collect all the time, a callback that burns time on
                      each collection, or the collector switched off
  TorchThreads        more intra-op threads than the run began with
  AlarmsControl       an interval timer whose SIGALRM handler burns time
  EditsLegRecords     walks up the frames to the harness's list of this prompt's records and
                      inflates the control's legs (in place, or swaps in a forged record)

Each is built the way a real shortcut would be, not rigged to trip a particular check.
"""
from __future__ import annotations

import sys
import time

import torch
from torch import nn

from core.mtp import new_mtp_cache
from core.sampling import GREEDY, Sampler
from decoders.base import DecodeResult, DecodeStats, stop_index
from decoders.serial import SerialDecoder
from decoders.spec import InstrumentedSpecDecoder, SpecDecoder


def serial_tokens(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], int]:
    """Plain serial greedy (prefill, then one token per forward). Returns (tokens, forwards)."""
    from transformers import DynamicCache

    lm, eos = model.backbone, set(model.eos_token_ids)
    cache = DynamicCache(config=lm.config)
    out = lm(input_ids=torch.tensor([prompt_ids], device=model.device), past_key_values=cache,
             use_cache=True, logits_to_keep=1)
    tokens, forwards = [], 1
    while True:
        tok = int(out.logits[0, -1].argmax(-1).item())
        tokens.append(tok)
        if tok in eos or len(tokens) >= max_new_tokens:
            return tokens, forwards
        out = lm(input_ids=torch.tensor([[tok]], device=model.device), past_key_values=cache,
                 use_cache=True, logits_to_keep=1)
        forwards += 1


class Unverified:
    """MTP speculation that trusts its drafts: each round emits k drafts plus the backbone's
    token after them, and never checks a draft against the backbone."""

    name = "unverified"

    def __init__(self, k: int = 3):
        self.k = k
        self.model = None

    def prepare(self, model) -> None:
        model.require_mtp(self.name)
        self.model = model

    def config(self) -> dict:
        return {"k": self.k, "verify": False}

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], max_new_tokens: int) -> DecodeResult:
        from transformers import DynamicCache

        lm, head, dev = self.model.backbone, self.model.mtp, self.model.device
        eos = set(self.model.eos_token_ids)
        stats = DecodeStats()
        cache = DynamicCache(config=lm.config)
        out = lm.model(input_ids=torch.tensor([prompt_ids], device=dev), past_key_values=cache, use_cache=True)
        stats.forwards += 1
        hidden = out.last_hidden_state[:, -1:]
        nxt = lm.lm_head(hidden).argmax(-1).view(1, 1)
        pos = len(prompt_ids)
        tokens = [int(nxt.item())]
        while tokens[-1] not in eos and len(tokens) < max_new_tokens:
            mcache, h, tok, drafts = new_mtp_cache(head), hidden, nxt, []
            for i in range(self.k):
                h = head(h, tok, torch.tensor([pos - 1 + i], device=dev), lm, cache=mcache)
                tok = lm.lm_head(h).argmax(-1).view(1, 1)
                drafts.append(tok)
            block = torch.cat([nxt] + drafts, dim=1)
            ver = lm.model(input_ids=block, past_key_values=cache, use_cache=True)  # advance only
            stats.forwards += 1
            stats.record_round(self.k, self.k)
            hidden = ver.last_hidden_state[:, -1:]
            nxt = lm.lm_head(hidden).argmax(-1).view(1, 1)
            for t in [int(d) for d in drafts] + [int(nxt.item())]:
                tokens.append(t)
                if t in eos or len(tokens) >= max_new_tokens:
                    break
            pos += self.k + 1
        return DecodeResult(tokens, stats)


class _SampledSerial:
    """Serial decoding (HF forward + DynamicCache) whose token at each absolute position is
    ``choose(sampler, logits_row, position)``: here the control's own pick."""

    name = "sampled-serial"
    sampling = True

    def __init__(self):
        self.model = None

    def prepare(self, model) -> None:
        self.model = model

    def config(self) -> dict:
        return {"cheat": self.name}

    def choose(self, sampler: Sampler, row: torch.Tensor, position: int) -> int:
        return sampler.pick(row, position)

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], max_new_tokens: int, *, on_tokens=None,
               sampler: Sampler | None = None) -> DecodeResult:
        from transformers import DynamicCache

        sampler = sampler or GREEDY
        lm, eos = self.model.backbone, set(self.model.eos_token_ids)
        cache = DynamicCache(config=lm.config)
        out = lm(input_ids=torch.tensor([prompt_ids], device=self.model.device), past_key_values=cache,
                 use_cache=True, logits_to_keep=1)
        tokens = []
        while True:
            row, position = out.logits[0, -1], len(prompt_ids) + len(tokens)
            tok = sampler.pick(row, position) if sampler.greedy else self.choose(sampler, row, position)
            tokens.append(tok)
            if tok in eos or len(tokens) >= max_new_tokens:
                return DecodeResult(tokens, DecodeStats(forwards=len(tokens)))
            out = lm(input_ids=torch.tensor([[tok]], device=self.model.device), past_key_values=cache,
                     use_cache=True, logits_to_keep=1)


class OtherSeed(_SampledSerial):
    """Samples with seed + 1: every token an honest sample, none the one asked for."""

    name = "other-seed"

    def choose(self, sampler, row, position):
        return Sampler(sampler.temperature, sampler.top_k, sampler.top_p, sampler.min_p,
                       (sampler.seed + 1) % 2 ** 64).pick(row, position)


class ShiftedPositions(_SampledSerial):
    """Draws each token's noise at the next position (an off-by-one in the position count)."""

    name = "shifted-positions"

    def choose(self, sampler, row, position):
        return sampler.pick(row, position + 1)


class DropsFilter(_SampledSerial):
    """Samples at the asked temperature from the whole softmax: top-k, top-p, min-p ignored."""

    name = "drops-filter"

    def choose(self, sampler, row, position):
        return Sampler(temperature=sampler.temperature, seed=sampler.seed).pick(row, position)


class DraftDistribution(SpecDecoder):
    """``spec`` at depth 3 that keeps every coupled draft without comparing it with the target's
    pick: the tokens follow the draft's distribution; only each round's last token is the
    target's. Greedy it is spec itself."""

    name = "draft-distribution"

    def __init__(self, **kwargs):
        super().__init__(**{"depth": 3, **kwargs})

    def _pick_window(self, prog, block, depth):
        out = self.picks.out(prog)
        out[:depth].copy_(block[0, 1:])  # the drafts, unchecked
        self.picks.row(prog, depth)  # the target's token after them
        return out[:depth + 1].tolist(), depth


class _Skip(nn.Module):
    """Stands in for a decoder layer: passes the hidden state through untouched."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class SkipLayers:
    """Serial decoding with some backbone layers skipped (swapped for identities during decode
    and restored after, so the control sharing the model is unaffected)."""

    name = "skip-layers"

    def __init__(self, skip: tuple[int, ...] = (1,)):
        self.skip = skip
        self.model = None

    def prepare(self, model) -> None:
        self.model = model

    def config(self) -> dict:
        return {"skip": list(self.skip)}

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], max_new_tokens: int) -> DecodeResult:
        layers = self.model.backbone.model.layers
        saved = {i: layers[i] for i in self.skip}
        try:
            for i in self.skip:
                layers[i] = _Skip()
            tokens, forwards = serial_tokens(self.model, prompt_ids, max_new_tokens)
        finally:
            for i, layer in saved.items():
                layers[i] = layer
        return DecodeResult(tokens, DecodeStats(forwards=forwards))


class _Caching:
    """What the caching decoders below share: the model, and a cache they fill as they please."""

    def __init__(self):
        self.model = None
        self.cache: dict = {}

    def prepare(self, model) -> None:
        self.model = model


class PromptCache(_Caching):
    """Exact tokens, cheated time: decodes serially once per (prompt, N), then returns the
    cached tokens. (The harness's warm-up decodes fewer tokens than N, so leg 0 computes.)"""

    name = "prompt-cache"

    def config(self) -> dict:
        return {"cache": "keyed on (prompt tokens, max_new_tokens)"}

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], max_new_tokens: int) -> DecodeResult:
        key = (tuple(prompt_ids), max_new_tokens)
        if key in self.cache:
            return DecodeResult(list(self.cache[key]), DecodeStats(extra={"cache_hit": True}))
        tokens, forwards = serial_tokens(self.model, prompt_ids, max_new_tokens)
        self.cache[key] = tokens
        return DecodeResult(list(tokens), DecodeStats(forwards=forwards, extra={"cache_hit": False}))


# --------------------------------------------------------------------------- attacks on the timing


class WarmupCache(_Caching):
    """Exact tokens: each decode computes ``horizon`` tokens serially and caches them under the
    prompt, so any later decode of that prompt (up to ``horizon`` tokens) is a lookup. Were the
    warm-up decoding the timed prompt, every timed leg would be a lookup. ``calls`` logs
    (prompt_ids, max_new_tokens, hit) per decode."""

    name = "warmup-cache"
    calls: list = []

    def __init__(self, horizon: int = 64):
        super().__init__()
        self.horizon = horizon

    def config(self) -> dict:
        return {"horizon": self.horizon}

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], max_new_tokens: int) -> DecodeResult:
        key = tuple(prompt_ids)
        hit = key in self.cache and max_new_tokens <= self.horizon
        type(self).calls.append((list(prompt_ids), max_new_tokens, hit))
        if not hit:
            self.cache[key], _ = serial_tokens(self.model, list(prompt_ids), max(self.horizon, max_new_tokens))
        tokens = self.cache[key]
        return DecodeResult(tokens[:stop_index(tokens, set(self.model.eos_token_ids), max_new_tokens)],
                            DecodeStats(forwards=0 if hit else 1, extra={"cache_hit": hit}))


class HashPrefixCache(_Caching):
    """Exact tokens: caches each stream under a hash of the prompt's first 8 tokens; a later decode
    of that prompt is a lookup that sleeps 0.65x the computed decode's time, so later legs look
    plausibly faster (under the warm-leg flag's factor) instead of suspiciously instant."""

    name = "hash-prefix-cache"

    def config(self) -> dict:
        return {"cache": "keyed on a hash of the first 8 prompt tokens"}

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], max_new_tokens: int) -> DecodeResult:
        key = hash((tuple(prompt_ids[:8]), max_new_tokens))
        if key in self.cache:
            tokens, seconds = self.cache[key]
            time.sleep(0.65 * seconds)
            return DecodeResult(list(tokens), DecodeStats(extra={"cache_hit": True}))
        t0 = time.perf_counter()
        tokens, forwards = serial_tokens(self.model, list(prompt_ids), max_new_tokens)
        self.cache[key] = (tokens, time.perf_counter() - t0)
        return DecodeResult(list(tokens), DecodeStats(forwards=forwards, extra={"cache_hit": False}))


class PreparePromptCache(_Caching):
    """Not an instrument, yet computes each prompt's answer in ``prepare_prompt`` (which a harness
    calls untimed) and answers its decodes from it. ``calls`` logs ("prepare_prompt", ids) and
    ("decode", ids, hit)."""

    name = "prepare-prompt-cache"
    calls: list = []

    def config(self) -> dict:
        return {}

    @torch.inference_mode()
    def prepare_prompt(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        type(self).calls.append(("prepare_prompt", list(prompt_ids)))
        self.cache[(tuple(prompt_ids), max_new_tokens)], _ = serial_tokens(self.model, list(prompt_ids), max_new_tokens)

    @torch.inference_mode()
    def decode(self, prompt_ids: list[int], max_new_tokens: int) -> DecodeResult:
        key = (tuple(prompt_ids), max_new_tokens)
        hit = key in self.cache
        type(self).calls.append(("decode", list(prompt_ids), hit))
        tokens = self.cache[key] if hit else serial_tokens(self.model, list(prompt_ids), max_new_tokens)[0]
        return DecodeResult(list(tokens), DecodeStats(extra={"cache_hit": hit}))


class UnmarkedInstrument(InstrumentedSpecDecoder):
    """spec-instrument's oracle (the control's tokens, from ``prepare_prompt``) without the
    instrument mark, so its runs would be scored. ``calls`` logs (ids, inside_decode) per
    ``prepare_prompt`` call."""

    name = "unmarked-instrument"
    instrument = False
    calls: list = []

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.decoding = False

    def prepare_prompt(self, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> None:
        type(self).calls.append((list(prompt_ids), self.decoding))
        super().prepare_prompt(prompt_ids, max_new_tokens, **kwargs)

    def decode(self, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> DecodeResult:
        self.decoding = True
        try:
            return super().decode(prompt_ids, max_new_tokens, **kwargs)
        finally:
            self.decoding = False


class Tampers:
    """Exact serial decoding; ``tamper()`` runs at the end of prepare()."""

    name = "tampers"

    def __init__(self):
        self.inner = SerialDecoder()

    def prepare(self, model) -> None:
        self.inner.prepare(model)
        self.tamper()

    def tamper(self) -> None:
        raise NotImplementedError

    def config(self) -> dict:
        return {}

    def decode(self, prompt_ids, max_new_tokens) -> DecodeResult:
        return self.inner.decode(prompt_ids, max_new_tokens)


class SlowsControl(Tampers):
    name = "slows-control"

    def tamper(self) -> None:
        real, mine = SerialDecoder.decode, self.inner

        def decode(decoder, prompt_ids, max_new_tokens):
            if decoder is not mine:  # the harness's control
                time.sleep(0.02)
            return real(decoder, prompt_ids, max_new_tokens)

        SerialDecoder.decode = decode


class ShortensOwnLegs(Tampers):
    name = "shortens-own-legs"

    def tamper(self) -> None:
        timing = sys.modules["harness.timing"]
        real = timing.timed_decode

        def timed_decode(decoder, *args, **kwargs):  # whatever the harness passes (a sampler too)
            leg = real(decoder, *args, **kwargs)
            if decoder is self:
                leg["wall_s"] /= 4
                leg["t_end"] = leg["t_start"] + leg["wall_s"]
            return leg

        timing.timed_decode = timed_decode


class Unpinned(Tampers):
    name = "unpinned"

    def tamper(self) -> None:
        torch.use_deterministic_algorithms(False)
        torch.backends.cuda.matmul.allow_tf32 = True


class Float64Default(Tampers):
    name = "float64-default"

    def tamper(self) -> None:
        torch.set_default_dtype(torch.float64)


class PatchesClock(Tampers):
    name = "patches-clock"

    def tamper(self) -> None:
        real = time.perf_counter
        start = real()
        time.perf_counter = lambda: start + (real() - start) / 2


class RewritesLegs(Tampers):
    name = "rewrites-legs"

    def tamper(self) -> None:
        from core.schema import AtomicJsonlWriter

        real = AtomicJsonlWriter.write

        def write(writer, record):
            if record.get("type") == "leg" and record.get("role") == "candidate":
                record = {**record, "wall_s": record["wall_s"] / 4, "t_end": record["t_start"] + record["wall_s"] / 4}
            real(writer, record)

        AtomicJsonlWriter.write = write


class TampersInLeg(Tampers):
    """Exact serial decoding; ``tamper()`` runs at the end of the candidate's first timed leg (its
    second decode: the first is the warm-up). ``mine`` is true while this decoder decodes, so a
    hook can spare the candidate and burn only the control's time. ``undo()`` is for the tests."""

    burn_s = 0.0005
    mine = False

    def prepare(self, model) -> None:
        self.inner.prepare(model)
        self.decodes = 0

    def decode(self, prompt_ids, max_new_tokens) -> DecodeResult:
        type(self).mine = True
        try:
            out = self.inner.decode(prompt_ids, max_new_tokens)
        finally:
            type(self).mine = False
        self.decodes += 1
        if self.decodes == 2:
            self.tamper()
        return out

    @classmethod
    def burn(cls, *args):
        """A hook's body: busy for ``burn_s`` unless the candidate is decoding."""
        if not TampersInLeg.mine:
            end = time.perf_counter() + cls.burn_s
            while time.perf_counter() < end:
                pass


def _call_hook(frame, event, arg):
    if event == "call":
        TampersInLeg.burn()
    return None


class TracesControl(TampersInLeg):
    name = "traces-control"

    def tamper(self) -> None:
        sys.settrace(_call_hook)


class ProfilesControl(TampersInLeg):
    name = "profiles-control"

    def tamper(self) -> None:
        sys.setprofile(_call_hook)


class TracesNewThreads(TampersInLeg):
    name = "traces-new-threads"

    def tamper(self) -> None:
        import threading

        threading.settrace(_call_hook)
        threading.setprofile(_call_hook)


class SpinningThread(TampersInLeg):
    """A thread that spins in Python (so it takes the GIL from the main thread every switch
    interval) while the candidate is not decoding. ``stop`` ends it."""

    name = "spinning-thread"
    stop = None

    def __init__(self, raw: bool = False):
        super().__init__()
        self.raw = raw

    def tamper(self) -> None:
        import _thread
        import threading

        stop = type(self).stop = threading.Event()

        started = threading.Event()

        def spin():
            started.set()
            while not stop.is_set():
                if TampersInLeg.mine:
                    time.sleep(0.0005)  # the GIL back to the candidate
                else:
                    TampersInLeg.burn()

        if self.raw:  # a raw thread has no frame (so no place in sys._current_frames) before it first runs
            _thread.start_new_thread(spin, ())
            started.wait()
        else:
            threading.Thread(target=spin, name="prefetch", daemon=True).start()


class TunesGc(TampersInLeg):
    name = "tunes-gc"

    def __init__(self, how: str = "threshold"):
        super().__init__()
        self.how = how

    def tamper(self) -> None:
        import gc

        if self.how == "threshold":
            gc.set_threshold(50, 1, 1)
        elif self.how == "callback":
            gc.callbacks.append(TampersInLeg.burn)
        else:
            gc.disable()


class TorchThreads(TampersInLeg):
    name = "torch-threads"

    def tamper(self) -> None:
        torch.set_num_threads(torch.get_num_threads() + 3)


class AlarmsControl(TampersInLeg):
    name = "alarms-control"

    def tamper(self) -> None:
        import signal

        signal.signal(signal.SIGALRM, TampersInLeg.burn)
        signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)


class EditsLegRecords(TampersInLeg):
    """After each of its timed legs, finds the harness's list of this prompt's records in a frame
    above and doubles every control leg's time (``how="edit"``, in place) or swaps each control
    leg for a forged copy (``how="swap"``)."""

    name = "edits-leg-records"
    forged: list = []  # (prompt id, leg, the wall_s it left in the harness's list)

    def __init__(self, how: str = "edit"):
        super().__init__()
        self.how = how
        self.edited: set = set()

    def tamper(self) -> None:
        pass

    def decode(self, prompt_ids, max_new_tokens) -> DecodeResult:
        out = super().decode(prompt_ids, max_new_tokens)
        frame = sys._getframe(1)
        while frame is not None:
            records = frame.f_locals.get("records")
            if isinstance(records, list) and any(isinstance(r, dict) and r.get("type") == "leg" for r in records):
                for i, rec in enumerate(records):
                    key = (rec.get("prompt_id"), rec.get("leg"))
                    if rec.get("type") == "leg" and rec["role"] == "control" and key not in self.edited:
                        self.edited.add(key)
                        forged = rec if self.how == "edit" else dict(rec)
                        forged["wall_s"] *= 2
                        forged["t_end"] = forged["t_start"] + forged["wall_s"]
                        type(self).forged.append((rec["prompt_id"], rec["leg"], forged["wall_s"]))
                        records[i] = forged
                break
            frame = frame.f_back
        return out
